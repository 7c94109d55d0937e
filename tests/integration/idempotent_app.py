"""A gateway with the whole stack, for idempotency tests across server processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, IdempotencyMiddleware, connect

UPSTREAM = os.environ["UPSTREAM_URL"]
LEASE = float(os.environ.get("ASGI_DISCONNECT_LEASE", "15"))
backend = connect(os.environ["ASGI_DISCONNECT_URL"], lease=LEASE, sweep_interval=0.2)
clients: dict[str, httpx.AsyncClient] = {}


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with httpx.AsyncClient(base_url=UPSTREAM, timeout=60) as client:
        clients["upstream"] = client
        yield


async def chat(request: Request) -> StreamingResponse:
    body = await request.body()

    async def relay() -> AsyncIterator[bytes]:
        async with clients["upstream"].stream(
            "POST",
            "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        ) as upstream:
            async for chunk in upstream.aiter_raw():
                yield chunk

    return StreamingResponse(relay(), media_type="text/event-stream")


app = IdempotencyMiddleware(
    DisconnectMiddleware(
        Starlette(
            routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan
        ),
        backend=backend,
    ),
    backend=backend,
    lease=LEASE,
)
