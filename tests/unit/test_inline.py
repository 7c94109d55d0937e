"""Routes learned to be cancel-only run in the request's own task: the same behaviour."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Host, Route, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asgi_disconnect import (
    DisconnectMiddleware,
    MemoryBackend,
    RequestState,
    Status,
    disconnect_policy,
)
from asgi_disconnect.testing import drive, lifespan
from asgi_disconnect.upstream import track
from tests.apps import Probe, as_tester, sse_app, the_generation

pytestmark = pytest.mark.anyio


class Served:
    """The app behind the middleware, switchable, noting the task each request ran in."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.tasks: list[asyncio.Task[Any] | None] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.tasks.append(asyncio.current_task())
        await self.app(scope, receive, send)


def stand_in(app: Starlette) -> Starlette:
    """``app``'s routes, each with its endpoint's policy, answering 204 at once: a first
    request to each teaches the middleware its routes without doing their work."""

    def answer_for(endpoint: Any) -> Any:
        async def answer(request: Request) -> Response:
            return Response(status_code=204)

        answer.__dict__.update(getattr(endpoint, "__dict__", {}))
        return answer

    return Starlette(
        routes=[
            Route(route.path, answer_for(route.endpoint), methods=route.methods)
            for route in app.routes
            if isinstance(route, Route)
        ]
    )


async def inline(
    app: ASGIApp, *routes: tuple[str, str], like: Starlette | None = None, **options: object
) -> DisconnectMiddleware:
    """``app`` behind DisconnectMiddleware once a first request to each of ``routes`` (on a
    stand-in with the routes of ``like``, by default ``app``) taught it they can only
    cancel: they run in the request's own task from then on."""
    options.setdefault("principal", as_tester)
    template = like if like is not None else app
    assert isinstance(template, Starlette)
    served = Served(stand_in(template))
    mw = DisconnectMiddleware(served, backend=MemoryBackend(), **options)  # type: ignore[arg-type]
    for method, path in routes:
        assert (await drive(mw, method=method, path=path)).status == 204
    for method, path in routes:
        await drive(mw, method=method, path=path)
        assert served.tasks[-1] is asyncio.current_task(), f"{method} {path} is not inline"
    served.app = app
    return mw


async def ran_inline(mw: DisconnectMiddleware, served: Served, path: str) -> bool:
    """Whether a request to ``path`` runs in the request's own task."""
    await drive(mw, path=path)
    return served.tasks[-1] is asyncio.current_task()


async def test_routes_are_learned_after_routing() -> None:
    served = Served(sse_app(Probe(), chunks=2, delay=0))
    mw = DisconnectMiddleware(served, backend=MemoryBackend())
    first = [await ran_inline(mw, served, path) for path in ("/json", "/cancel", "/missing")]
    then = [await ran_inline(mw, served, path) for path in ("/json", "/cancel", "/missing")]
    async with lifespan(mw):
        detach = [await ran_inline(mw, served, "/detach") for _ in range(2)]
    assert first == [False, False, False]  # not known before its first request is routed
    assert then == [True, True, False]  # a 404 has no route to learn
    assert detach == [False, False]


async def test_a_detach_default_is_never_inline() -> None:
    served = Served(sse_app(Probe(), chunks=2, delay=0))
    mw = DisconnectMiddleware(served, backend=MemoryBackend(), policy="detach")
    # A route that chose no policy of its own detaches by default: never inline.
    assert [await ran_inline(mw, served, "/cancel") for _ in range(2)] == [False, False]


async def test_inline_json_and_stream_are_whole_and_resumable() -> None:
    mw = await inline(sse_app(Probe(), chunks=20, delay=0), ("GET", "/json"), ("GET", "/cancel"))
    small = await drive(mw, path="/json")
    assert small.body == b'{"ok":true}'
    assert small.header("x-generation-id") is not None
    stream = await drive(mw, path="/cancel")
    assert stream.complete
    assert stream.body.count(b"data: ") == 20
    replay = await drive(mw, path=f"/generations/{stream.header('x-generation-id')}/stream")
    assert replay.body == stream.body


async def test_inline_request_body() -> None:
    mw = await inline(sse_app(Probe()), ("POST", "/echo"))
    result = await drive(mw, method="POST", path="/echo", body_chunks=[b"ab", b"cd", b"ef"])
    assert result.body == b"abcdef"


async def test_inline_cancel_on_disconnect() -> None:
    probe = Probe()
    mw = await inline(sse_app(probe, chunks=100, delay=0.01), ("GET", "/cancel"))
    result = await drive(mw, path="/cancel", disconnect_after_bytes=60)
    assert probe.cancelled.is_set()
    assert not probe.finished.is_set()
    assert mw.counters.cancelled == 1
    info, _ = await the_generation(mw.backend)
    assert info.status is Status.CANCELLED
    assert result.complete is False


async def test_inline_cancel_before_the_response_started() -> None:
    probe = Probe()
    mw = await inline(sse_app(probe, chunks=100, delay=0.05), ("GET", "/slow-json"))
    result = await drive(mw, path="/slow-json", disconnect_after_seconds=0.1)
    assert result.status is None
    assert probe.cancelled.is_set()
    assert mw.counters.cancelled == 1


async def test_inline_stalled_client_is_cancelled_by_the_lag_limits() -> None:
    probe = Probe()
    mw = await inline(
        sse_app(probe, chunks=100_000, delay=0.0005, size=200),
        ("GET", "/cancel"),
        max_lag_bytes=64 * 1024,
        max_lag_seconds=0.5,
    )
    await drive(mw, path="/cancel", stop_reading_after_bytes=1)
    assert probe.cancelled.is_set()
    # The app waited at the byte limit: it produced a few hundred KiB, not the stream.
    assert probe.chunks_produced * 216 < 512 * 1024
    timed = Probe()
    mw = await inline(
        sse_app(timed, chunks=1000, delay=0.01), ("GET", "/cancel"), max_lag_seconds=0.2
    )
    async with asyncio.timeout(5):
        await drive(mw, path="/cancel", stop_reading_after_bytes=1)
    assert timed.cancelled.is_set()


async def test_inline_error_frame_and_tracked_upstream() -> None:
    closed = asyncio.Event()

    class Upstream:
        async def aclose(self) -> None:
            closed.set()

    async def events() -> AsyncIterator[bytes]:
        yield b"data: one\n\n"
        await asyncio.sleep(0.01)
        raise RuntimeError("upstream broke")

    async def failing(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    async def slow(request: Request) -> StreamingResponse:
        track(Upstream())

        async def body() -> AsyncIterator[bytes]:
            for _ in range(100):
                yield b"x" * 10
                await asyncio.sleep(0.01)

        return StreamingResponse(body())

    app = Starlette(routes=[Route("/fail", failing), Route("/slow", slow)])
    mw = await inline(app, ("GET", "/fail"), ("GET", "/slow"))
    seen: list[bytes] = []

    async def spy_app(scope, receive, send):  # type: ignore[no-untyped-def]
        async def spy(message):  # type: ignore[no-untyped-def]
            seen.append(message.get("body", b""))
            await send(message)

        await mw(scope, receive, spy)

    with pytest.raises(RuntimeError, match="upstream broke"):
        await drive(spy_app, path="/fail")
    assert b"".join(seen).startswith(b"data: one\n\nevent: error\n")
    await drive(mw, path="/slow", disconnect_after_bytes=20)
    assert closed.is_set()


async def test_a_mispredicted_detach_still_finishes_and_is_relearned() -> None:
    """One path, two hosts: learned cancel-only on one, it detaches on the other."""
    probe = Probe()
    cancelling = sse_app(Probe(), chunks=2, delay=0)
    detaching = sse_app(probe, chunks=20, delay=0.01)
    cancel_route = next(r for r in cancelling.routes if getattr(r, "path", "") == "/cancel")
    detach_route = next(r for r in detaching.routes if getattr(r, "path", "") == "/detach")
    app = Starlette(
        routes=[
            Host("a.test", Router([Route("/s", cancel_route.endpoint)])),
            Host("b.test", Router([Route("/s", detach_route.endpoint)])),
        ]
    )
    served = Served(app)
    mw = DisconnectMiddleware(served, backend=MemoryBackend(), principal=as_tester)
    on_a = [("host", "a.test")]
    on_b = [("host", "b.test")]
    async with lifespan(mw):
        await drive(mw, path="/s", headers=on_a)  # learned: this path can only cancel
        result = await drive(mw, path="/s", headers=on_b, disconnect_after_bytes=30)
        assert served.tasks[-1] is asyncio.current_task()  # run inline, as predicted
        assert probe.finished.is_set()
        assert mw.counters.detached == 1
        assert mw.counters.detach_completed == 1
        info = await mw.backend.get(result.header("x-generation-id"))
        assert info is not None
        assert info.status is Status.COMPLETE
        await drive(mw, path="/s", headers=on_a)
        assert served.tasks[-1] is not asyncio.current_task()  # relearned: supervised


class _AwaitableOnly:
    """An awaitable that is not a coroutine, as some ASGI apps return from ``__call__``."""

    def __init__(self, coroutine: object) -> None:
        self.coroutine = coroutine

    def __await__(self):  # type: ignore[no-untyped-def]
        return self.coroutine.__await__()  # type: ignore[attr-defined]


async def test_an_app_returning_a_plain_awaitable_runs_inline() -> None:
    app = sse_app(Probe(), chunks=5, delay=0)

    def plain(scope, receive, send):  # type: ignore[no-untyped-def]
        return _AwaitableOnly(app(scope, receive, send))

    mw = await inline(plain, ("GET", "/json"), ("GET", "/cancel"), like=app)
    small = await drive(mw, path="/json")
    assert small.body == b'{"ok":true}'
    stream = await drive(mw, path="/cancel")
    assert stream.complete
    assert stream.body.count(b"data: ") == 5
    assert mw.app.tasks[-1] is asyncio.current_task()  # type: ignore[attr-defined]


async def test_chunks_after_the_client_left_during_the_start_are_not_sent() -> None:
    # The server takes the start slowly; the client leaves meanwhile. The detached app
    # goes on: its chunks reach the log, never the server.
    async def stream(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for index in range(3):
                yield f"data: {index}\n\n".encode()

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/s", disconnect_policy("detach")(stream))])
    mw = DisconnectMiddleware(app, backend=MemoryBackend())
    sent: list[str] = []
    states: list[RequestState] = []

    async def server(scope: Scope, receive: Receive, send: Send) -> None:
        async def slow_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                await asyncio.sleep(0.1)
            sent.append(message["type"])
            await send(message)

        await mw(scope, receive, slow_send)
        states.append(scope["asgi_disconnect"])

    async with lifespan(mw):
        result = await drive(server, path="/s", disconnect_after_seconds=0.02)
        assert result.disconnected
        generation = states[0].generation
        assert generation is not None
        async with asyncio.timeout(5):
            while generation.running:
                await asyncio.sleep(0.01)
    assert sent == ["http.response.start"]
    assert generation.status is Status.COMPLETE
    assert b"".join(generation.chunks_from(0)) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert states[0].delivered_bytes == 0
    assert mw.counters.detached == 1
