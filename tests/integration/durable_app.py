"""A detached producer served by a separate uvicorn process, configured by environment.

Each event carries its index and the time it was produced, so a test can tell which
output a crash was allowed to lose.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, connect, disconnect_policy
from tests.apps import as_tester

FLUSH_INTERVAL = float(os.environ.get("ASGI_DISCONNECT_FLUSH_INTERVAL", "0.05"))


@disconnect_policy("detach")
async def produce(request: Request) -> StreamingResponse:
    count = int(request.query_params.get("n", "100"))
    interval = float(request.query_params.get("interval", "0.01"))

    async def events() -> AsyncIterator[bytes]:
        for i in range(count):
            yield f"data: {i} {time.time():.6f}\n\n".encode()
            await asyncio.sleep(interval)

    return StreamingResponse(events(), media_type="text/event-stream")


app = DisconnectMiddleware(
    Starlette(routes=[Route("/produce", produce)]),
    principal=as_tester,  # the tests read back as their caller
    backend=connect(
        os.environ["ASGI_DISCONNECT_URL"],
        flush_interval=FLUSH_INTERVAL,
        lease=float(os.environ.get("ASGI_DISCONNECT_LEASE", "15")),
        sweep_interval=0.2,
        poll_interval=float(os.environ.get("ASGI_DISCONNECT_POLL", "0.05")),
    ),
)
