"""The seams between the middlewares and the server: one regression test per finding.

Each test names the finding of the contract issue it covers; each failed before the contract
module, the client writer and the lifecycle owner existed.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from asgi_disconnect import (
    BackendUnavailable,
    DisconnectMiddleware,
    Ending,
    MemoryBackend,
    MeteringMiddleware,
    RequestState,
    UsageRecord,
    default_principal,
    disconnect_policy,
    install,
)
from asgi_disconnect.testing import drive, lifespan
from tests.apps import Probe, eventually, sse_app

pytestmark = pytest.mark.anyio

Message = dict[str, Any]


def http_scope(
    path: str,
    *,
    method: str = "GET",
    headers: list[tuple[bytes, bytes]] | None = None,
    extensions: dict[str, Any] | None = None,
) -> dict[str, Any]:
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
        "extensions": extensions or {},
    }


def request_then_wait(done: asyncio.Event) -> Callable[[], Awaitable[Message]]:
    """A ``receive`` that gives the request, then reports a disconnect once ``done``."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    return receive


async def info_of(mw: DisconnectMiddleware, generation_id: str | None) -> dict[str, Any]:
    assert generation_id is not None
    info = await mw.backend.get(generation_id)
    assert info is not None
    return msgspec.to_builtins(info)  # type: ignore[no-any-return]


@pytest.fixture(params=["supervised", "inline"])
def path_kind(request: pytest.FixtureRequest) -> str:
    """Both ways the middleware runs an app: in a supervised task, or inline in the request's
    own task (a route learnt to be cancel-only)."""
    return str(request.param)


class Endpoint:
    """A raw ASGI app as a Starlette route's endpoint, so routing marks the scope."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def routed(app: Any, path: str = "/") -> Starlette:
    return Starlette(routes=[Route(path, Endpoint(app))])


async def warm(mw: DisconnectMiddleware, path: str, kind: str) -> None:
    if kind == "inline":
        # One finished request teaches the middleware that the route can only cancel.
        await drive(mw, path=path)


# -- 1: an outer send wrapper with a timeout -------------------------------------------


def with_send_timeout(app: Any, seconds: float) -> Any:
    async def outer(scope: Any, receive: Any, send: Any) -> None:
        async def timed_send(message: Message) -> None:
            async with asyncio.timeout(seconds):
                await send(message)

        await app(scope, receive, timed_send)

    return outer


async def test_an_outer_send_timeout_cancels_the_send_not_the_app(path_kind: str) -> None:
    probe = Probe()
    mw = DisconnectMiddleware(sse_app(probe, chunks=400, delay=0.005), backend=MemoryBackend())
    await warm(mw, "/cancel", path_kind)
    probe = Probe()
    mw.app = sse_app(probe, chunks=400, delay=0.005)
    result = await drive(with_send_timeout(mw, 0.2), path="/cancel", stop_reading_after_bytes=200)
    info = await info_of(mw, result.header("x-generation-id"))
    # The timer belonged to the send: the client counts as gone and the policy ran.
    assert info["status"] == "cancelled", info
    assert mw.counters.cancelled == 1
    assert mw.counters.disconnects == 1
    assert probe.cancelled.is_set()


async def test_an_outer_send_timeout_under_detach_lets_the_work_finish() -> None:
    probe = Probe()
    mw = DisconnectMiddleware(sse_app(probe, chunks=60, delay=0.005), backend=MemoryBackend())
    result = await drive(with_send_timeout(mw, 0.2), path="/detach", stop_reading_after_bytes=200)
    await asyncio.wait_for(probe.finished.wait(), 5)
    await eventually(lambda: mw.counters.detach_completed == 1)
    info = await info_of(mw, result.header("x-generation-id"))
    assert info["status"] == "complete"
    assert mw.counters.detached == 1


# -- 2, 3: one principal for every middleware, on every record --------------------------


def user_of(scope: Any) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-user":
            return str(value.decode())
    return None


async def test_install_gives_its_principal_to_idempotency() -> None:
    runs = 0

    @disconnect_policy("cancel")
    async def charge(request: Request) -> JSONResponse:
        nonlocal runs
        runs += 1
        return JSONResponse({"run": runs})

    app = Starlette(routes=[Route("/charge", charge, methods=["POST"])])
    install(app, backend=MemoryBackend(), principal=user_of, idempotency=True)
    alice = [("x-user", "alice"), ("idempotency-key", "k1")]
    first = await drive(app, method="POST", path="/charge", headers=alice, body=b"{}")
    again = await drive(app, method="POST", path="/charge", headers=alice, body=b"{}")
    bob = await drive(
        app,
        method="POST",
        path="/charge",
        headers=[("x-user", "bob"), ("idempotency-key", "k1")],
        body=b"{}",
    )
    assert first.status == 200, first.body
    assert again.header("idempotent-replayed") == "true"
    assert again.body == first.body
    assert bob.header("idempotent-replayed") is None
    assert runs == 2
    # The generation belongs to the same caller as the claim.
    generation_id = first.header("x-generation-id")
    status = await drive(app, path=f"/generations/{generation_id}", headers=[("x-user", "alice")])
    assert status.status == 200
    other = await drive(app, path=f"/generations/{generation_id}", headers=[("x-user", "bob")])
    assert other.status == 404


async def test_the_principal_is_resolved_once_for_every_middleware() -> None:
    calls = 0

    def counting(scope: Any) -> str | None:
        nonlocal calls
        calls += 1
        return user_of(scope)

    app = sse_app(Probe(), chunks=3, delay=0)
    install(app, backend=MemoryBackend(), principal=counting, idempotency=True)
    result = await drive(
        app, method="POST", path="/echo", headers=[("x-user", "a"), ("idempotency-key", "k")]
    )
    assert result.status == 200
    assert calls == 1


async def test_a_request_cancelled_before_its_response_has_an_owner() -> None:
    records: list[UsageRecord] = []
    probe = Probe()
    app = sse_app(probe, chunks=100, delay=0.01)
    install(app, backend=MemoryBackend(), sinks=[records.append])
    headers = [("authorization", "Bearer alice")]
    await drive(app, path="/slow-json", headers=headers, disconnect_after_seconds=0.05)
    await eventually(lambda: records)
    (record,) = records
    assert record.outcome == "cancelled"
    assert record.status_code is None
    expected = default_principal({"headers": [(b"authorization", b"Bearer alice")]})
    assert record.principal == expected != ""


# -- 4: a policy that cannot be resolved ------------------------------------------------


async def test_a_policy_that_cannot_be_resolved_cancels_loudly(
    caplog: pytest.LogCaptureFixture, path_kind: str
) -> None:
    probe = Probe()
    mw = DisconnectMiddleware(
        sse_app(probe, chunks=100, delay=0.01), backend=MemoryBackend(), policy=lambda s: "detatch"
    )
    await warm(mw, "/cancel", path_kind)
    result = await drive(mw, path="/cancel", disconnect_after_bytes=50)
    await asyncio.wait_for(probe.cancelled.wait(), 5)
    info = await info_of(mw, result.header("x-generation-id"))
    assert info["status"] == "cancelled"
    assert mw.counters.cancelled == 1
    assert mw.counters.policy_errors == 1
    assert "could not be resolved; cancelling instead" in caplog.text
    assert "detatch" in caplog.text


# -- 6: the package's errors -----------------------------------------------------------


def test_backend_unavailable_is_not_an_oserror() -> None:
    from asgi_disconnect import AsgiDisconnectError

    assert issubclass(BackendUnavailable, AsgiDisconnectError)
    assert not issubclass(BackendUnavailable, OSError)


# -- 8: shutdown in order --------------------------------------------------------------


class LifespanDriver:
    """The server's side of the lifespan protocol, one step at a time."""

    def __init__(self, app: Any) -> None:
        self.to_app: asyncio.Queue[Message] = asyncio.Queue()
        self.from_app: asyncio.Queue[Message] = asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self.task = asyncio.ensure_future(app(scope, self.to_app.get, self.from_app.put))

    async def step(self, kind: str) -> Message:
        await self.to_app.put({"type": kind})
        async with asyncio.timeout(10):
            return await self.from_app.get()


async def test_requests_during_shutdown_are_refused_and_spawn_nothing() -> None:
    probe = Probe()
    mw = DisconnectMiddleware(
        sse_app(probe, chunks=40, delay=0.01), backend=MemoryBackend(), shutdown_timeout=5
    )
    server = LifespanDriver(mw)
    assert (await server.step("lifespan.startup"))["type"] == "lifespan.startup.complete"
    detached = await drive(mw, path="/detach", disconnect_after_bytes=30)
    assert mw.counters.detached == 1
    shutdown = asyncio.ensure_future(server.step("lifespan.shutdown"))
    await eventually(lambda: mw.supervisor.stopping)
    refused = await drive(mw, path="/cancel")
    assert refused.status == 503
    assert refused.header("retry-after") == "1"
    assert msgspec.json.decode(refused.body)["type"] == "urn:asgi-disconnect:problem:shutting-down"
    assert (await shutdown)["type"] == "lifespan.shutdown.complete"
    await server.task
    info = await info_of(mw, detached.header("x-generation-id"))
    assert info["status"] == "complete"


async def test_usage_is_flushed_before_the_backend_closes(tmp_path: Path) -> None:
    from asgi_disconnect import connect

    url = f"sqlite:///{tmp_path / 'g.db'}"
    probe = Probe()
    app = sse_app(probe, chunks=30, delay=0.01)
    install(app, backend=connect(url), shutdown_timeout=5)
    async with lifespan(app):
        result = await drive(app, path="/detach", disconnect_after_bytes=30)
    generation_id = result.header("x-generation-id")
    assert generation_id is not None
    reader = connect(url)
    await reader.open()
    try:
        records = await reader.usage_of(generation_id)
        info = await reader.get(generation_id)
    finally:
        await reader.aclose()
    assert info is not None
    assert info.status == "complete"
    assert len(records) == 1
    assert records[0].detached


# -- 9: added twice --------------------------------------------------------------------


def test_install_twice_is_refused() -> None:
    app = sse_app(Probe())
    install(app, backend=MemoryBackend())
    with pytest.raises(RuntimeError, match="already called"):
        install(app, backend=MemoryBackend())


async def test_the_middleware_twice_fails_the_startup_and_each_request() -> None:
    inner = DisconnectMiddleware(sse_app(Probe(), chunks=2, delay=0), backend=MemoryBackend())
    outer = DisconnectMiddleware(inner, backend=MemoryBackend())
    server = LifespanDriver(outer)
    failed = await server.step("lifespan.startup")
    assert failed["type"] == "lifespan.startup.failed"
    assert "installed twice" in failed["message"]
    with pytest.raises(RuntimeError, match="installed twice"):
        await server.task  # and the lifespan call raises it, as Starlette's router does
    # A server without the lifespan protocol finds out at the first request.
    inner = DisconnectMiddleware(sse_app(Probe(), chunks=2, delay=0), backend=MemoryBackend())
    outer = DisconnectMiddleware(inner, backend=MemoryBackend())
    with pytest.raises(RuntimeError, match="installed twice"):
        await drive(outer, path="/cancel")


# -- 10, 11: every message keeps its place ----------------------------------------------


async def test_trailers_follow_a_held_body(path_kind: str) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        headers = [(b"content-type", b"text/plain")]
        await send(
            {"type": "http.response.start", "status": 200, "headers": headers, "trailers": True}
        )
        await send({"type": "http.response.body", "body": b"one ", "more_body": True})
        await send({"type": "http.response.body", "body": b"two", "more_body": False})
        await send(
            {
                "type": "http.response.trailers",
                "headers": [(b"x-sum", b"7")],
                "more_trailers": False,
            }
        )

    # A policy callable makes every response a generation (see test_what_becomes_a_generation).
    mw = DisconnectMiddleware(routed(app), backend=MemoryBackend(), policy=lambda scope: "cancel")
    seen: list[Message] = []

    async def run_once() -> RequestState:
        done = asyncio.Event()
        seen.clear()

        async def slow_send(message: Message) -> None:
            if message["type"] == "http.response.body":
                await asyncio.sleep(0.01)
            seen.append(message)
            if message["type"] == "http.response.trailers":
                done.set()

        scope = http_scope("/")
        async with asyncio.timeout(5):
            await mw(scope, request_then_wait(done), slow_send)
        return scope["asgi_disconnect"]  # type: ignore[no-any-return]

    if path_kind == "inline":
        await run_once()
    state = await run_once()
    kinds = [m["type"] for m in seen]
    assert kinds[0] == "http.response.start"
    assert kinds[-1] == "http.response.trailers"
    body = b"".join(m.get("body", b"") for m in seen if m["type"] == "http.response.body")
    assert body == b"one two"
    assert [m for m in seen if m["type"] == "http.response.body"][-1]["more_body"] is False
    assert state.ending is Ending.DELIVERED
    assert state.generation is not None
    assert state.generation.status == "complete"


@pytest.mark.parametrize("generation", [True, False], ids=["generation", "not-a-generation"])
async def test_pathsend_ends_the_response_and_background_work_runs(
    tmp_path: Path, generation: bool
) -> None:
    path = tmp_path / "report.txt"
    path.write_bytes(b"x" * 1000)
    background_done = asyncio.Event()

    async def after() -> None:
        await asyncio.sleep(0.05)
        background_done.set()

    async def download(request: Request) -> FileResponse:
        return FileResponse(path, background=BackgroundTask(after))

    if generation:
        download = disconnect_policy("cancel")(download)

    records: list[UsageRecord] = []
    app = Starlette(routes=[Route("/file", download)])
    install(app, backend=MemoryBackend(), sinks=[records.append])
    done = asyncio.Event()
    seen: list[Message] = []

    async def send(message: Message) -> None:
        seen.append(message)
        if message["type"] == "http.response.pathsend":
            done.set()  # the server sent the file: the response is complete

    scope = http_scope("/file", extensions={"http.response.pathsend": {}})
    async with asyncio.timeout(5):
        await app(scope, request_then_wait(done), send)
    assert [m["type"] for m in seen] == ["http.response.start", "http.response.pathsend"]
    assert background_done.is_set()
    state: RequestState = scope["asgi_disconnect"]
    assert state.ending is Ending.DELIVERED
    if generation:
        assert state.generation is not None
        assert state.generation.status == "complete"
    else:  # a file is no LLM exchange: nothing written, no header
        assert state.generation is None
        assert all(name != b"x-generation-id" for name, _ in seen[0]["headers"])
    await asyncio.sleep(0.05)
    assert records == []  # a file is not an LLM response: metering stepped aside


# -- 12: an error from the server's send reaches the server ------------------------------


async def test_an_error_raised_by_a_waiting_send_reaches_the_server(path_kind: str) -> None:
    probe = Probe()
    mw = DisconnectMiddleware(sse_app(probe, chunks=50, delay=0.001), backend=MemoryBackend())
    await warm(mw, "/cancel", path_kind)
    unretrieved: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: unretrieved.append(context))

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            await asyncio.sleep(0.01)
            raise RuntimeError("Response content longer than Content-Length")

    scope = http_scope("/cancel")
    try:
        with pytest.raises(RuntimeError, match="longer than Content-Length"):
            async with asyncio.timeout(5):
                await mw(scope, request_then_wait(asyncio.Event()), send)
        await asyncio.sleep(0.05)
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert unretrieved == []
    state: RequestState = scope["asgi_disconnect"]
    assert state.ending is Ending.FAILED
    assert state.generation is not None
    assert state.generation.status != "running"


# -- 13: a request cancelled by the server -----------------------------------------------


async def test_a_cancelled_request_returns_after_the_apps_teardown(path_kind: str) -> None:
    teardown: list[str] = []
    started = asyncio.Event()

    warming = True

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if warming:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        started.set()
        try:
            await asyncio.sleep(30)
        finally:
            await asyncio.sleep(0.05)  # a yield dependency's teardown, say
            teardown.append("done")

    mw = DisconnectMiddleware(routed(app), backend=MemoryBackend())
    if path_kind == "inline":
        await drive(mw, path="/")
    warming = False
    sends_after: list[Message] = []
    returned = False

    async def send(message: Message) -> None:
        if returned:
            sends_after.append(message)

    request = asyncio.ensure_future(mw(http_scope("/"), request_then_wait(asyncio.Event()), send))
    await asyncio.wait_for(started.wait(), 5)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    returned = True
    assert teardown == ["done"]
    await asyncio.sleep(0.1)
    assert sends_after == []


async def test_without_lifespan_a_detached_request_cancelled_at_shutdown_is_marked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    probe = Probe()
    mw = DisconnectMiddleware(sse_app(probe, chunks=500, delay=0.01), backend=MemoryBackend())
    scope = http_scope("/detach")
    done = asyncio.Event()
    got_bytes = asyncio.Event()

    async def send(message: Message) -> None:
        if message.get("body"):
            got_bytes.set()

    request = asyncio.ensure_future(mw(scope, request_then_wait(done), send))
    await asyncio.wait_for(got_bytes.wait(), 5)
    done.set()  # the client leaves: detached, but owned by the request (no lifespan)
    await asyncio.sleep(0.05)
    assert not request.done()
    request.cancel()  # the server stops
    with pytest.raises(asyncio.CancelledError):
        await request
    state: RequestState = scope["asgi_disconnect"]
    assert state.detached
    assert state.generation is not None
    assert state.generation.status == "interrupted"
    assert "lifespan" in (state.generation.error or "")
    assert probe.cancelled.is_set()


# -- 14: trio is refused with a clear message -------------------------------------------


def test_trio_is_refused_with_a_clear_message() -> None:
    trio = pytest.importorskip("trio")
    from starlette.testclient import TestClient

    mw = DisconnectMiddleware(sse_app(Probe(), chunks=2, delay=0), backend=MemoryBackend())
    client = TestClient(mw, backend="trio")
    with pytest.raises(RuntimeError, match=r"runs on asyncio only, and this .* runs trio"):
        client.get("/cancel")

    sent: list[Message] = []

    async def serve_lifespan() -> None:
        messages = [{"type": "lifespan.startup"}]

        async def receive() -> Message:
            if messages:
                return messages.pop(0)
            await trio.sleep_forever()
            raise AssertionError

        async def send(message: Message) -> None:
            sent.append(message)

        await mw({"type": "lifespan", "state": {}}, receive, send)

    with pytest.raises(RuntimeError, match="runs on asyncio only"):
        trio.run(serve_lifespan)
    assert [m["type"] for m in sent] == ["lifespan.startup.failed"]
    assert "runs on asyncio only" in sent[0]["message"]


# -- 19: what the middleware adds to an app ----------------------------------------------


async def test_an_apps_own_generation_header_is_kept_alone() -> None:
    async def own(request: Request) -> Response:
        return Response(b"x", headers={"x-generation-id": "mine"})

    mw = DisconnectMiddleware(Starlette(routes=[Route("/own", own)]), backend=MemoryBackend())
    result = await drive(mw, path="/own")
    values = [v for k, v in result.headers if k == b"x-generation-id"]
    assert values == [b"mine"]


async def test_excluded_paths_are_left_alone() -> None:
    probe = Probe()
    mw = DisconnectMiddleware(
        sse_app(probe, chunks=3, delay=0), backend=MemoryBackend(), exclude_paths=[r"/json$"]
    )
    excluded = await drive(mw, path="/json")
    included = await drive(mw, path="/cancel")
    assert excluded.status == 200
    assert excluded.header("x-generation-id") is None
    assert included.header("x-generation-id") is not None


async def test_metering_alone_owns_its_lifespan() -> None:
    records: list[UsageRecord] = []
    app = MeteringMiddleware(sse_app(Probe(), chunks=2, delay=0), sinks=[records.append])
    async with lifespan(app):
        result = await drive(app, path="/cancel")
    assert result.status == 200
    assert len(records) == 1


def test_a_usage_record_is_built_by_keyword_and_refuses_positions() -> None:
    """``UsageRecord`` is keyword-only: a sink's test that still builds one by position gets
    a TypeError that says so, not a record with its fields shifted."""
    fields = {
        "generation_id": "gen_1",
        "principal": "p",
        "method": "POST",
        "route": "/v1/chat/completions",
        "status_code": 200,
        "provider": "openai_chat",
        "model": "gpt-4o",
        "outcome": "complete",
        "input_tokens": 12,
        "output_tokens": 30,
        "usage_source": "provider",
        "produced_bytes": 900,
        "delivered_bytes": 900,
        "produced_output_tokens": 30,
        "delivered_output_tokens": 30,
        "time_to_first_event": 0.2,
        "duration": 1.5,
        "finish_reason": "stop",
        "error_type": None,
        "started_at": 1_700_000_000.0,
    }
    record = UsageRecord(**fields)
    assert record.delivery == "sent"
    assert record.usage_note is None
    with pytest.raises(TypeError, match="positional"):
        UsageRecord(*fields.values())  # type: ignore[misc]
