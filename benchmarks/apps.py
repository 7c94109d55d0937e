"""The apps the benchmarks serve: the same Starlette routes, bare and wrapped."""

from __future__ import annotations

import asyncio
import logging

from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, MemoryBackend

SSE_EVENTS = 1000
_EVENT = b'data: {"choices":[{"delta":{"content":"token"}}]}\n\n'


async def small_json(request: object) -> JSONResponse:
    return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "ok": True})


async def _events():  # type: ignore[no-untyped-def]
    for _ in range(SSE_EVENTS):
        yield _EVENT


async def _paced_events():  # type: ignore[no-untyped-def]
    # As a relay does: every chunk comes after a trip through the event loop.
    for _ in range(SSE_EVENTS):
        yield _EVENT
        await asyncio.sleep(0)


async def sse(request: object) -> StreamingResponse:
    return StreamingResponse(_events(), media_type="text/event-stream")


async def sse_paced(request: object) -> StreamingResponse:
    return StreamingResponse(_paced_events(), media_type="text/event-stream")


def make_app() -> Starlette:
    return Starlette(
        routes=[Route("/json", small_json), Route("/sse", sse), Route("/sse-paced", sse_paced)]
    )


bare_app = make_app()
logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
# A durable backend keeps no finished generation in memory once it is flushed; the memory
# backend here keeps the last thousand (each stream's log holds 1,000 chunks), evicting the
# oldest an eighth at a time as it would in production.
wrapped_app = DisconnectMiddleware(make_app(), backend=MemoryBackend(max_generations=1000))
