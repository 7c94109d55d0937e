"""The gateway a rolling restart drains: served by uvicorn or hypercorn in a process of its
own (``DRAIN_UPSTREAM``: FakeProvider's URL, ``DRAIN_DB``: the SQLite file,
``DRAIN_DEADLINE``: seconds)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import connect, disconnect_policy, install
from asgi_disconnect.upstream import open_stream

client = httpx.AsyncClient(base_url=os.environ["DRAIN_UPSTREAM"], timeout=httpx.Timeout(None))


def upstream_request(request: Request) -> httpx.Request:
    return client.build_request(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "fake-model",
            "stream": True,
            "messages": [{"role": "user", "content": "hi"}],
        },
        headers={"x-fake-tokens": request.query_params.get("tokens", "50")},
    )


async def chat(request: Request) -> StreamingResponse:
    upstream = await open_stream(client, upstream_request(request))
    return StreamingResponse(upstream, media_type="text/event-stream")


@disconnect_policy("detach")
async def report(request: Request) -> StreamingResponse:
    upstream = await open_stream(client, upstream_request(request))
    return StreamingResponse(upstream, media_type="text/event-stream")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    yield
    await client.aclose()


app = Starlette(
    routes=[Route("/chat", chat, methods=["POST"]), Route("/report", report, methods=["POST"])],
    lifespan=lifespan,
)
install(
    app,
    backend=connect(f"sqlite:///{os.environ['DRAIN_DB']}"),
    drain=os.environ.get("DRAIN_OFF") is None
    and {"deadline": float(os.environ.get("DRAIN_DEADLINE", "2")), "retry_after": 3},
)
