"""The test gateway with the package's stack at either placement a user may choose.

- ``outermost``: :class:`DisconnectMiddleware` is the ASGI app the server calls, with
  :class:`MeteringMiddleware` inside it and the FastAPI app (with Starlette's
  ``ServerErrorMiddleware``) inside both: the order ``install()`` uses, moved out of
  Starlette's stack, so the middleware gets the server's own ``send``.
- ``inside``: ``install(app)``, inside Starlette's ``ServerErrorMiddleware``, whose ``send``
  wrapper is a coroutine function.

`outermost` and `inside` are factories for servers that import the app themselves
(``granian --factory tests.integration.matrix_app:outermost``); they read the upstream's
URL from ``ASGI_DISCONNECT_MATRIX_UPSTREAM``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, MeteringMiddleware
from tests.apps import as_tester
from tests.integration.gateway import make_gateway

if TYPE_CHECKING:
    from collections.abc import Sequence

    from starlette.types import ASGIApp

    from asgi_disconnect import Backend, UsageSink

Placement = Literal["outermost", "inside"]
PLACEMENTS: tuple[Placement, ...] = ("outermost", "inside")
UPSTREAM_ENV = "ASGI_DISCONNECT_MATRIX_UPSTREAM"


def make_app(
    upstream: str,
    placement: Placement,
    *,
    backend: Backend | None = None,
    sinks: Sequence[UsageSink] = (),
    **options: Any,
) -> tuple[ASGIApp, dict[str, bytearray]]:
    """The gateway in front of `upstream` and the bytes it produced per generation id.

    `options` go to :class:`DisconnectMiddleware`; usage records go to `sinks` and to the
    backend's usage table, as with ``install()``.
    """
    backend = backend if backend is not None else MemoryBackend()
    options.setdefault("principal", as_tester)  # the tests read back as their caller
    if placement == "inside":
        return make_gateway(upstream, backend=backend, sinks=sinks, **options)
    app, produced = make_gateway(upstream, bare=True)
    metered = MeteringMiddleware(app, sinks=(*sinks, backend.record_usage))
    return DisconnectMiddleware(metered, backend=backend, **options), produced


def outermost() -> ASGIApp:
    return make_app(os.environ[UPSTREAM_ENV], "outermost")[0]


def inside() -> ASGIApp:
    return make_app(os.environ[UPSTREAM_ENV], "inside")[0]
