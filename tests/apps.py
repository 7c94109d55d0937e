"""Apps shared by the tests: small, with hooks that record what the app saw."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import disconnect_policy

# Tests that are not about who a caller is run as one principal: an anonymous caller (no
# credential header) can read nothing back.
TESTER = "tester"


def as_tester(scope: object) -> str:
    return TESTER


async def eventually(
    check: Callable[[], object], timeout: float = 5.0, what: str = "the condition"
) -> None:
    """Wait until ``check()`` (a value, or an awaitable of one) is true, polling; fail with
    ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        await asyncio.sleep(0.01)


@dataclass
class Probe:
    """What a test app observed, with events to wait on."""

    chunks_produced: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    saw_disconnect: bool = False


def sse_app(probe: Probe, *, chunks: int = 50, delay: float = 0.01, size: int = 16) -> Starlette:
    """``/cancel`` and ``/detach`` stream ``chunks`` SSE events, ``delay`` apart."""

    async def events() -> AsyncIterator[bytes]:
        try:
            for i in range(chunks):
                probe.chunks_produced += 1
                yield f"data: {i:0{size}d}\n\n".encode()
                await asyncio.sleep(delay)
            probe.finished.set()
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise

    async def cancel(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    @disconnect_policy("detach")
    async def detach(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    async def slow_json(request: Request) -> JSONResponse:
        try:
            await asyncio.sleep(delay * chunks)
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        probe.finished.set()
        return JSONResponse({"done": True})

    @disconnect_policy("detach")
    async def slow_json_detach(request: Request) -> JSONResponse:
        return await slow_json(request)

    @disconnect_policy("cancel")  # chose a policy: a generation, though its JSON is no LLM's
    async def json(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    async def echo(request: Request) -> Response:
        return Response(await request.body(), media_type="application/octet-stream")

    return Starlette(
        routes=[
            Route("/cancel", cancel),
            Route("/detach", detach),
            Route("/slow-json", slow_json),
            Route("/slow-json-detach", slow_json_detach),
            Route("/json", json),
            Route("/echo", echo, methods=["POST"]),
        ]
    )
