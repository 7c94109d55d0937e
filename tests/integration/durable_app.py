"""A detached producer served by a separate uvicorn process, configured by environment.

Each event carries its index and the time it was produced, so a test can tell which
output a crash was allowed to lose. ``GET /flush-window`` says the backend's flush window
now; ``ASGI_DISCONNECT_SLOW_COMMIT`` (seconds, SQLite) makes every commit that long, as a
slow disk would.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, DurableBackend, connect, disconnect_policy
from tests.apps import as_tester

FLUSH_INTERVAL = float(os.environ.get("ASGI_DISCONNECT_FLUSH_INTERVAL", "0.05"))
# The flush window's ceiling under load; unset, the backend's default (four intervals).
MAX_FLUSH_INTERVAL = os.environ.get("ASGI_DISCONNECT_MAX_FLUSH_INTERVAL")
SLOW_COMMIT = float(os.environ.get("ASGI_DISCONNECT_SLOW_COMMIT", "0"))


def slow_disk(db: sqlite3.Connection) -> None:
    def trace(statement: str) -> None:
        if statement == "commit":
            time.sleep(SLOW_COMMIT)

    db.set_trace_callback(trace)


@disconnect_policy("detach")
async def produce(request: Request) -> StreamingResponse:
    count = int(request.query_params.get("n", "100"))
    interval = float(request.query_params.get("interval", "0.01"))

    async def events() -> AsyncIterator[bytes]:
        for i in range(count):
            yield f"data: {i} {time.time():.6f}\n\n".encode()
            await asyncio.sleep(interval)

    return StreamingResponse(events(), media_type="text/event-stream")


backend = connect(
    os.environ["ASGI_DISCONNECT_URL"],
    flush_interval=FLUSH_INTERVAL,
    max_flush_interval=None if MAX_FLUSH_INTERVAL is None else float(MAX_FLUSH_INTERVAL),
    lease=float(os.environ.get("ASGI_DISCONNECT_LEASE", "15")),
    sweep_interval=0.2,
    poll_interval=float(os.environ.get("ASGI_DISCONNECT_POLL", "0.05")),
    **({"init": slow_disk} if SLOW_COMMIT else {}),
)


async def flush_window(request: Request) -> JSONResponse:
    assert isinstance(backend, DurableBackend)
    return JSONResponse({"window": backend.flush_window})


app = DisconnectMiddleware(
    Starlette(routes=[Route("/produce", produce), Route("/flush-window", flush_window)]),
    principal=as_tester,  # the tests read back as their caller
    backend=backend,
)
