"""The soak's bare relay: the gateway's two routes relaying the same upstream with httpx's
``client.stream`` and nothing of asgi_disconnect, for time to first byte beside the gateway."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

FORWARDED = ("authorization", "content-type", "x-fake-tokens", "x-fake-rate")
FORWARDED += ("x-fake-first-token-delay",)

client = httpx.AsyncClient(
    base_url=os.environ.get("UPSTREAM_URL", "http://127.0.0.1:1"),
    timeout=httpx.Timeout(connect=10.0, read=None, write=30.0, pool=10.0),
    limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
)


async def relay(request: Request) -> Response:
    headers = {k: v for k, v in request.headers.items() if k in FORWARDED}
    outgoing = client.build_request(
        "POST", "/v1/chat/completions", content=await request.body(), headers=headers
    )
    upstream = await client.send(outgoing, stream=True)

    async def body() -> AsyncIterator[bytes]:
        async for chunk in upstream.aiter_raw():
            yield chunk

    return StreamingResponse(
        body(),
        status_code=upstream.status_code,
        media_type="text/event-stream",
        background=BackgroundTask(upstream.aclose),
    )


app = Starlette(
    routes=[
        Route("/v1/chat/completions", relay, methods=["POST"]),
        Route("/v1/reports", relay, methods=["POST"]),
    ]
)
