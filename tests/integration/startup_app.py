"""Apps whose backend comes from ASGI_DISCONNECT_URL, for startup failures under a real server.

``alone`` is DisconnectMiddleware around a Starlette app; ``installed`` a Starlette app with
``install(app, backend=...)``; ``idempotent`` the same with ``idempotency=True``, so that
IdempotencyMiddleware is outermost and owns the lifespan.
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, connect, install


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("served")


URL = os.environ["ASGI_DISCONNECT_URL"]

alone = DisconnectMiddleware(Starlette(routes=[Route("/", hello)]), backend=connect(URL))

installed = Starlette(routes=[Route("/", hello)])
install(installed, backend=connect(URL))

idempotent = Starlette(routes=[Route("/", hello)])
install(idempotent, backend=connect(URL), idempotency=True)
