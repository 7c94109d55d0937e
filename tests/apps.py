"""Apps shared by the tests: small, with hooks that record what the app saw."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

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


def http_scope(
    path: str, *, method: str = "GET", headers: list[tuple[bytes, bytes]] | None = None
) -> dict[str, Any]:
    """An HTTP scope as a server makes one (ASGI spec 2.3, HTTP/1.1, loopback), for tests
    that call an app with a ``receive`` and a ``send`` of their own."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers or [],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


def request_then_disconnect(gone: asyncio.Event) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A ``receive``: the request (no body), then ``http.disconnect`` once ``gone`` is set."""
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    return receive


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


async def the_generation(backend: Any) -> tuple[Any, bytes]:
    """The one generation a test's backend holds, through the store's public reads: its
    info (``GenerationInfo``) and its whole log."""
    (info,) = await backend.recent()
    body = b"".join([chunk async for chunk in backend.follow(info.id, 0)])
    return info, body
