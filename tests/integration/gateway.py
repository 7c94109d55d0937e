"""A small LLM gateway in every endpoint shape the middleware must handle.

Each route forwards to an upstream (FakeProvider) and records, per generation id, the
bytes it produced, so tests can compare a resumed body with what the app really sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from sse_starlette import EventSourceResponse as SSEStarletteResponse
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.routing import Mount, Route

from asgi_disconnect import MemoryBackend, disconnect_policy, install
from asgi_disconnect.upstream import track_response
from tests.apps import as_tester

CHAT = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}


def make_gateway(
    upstream: str, *, bare: bool = False, **options: Any
) -> tuple[FastAPI, dict[str, bytearray]]:
    """The gateway with the package's stack installed, or ``bare`` for a control."""
    produced: dict[str, bytearray] = {}
    clients: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(
            base_url=upstream, timeout=30, event_hooks={"response": [track_response]}
        ) as client:
            clients["upstream"] = client
            yield

    def generation_id(request: Request) -> str:
        state = request.scope.get("asgi_disconnect")
        return state.generation_id if state is not None else f"bare-{id(request)}"

    def record(request: Request) -> bytearray:
        return produced.setdefault(generation_id(request), bytearray())

    async def forward(request: Request) -> AsyncIterator[bytes]:
        sink = record(request)
        # The generation id travels as OpenAI's `user` field, so tests can pair the calls.
        body = {**CHAT, "user": generation_id(request)}
        async with clients["upstream"].stream("POST", "/v1/chat/completions", json=body) as r:
            async for chunk in r.aiter_raw():
                sink += chunk
                yield chunk

    app = FastAPI(lifespan=lifespan)

    @app.post("/in-generator")
    async def in_generator(request: Request) -> StreamingResponse:
        return StreamingResponse(forward(request), media_type="text/event-stream")

    @app.post("/in-endpoint")
    async def in_endpoint(request: Request) -> StreamingResponse:
        client = clients["upstream"]
        upstream_response = await client.send(
            client.build_request("POST", "/v1/chat/completions", json=CHAT), stream=True
        )
        return StreamingResponse(
            upstream_response.aiter_raw(),
            media_type="text/event-stream",
            background=BackgroundTask(upstream_response.aclose),
        )

    @app.post("/fastapi-sse", response_class=EventSourceResponse)
    async def fastapi_sse(request: Request) -> AsyncIterator[ServerSentEvent]:
        async with clients["upstream"].stream("POST", "/v1/chat/completions", json=CHAT) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    yield ServerSentEvent(raw_data=line[6:])

    @app.post("/sse-starlette")
    async def sse_starlette(request: Request) -> SSEStarletteResponse:
        async def events() -> AsyncIterator[dict[str, str]]:
            async with clients["upstream"].stream("POST", "/v1/chat/completions", json=CHAT) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        yield {"data": line[6:]}

        return SSEStarletteResponse(events())

    @app.post("/non-streaming")
    async def non_streaming(request: Request) -> JSONResponse:
        r = await clients["upstream"].post("/v1/chat/completions", json={**CHAT, "stream": False})
        return JSONResponse(r.json())

    @app.post("/detach")
    @disconnect_policy("detach")
    async def detach(request: Request) -> StreamingResponse:
        return StreamingResponse(forward(request), media_type="text/event-stream")

    router = APIRouter(prefix="/router")

    @router.post("/detach")
    @disconnect_policy("detach")
    async def routed_detach(request: Request) -> StreamingResponse:
        return StreamingResponse(forward(request), media_type="text/event-stream")

    app.include_router(router)

    @disconnect_policy("detach")
    async def mounted_detach(request: Request) -> StreamingResponse:
        return StreamingResponse(forward(request), media_type="text/event-stream")

    async def mounted_cancel(request: Request) -> StreamingResponse:
        return StreamingResponse(forward(request), media_type="text/event-stream")

    app.router.routes.append(
        Mount(
            "/starlette",
            app=Starlette(
                routes=[
                    Route("/detach", mounted_detach, methods=["POST"]),
                    Route("/in-generator", mounted_cancel, methods=["POST"]),
                ]
            ),
        )
    )

    if not bare:
        options.setdefault("backend", MemoryBackend())
        options.setdefault("principal", as_tester)  # the tests read back as their caller
        install(app, **options)
    return app, produced
