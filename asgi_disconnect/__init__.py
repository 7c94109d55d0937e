"""Deliberate client-disconnect handling for streamed responses in ASGI apps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._backends import Backend, BackendUnavailable, DurableBackend, MemoryBackend, connect
from ._disconnect import DisconnectMiddleware, default_principal
from ._log import GenerationInfo, Status
from ._policy import Policy, disconnect_policy
from ._state import RequestState

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = [
    "Backend",
    "BackendUnavailable",
    "DisconnectMiddleware",
    "DurableBackend",
    "GenerationInfo",
    "MemoryBackend",
    "Policy",
    "RequestState",
    "Status",
    "connect",
    "default_principal",
    "disconnect_policy",
    "install",
]

__version__ = "0.1.0"


def install(app: Starlette, **options: Any) -> None:
    """Add the package's middleware stack to a Starlette or FastAPI ``app``.

    ``options`` are passed to :class:`DisconnectMiddleware` (``backend``, ``policy``,
    ``principal``, ``resume_prefix``, ...).
    """
    app.add_middleware(DisconnectMiddleware, **options)
