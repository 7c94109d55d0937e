"""DisconnectMiddleware driven in-process, with clients that disconnect or stop reading."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.middleware.gzip import GZipMiddleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, Router

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, Status, disconnect_policy
from asgi_disconnect.testing import drive, lifespan
from asgi_disconnect.upstream import track
from tests.apps import (
    Probe,
    as_tester,
    http_scope,
    request_then_disconnect,
    sse_app,
    the_generation,
)

pytestmark = pytest.mark.anyio


def wrap(app: Starlette, **options: object) -> DisconnectMiddleware:
    options.setdefault("backend", MemoryBackend())
    options.setdefault("principal", as_tester)
    return DisconnectMiddleware(app, **options)  # type: ignore[arg-type]


async def status_of(mw: DisconnectMiddleware, generation_id: str) -> dict[str, object]:
    result = await drive(mw, path=f"/generations/{generation_id}")
    assert result.status == 200, result.body
    return msgspec.json.decode(result.body)  # type: ignore[no-any-return]


async def wait_status(
    mw: DisconnectMiddleware, generation_id: str, status: str
) -> dict[str, object]:
    with pytest.MonkeyPatch.context():
        async with asyncio.timeout(5):
            while True:
                info = await status_of(mw, generation_id)
                if info["status"] == status:
                    return info
                await asyncio.sleep(0.01)


async def test_json_response_passes_through_with_generation_id() -> None:
    mw = wrap(sse_app(Probe()))
    result = await drive(mw, path="/json")
    assert result.status == 200
    assert result.body == b'{"ok":true}'
    assert result.complete
    generation_id = result.header("x-generation-id")
    assert generation_id is not None
    assert generation_id.startswith("gen_")
    info = await status_of(mw, generation_id)
    assert info["status"] == "complete"
    assert info["size"] == len(result.body)


async def test_generation_ids_are_unique_and_long() -> None:
    mw = wrap(sse_app(Probe()))
    ids = {(await drive(mw, path="/json")).header("x-generation-id") for _ in range(50)}
    assert len(ids) == 50
    assert all(i is not None and len(i) == 28 for i in ids)


async def test_stream_is_delivered_whole_and_resumable_byte_identical() -> None:
    mw = wrap(sse_app(Probe(), chunks=20, delay=0))
    result = await drive(mw, path="/cancel")
    assert result.complete
    assert result.body.count(b"data: ") == 20
    generation_id = result.header("x-generation-id")
    replay = await drive(mw, path=f"/generations/{generation_id}/stream")
    assert replay.status == 200
    assert replay.body == result.body
    assert replay.header("content-type") == "text/event-stream; charset=utf-8"
    middle = await drive(mw, path=f"/generations/{generation_id}/stream", query_string=b"offset=37")
    assert middle.body == result.body[37:]
    assert middle.header("x-generation-offset") == "37"


async def test_request_body_reaches_the_app_in_parts() -> None:
    mw = wrap(sse_app(Probe()))
    result = await drive(mw, method="POST", path="/echo", body_chunks=[b"ab", b"cd", b"", b"ef"])
    assert result.body == b"abcdef"


async def test_cancel_on_disconnect_cancels_the_app() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=100, delay=0.01))
    result = await drive(mw, path="/cancel", disconnect_after_bytes=60)
    async with asyncio.timeout(5):
        await probe.cancelled.wait()
    assert not probe.finished.is_set()
    assert probe.chunks_produced < 100
    generation_id = result.header("x-generation-id")
    assert generation_id is not None
    info = await status_of(mw, generation_id)
    assert info["status"] == "cancelled"
    assert info["policy"] == "cancel"
    assert mw.counters.cancelled == 1
    assert mw.counters.detached == 0


async def test_cancel_before_the_response_started() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=100, delay=0.05))
    result = await drive(mw, path="/slow-json", disconnect_after_seconds=0.1)
    assert result.status is None
    assert probe.cancelled.is_set()
    assert not probe.finished.is_set()
    assert mw.counters.cancelled == 1


async def test_cancelled_stream_resumed_ends_with_an_error_frame() -> None:
    mw = wrap(sse_app(Probe(), chunks=100, delay=0.01))
    result = await drive(mw, path="/cancel", disconnect_after_bytes=60)
    generation_id = result.header("x-generation-id")
    replay = await drive(mw, path=f"/generations/{generation_id}/stream")
    assert replay.body.startswith(result.body[:60])
    assert replay.body.endswith(b"\n\n")
    assert b"event: error\ndata: " in replay.body
    assert b'"type":"cancelled"' in replay.body


async def test_detach_keeps_generating_after_disconnect() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=30, delay=0.01))
    async with lifespan(mw):
        result = await drive(mw, path="/detach", disconnect_after_bytes=60)
        assert not probe.finished.is_set()
        generation_id = result.header("x-generation-id")
        assert generation_id is not None
        info = await wait_status(mw, generation_id, "complete")
        assert probe.finished.is_set()
        assert not probe.cancelled.is_set()
        assert info["detached"] is True
        assert info["policy"] == "detach"
        replay = await drive(mw, path=f"/generations/{generation_id}/stream")
        assert replay.body.count(b"data: ") == 30
        assert replay.body.startswith(result.body)
    assert mw.counters.detached == 1
    assert mw.counters.detach_completed == 1
    assert mw.counters.cancelled == 0


async def test_detach_resume_at_an_offset_follows_live() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=40, delay=0.02))
    async with lifespan(mw):
        result = await drive(mw, path="/detach", disconnect_after_bytes=30)
        generation_id = result.header("x-generation-id")
        live = await drive(
            mw, path=f"/generations/{generation_id}/stream", query_string=b"offset=30"
        )
        # The resume started while the generation ran and ended when it finished.
        assert probe.finished.is_set()
        assert live.complete
        full = await drive(mw, path=f"/generations/{generation_id}/stream")
        assert live.body == full.body[30:]
        assert full.body.count(b"data: ") == 40


async def test_detach_under_spec_2_4_absorbs_oserror_on_send() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=20, delay=0.005))
    async with lifespan(mw):
        result = await drive(mw, path="/detach", disconnect_after_bytes=30, spec_version="2.4")
        generation_id = result.header("x-generation-id")
        assert generation_id is not None
        await wait_status(mw, generation_id, "complete")
    assert probe.finished.is_set()


async def test_detach_non_streaming_endpoint_finishes_after_early_disconnect() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=10, delay=0.02))
    async with lifespan(mw):
        result = await drive(mw, path="/slow-json-detach", disconnect_after_seconds=0.05)
        assert result.status is None
        async with asyncio.timeout(5):
            await probe.finished.wait()
    assert mw.counters.detached == 1


async def test_shutdown_interrupts_detached_generations_after_the_deadline() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=1000, delay=0.01), shutdown_timeout=0.1)
    async with lifespan(mw):
        result = await drive(mw, path="/detach", disconnect_after_bytes=30)
        generation_id = result.header("x-generation-id")
        assert generation_id is not None
    assert probe.cancelled.is_set()
    info = await status_of(mw, generation_id)
    assert info["status"] == "interrupted"
    replay = await drive(mw, path=f"/generations/{generation_id}/stream")
    assert b'"type":"interrupted"' in replay.body


async def test_shutdown_waits_for_detached_generations_within_the_deadline() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=20, delay=0.01), shutdown_timeout=10)
    async with lifespan(mw):
        await drive(mw, path="/detach", disconnect_after_bytes=30)
    assert probe.finished.is_set()
    assert not probe.cancelled.is_set()


async def test_without_lifespan_detach_falls_back_to_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=10, delay=0.01))
    await drive(mw, path="/detach", disconnect_after_bytes=30)
    # The request itself waited for the generation.
    assert probe.finished.is_set()
    await drive(mw, path="/detach", disconnect_after_bytes=30)
    warnings = [r for r in caplog.records if "lifespan" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING


async def test_stalled_client_does_not_stall_the_producer_under_detach() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=200, delay=0), max_lag_bytes=1 << 20)
    async with lifespan(mw):
        task = asyncio.ensure_future(
            drive(mw, path="/detach", stop_reading_after_bytes=10, disconnect_after_seconds=2)
        )
        async with asyncio.timeout(1.5):
            await probe.finished.wait()
        assert not task.done()
        result = await task
    assert len(result.body) < 200 * 20
    assert probe.chunks_produced == 200


async def test_stalled_client_holds_the_producer_at_the_byte_lag_then_is_cancelled() -> None:
    probe = Probe()
    mw = wrap(
        sse_app(probe, chunks=100_000, delay=0.0005, size=200),
        max_lag_bytes=64 * 1024,
        max_lag_seconds=0.5,
    )
    result = await drive(mw, path="/cancel", stop_reading_after_bytes=1, timeout=10)
    assert probe.cancelled.is_set()
    assert not probe.finished.is_set()
    assert mw.counters.cancelled == 1
    assert result.complete is False
    generation_id = result.header("x-generation-id")
    assert generation_id is not None
    info = await status_of(mw, generation_id)
    assert info["status"] == "cancelled"
    # The app waited at the byte limit until the client counted as gone: the log stayed
    # small, and the stream was not produced to its end.
    assert 64 * 1024 < int(info["size"]) < 256 * 1024  # type: ignore[call-overload]


async def test_stalled_client_beyond_the_time_lag_is_cancelled() -> None:
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=1000, delay=0.01), max_lag_seconds=0.2)
    async with asyncio.timeout(5):
        await drive(mw, path="/cancel", stop_reading_after_bytes=1)
    assert probe.cancelled.is_set()
    assert mw.counters.cancelled == 1


async def test_error_after_headers_on_sse_is_an_error_frame() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield b"data: one\n\n"
        raise RuntimeError("upstream broke")

    async def endpoint(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    mw = wrap(Starlette(routes=[Route("/", endpoint)]))
    with pytest.raises(RuntimeError, match="upstream broke"):
        await drive(mw)
    # drive raised, so look at the log instead of the client's copy.
    info, body = await the_generation(mw.backend)
    assert info.status is Status.FAILED
    assert body.startswith(b"data: one\n\n")
    assert body.endswith(b"\n\n")
    frame = body[len(b"data: one\n\n") :]
    assert frame.startswith(b"event: error\ndata: ")
    payload = msgspec.json.decode(frame.split(b"data: ", 1)[1])
    assert payload["error"]["type"] == "stream_error"
    assert payload["error"]["generation_id"] == info.id
    assert "upstream broke" not in frame.decode()


async def test_error_frame_reaches_the_connected_client() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield b"data: one\n\n"
        await asyncio.sleep(0.01)
        raise RuntimeError("upstream broke")

    async def endpoint(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    inner = DisconnectMiddleware(Starlette(routes=[Route("/", endpoint)]), backend=MemoryBackend())
    seen: list[dict[str, object]] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        async def spy(message):  # type: ignore[no-untyped-def]
            seen.append(message)
            await send(message)

        with contextlib.suppress(RuntimeError):
            await inner(scope, receive, spy)

    result = await drive(app)
    assert result.complete
    assert result.body.startswith(b"data: one\n\nevent: error\n")
    assert seen[-1]["type"] == "http.response.body"
    assert seen[-1]["more_body"] is False


async def test_error_after_headers_on_other_streams_is_not_completed() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"partial"
        raise RuntimeError("boom")

    @disconnect_policy("cancel")  # a generation by its route's choice, ndjson as it is
    async def endpoint(request: Request) -> StreamingResponse:
        return StreamingResponse(chunks(), media_type="application/x-ndjson")

    mw = wrap(Starlette(routes=[Route("/", endpoint)]))
    complete: list[bool] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        async def spy(message):  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.body" and not message.get("more_body"):
                complete.append(True)
            await send(message)

        await mw(scope, receive, spy)

    with pytest.raises(RuntimeError, match="boom"):
        await drive(app)
    assert complete == []
    info, body = await the_generation(mw.backend)
    assert info.status is Status.FAILED
    assert body == b"partial"


async def test_error_before_headers_propagates() -> None:
    async def endpoint(request: Request) -> Response:
        raise ValueError("bad")

    seen: list[int] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        # What the server sees when the app raises before any response was sent.
        async def spy(message):  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.start":
                seen.append(message["status"])

        await DisconnectMiddleware(Router(routes=[Route("/", endpoint)]), backend=MemoryBackend())(
            scope, receive, spy
        )

    with pytest.raises(ValueError, match="bad"):
        await drive(app)
    assert seen == []


async def test_tracked_upstream_is_closed_on_cancel() -> None:
    closed = asyncio.Event()

    class Upstream:
        async def aclose(self) -> None:
            closed.set()

    async def endpoint(request: Request) -> StreamingResponse:
        assert track(Upstream())

        async def body() -> AsyncIterator[bytes]:
            for _ in range(100):
                yield b"x" * 10
                await asyncio.sleep(0.01)

        return StreamingResponse(body())

    mw = wrap(Starlette(routes=[Route("/", endpoint)]))
    await drive(mw, disconnect_after_bytes=20)
    assert closed.is_set()


def test_track_outside_a_request_reports_false() -> None:
    class Upstream:
        async def aclose(self) -> None:
            pass

    assert track(Upstream()) is False


async def test_under_base_http_middleware_and_gzip() -> None:
    class Noop(BaseHTTPMiddleware):
        async def dispatch(self, request, call_next):  # type: ignore[no-untyped-def]
            response = await call_next(request)
            response.headers["x-noop"] = "1"
            return response

    cancelled = asyncio.Event()

    async def lines() -> AsyncIterator[bytes]:
        try:
            for i in range(40):
                yield b'{"n": %d, "pad": "%s"}\n' % (i, b"x" * 400)
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def endpoint(request: Request) -> StreamingResponse:
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    inner = Starlette(
        routes=[Route("/", endpoint)],
        middleware=[Middleware(Noop), Middleware(GZipMiddleware, minimum_size=10)],
    )
    mw = wrap(inner)
    full = await drive(mw, headers=[("accept-encoding", "gzip")])
    assert full.header("content-encoding") == "gzip"
    assert full.header("x-noop") == "1"
    assert gzip.decompress(full.body).count(b"\n") == 40
    cut = await drive(mw, disconnect_after_bytes=100)
    assert not cut.complete
    async with asyncio.timeout(5):
        await cancelled.wait()


async def test_policy_callable_default_reads_the_scope() -> None:
    probe = Probe()
    calls: list[str] = []

    def tenant_policy(scope: dict[str, object]) -> str:
        calls.append(str(scope["path"]))
        return "detach"

    mw = wrap(sse_app(probe, chunks=20, delay=0.01), policy=tenant_policy)
    async with lifespan(mw):
        await drive(mw, path="/cancel", disconnect_after_bytes=30)
        async with asyncio.timeout(5):
            await probe.finished.wait()
    assert calls == ["/cancel"]
    assert mw.counters.detached == 1


async def test_policy_is_not_resolved_without_a_disconnect() -> None:
    def explode(scope: object) -> str:
        raise AssertionError("resolved without a disconnect")

    mw = wrap(sse_app(Probe(), chunks=5, delay=0), policy=explode)
    result = await drive(mw, path="/cancel")
    assert result.complete


async def test_decorator_with_a_callable_sees_progress() -> None:
    probe = Probe()

    def nearly_done(scope: dict[str, object]) -> str:
        state = scope["asgi_disconnect"]
        return "detach" if state.produced_bytes > 200 else "cancel"  # type: ignore[attr-defined]

    async def events() -> AsyncIterator[bytes]:
        for i in range(30):
            yield b"data: %02d\n\n" % i
            await asyncio.sleep(0.01)
        probe.finished.set()

    @disconnect_policy(nearly_done)
    async def endpoint(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    mw = wrap(Starlette(routes=[Route("/", endpoint)]))
    async with lifespan(mw):
        await drive(mw, disconnect_after_bytes=20)
        assert mw.counters.cancelled == 1
        await drive(mw, disconnect_after_bytes=250)
        assert mw.counters.detached == 1
        async with asyncio.timeout(5):
            await probe.finished.wait()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_lag_bytes": 0}, "max_lag_bytes"),
        ({"max_lag_seconds": 0}, "max_lag_seconds"),
        ({"shutdown_timeout": -1}, "shutdown_timeout"),
        ({"resume_prefix": "generations"}, "resume_prefix"),
        ({"resume_prefix": "/g/"}, "resume_prefix"),
        ({"policy": "finish"}, "cancel' or 'detach"),
    ],
)
def test_constructor_rejects_bad_options(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DisconnectMiddleware(Starlette(), backend=MemoryBackend(), **kwargs)  # type: ignore[arg-type]


def test_decorator_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="cancel' or 'detach"):
        disconnect_policy("finish")  # type: ignore[arg-type]


def test_no_backend_warns_that_detached_output_is_not_durable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    DisconnectMiddleware(Starlette())
    assert any("will not survive a restart" in r.getMessage() for r in caplog.records)


async def test_other_scopes_pass_through() -> None:
    seen: list[str] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        seen.append(scope["type"])

    mw = wrap(app)  # type: ignore[arg-type]
    await mw({"type": "websocket"}, None, None)  # type: ignore[arg-type]
    assert seen == ["websocket"]


async def test_the_lag_deadline_acts_at_max_lag_seconds_for_the_send_that_waits() -> None:
    """A client that reads slowly once, then stops: the send that stalls is judged by its
    own deadline, not by a timer set for the first slow send (which let it run 1.5 times
    as long: 45 s for the default 30)."""
    probe = Probe()
    mw = wrap(sse_app(probe, chunks=10_000, delay=0.001), max_lag_seconds=3.0)
    loop = asyncio.get_running_loop()
    sent = 0
    stalled_at: float | None = None
    gone = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        nonlocal sent, stalled_at
        if message["type"] != "http.response.body":
            return
        sent += 1
        if sent == 3:
            await asyncio.sleep(0.5)  # slow once: the lag timer is set now
        elif sent > 3:
            stalled_at = loop.time()
            await gone.wait()  # then it reads no more, with the socket open

    scope = http_scope("/cancel")
    receive = request_then_disconnect(gone)
    async with asyncio.timeout(10):
        await mw(scope, receive, send)
        await probe.cancelled.wait()
    gone.set()
    assert stalled_at is not None
    waited = loop.time() - stalled_at
    assert mw.counters.cancelled == 1
    # At the deadline, not before it; a timer set at the slow send fired 4 s after.
    assert 3.0 <= waited < 3.6, waited


def test_a_receive_that_never_waits_does_not_take_the_event_loop() -> None:
    """A hand-made ``receive`` that answers ``http.request`` on every call (Starlette's own
    tests have one): after the body's last part the watch stops reading it, where it used
    to read it for ever without giving the loop a turn. Run in a thread of its own, so that
    a loop taken for ever fails the test rather than hang it."""
    import threading

    from starlette.responses import PlainTextResponse

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    mw = DisconnectMiddleware(PlainTextResponse("hello"), backend=MemoryBackend())
    runner = threading.Thread(
        target=asyncio.run, args=(mw(http_scope("/"), receive, send),), daemon=True
    )
    runner.start()
    runner.join(10)
    assert not runner.is_alive(), "the request never ended: its loop is taken"
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[-1]["body"] == b"hello"
