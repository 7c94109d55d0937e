"""The demo's logging: uvicorn's own configuration, plus the package's loggers at INFO
(one line per LLM request, ``asgi_disconnect.requests``) through uvicorn's handler."""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["log_config"]


def log_config() -> dict[str, Any]:
    """uvicorn's ``LOGGING_CONFIG`` with the ``asgi_disconnect`` logger at INFO."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["asgi_disconnect"] = {
        "handlers": ["default"],
        "level": "INFO",
        "propagate": False,
    }
    # The demo's own FakeProvider: its calls show in the gateway's lines already.
    config["loggers"]["asgi_disconnect.testing"] = {"level": "WARNING"}
    return config
