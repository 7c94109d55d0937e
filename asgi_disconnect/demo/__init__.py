"""The demo gateway (``asgi-disconnect demo``): FastAPI on the whole stack, a web page, and
FakeProvider or a real provider upstream. Needs the ``demo`` extra."""

from __future__ import annotations

from ._gateway import make_app

__all__ = ["make_app"]
