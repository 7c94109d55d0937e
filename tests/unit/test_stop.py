"""Stop: ``POST /generations/{id}/cancel`` stops a running generation wherever it runs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import (
    DisconnectMiddleware,
    MemoryBackend,
    UsageRecord,
    connect,
    disconnect_policy,
    install,
)
from asgi_disconnect.testing import drive
from asgi_disconnect.testing._driver import lifespan
from tests.apps import eventually, http_scope, request_then_disconnect

pytestmark = pytest.mark.anyio

ALICE = [("authorization", "Bearer alice")]
BOB = [("authorization", "Bearer bob")]
EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'


class Upstream:
    """Stands for the provider's connection: open while the app streams from it."""

    def __init__(self) -> None:
        self.opened = 0
        self.closed = 0
        self.sent = 0
        self.events = 400


def streaming_app(upstream: Upstream, events: int = 400, interval: float = 0.01) -> Starlette:
    upstream.events = events

    async def body() -> AsyncIterator[bytes]:
        upstream.opened += 1
        try:
            for _ in range(upstream.events):
                upstream.sent += 1
                yield EVENT
                await asyncio.sleep(interval)
            yield b"data: [DONE]\n\n"
        finally:
            upstream.closed += 1

    @disconnect_policy("detach")
    async def report(request: Request) -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    async def chat(request: Request) -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/report", report), Route("/chat", chat)])


def decoded(result: Any) -> dict[str, Any]:
    return msgspec.json.decode(result.body)  # type: ignore[no-any-return]


async def test_the_owner_stops_detached_work_and_it_is_recorded_cancelled() -> None:
    upstream = Upstream()
    records: list[UsageRecord] = []
    app = streaming_app(upstream)
    install(app, backend=MemoryBackend(), sinks=[records.append])
    async with lifespan(app):
        cut = await drive(app, path="/report", headers=ALICE, disconnect_after_bytes=200)
        generation_id = cut.header("x-generation-id")
        assert generation_id is not None
        await asyncio.sleep(0.1)
        assert upstream.closed == 0, "detached: it runs on without its client"
        # Another caller cannot stop it, nor tell that it exists.
        other = await drive(
            app, method="POST", path=f"/generations/{generation_id}/cancel", headers=BOB
        )
        assert other.status == 404
        assert decoded(other)["type"] == "urn:asgi-disconnect:problem:generation-not-found"
        sent = upstream.sent
        stop = await drive(
            app, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE
        )
        assert stop.status == 200
        assert stop.header("content-type") == "application/json"
        info = decoded(stop)
        assert info["status"] == "cancelled"
        assert info["policy"] == "detach"  # the route's: a Stop is no policy of its own
        assert upstream.closed == 1
        assert upstream.sent <= sent + 2, "the provider stops being read at once"
        await eventually(lambda: records)
        # Stopping again: it has ended, there is nothing to stop.
        again = await drive(
            app, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE
        )
        assert again.status == 409
        assert decoded(again)["type"] == "urn:asgi-disconnect:problem:generation-finished"
    (record,) = records
    assert record.outcome == "cancelled"
    assert record.generation_id == generation_id
    assert record.policy == "detach"
    assert record.stopped_by == "owner"


@pytest.mark.parametrize("inline", [False, True])
async def test_a_client_still_reading_gets_an_error_frame_when_the_owner_stops_it(
    inline: bool,
) -> None:
    upstream = Upstream()
    records: list[UsageRecord] = []
    app = streaming_app(upstream, events=400 if not inline else 3, interval=0.01)
    install(app, backend=MemoryBackend(), sinks=[records.append])
    async with lifespan(app):
        if inline:
            # A route that can only cancel runs in the request's own task once learned.
            await drive(app, path="/chat", headers=ALICE)
            await eventually(lambda: records)
            records.clear()
            upstream.sent = 0
            upstream.events = 400
        reading = asyncio.ensure_future(drive(app, path="/chat", headers=ALICE, timeout=10))
        await eventually(lambda: upstream.sent > 5)
        mw = next(m for m in _middlewares(app) if isinstance(m, DisconnectMiddleware))
        (running,) = await mw.backend.recent(status="running")
        generation_id = running.id
        stop = await drive(
            app, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE
        )
        assert stop.status == 200
        result = await reading
        await eventually(lambda: records)
    assert result.complete
    assert result.body.startswith(EVENT)
    assert b"event: error\n" in result.body
    assert b'"type":"cancelled"' in result.body
    assert b"[DONE]" not in result.body
    assert records[0].outcome == "cancelled"
    assert mw.counters.stopped == 1


async def test_a_stop_on_a_detaching_route_is_recorded_with_the_routes_policy() -> None:
    """Its client still reads: the Stop cancels the work, and the record, the stored
    generation and the error frame say the route detaches and its owner stopped it."""
    upstream = Upstream()
    records: list[UsageRecord] = []
    app = streaming_app(upstream, events=400, interval=0.01)
    install(app, backend=MemoryBackend(), sinks=[records.append])
    async with lifespan(app):
        reading = asyncio.ensure_future(drive(app, path="/report", headers=ALICE, timeout=10))
        await eventually(lambda: upstream.sent > 5)
        mw = next(m for m in _middlewares(app) if isinstance(m, DisconnectMiddleware))
        (running,) = await mw.backend.recent(status="running")
        stop = await drive(
            app, method="POST", path=f"/generations/{running.id}/cancel", headers=ALICE
        )
        result = await reading
        await eventually(lambda: records)
    assert decoded(stop)["status"] == "cancelled"
    assert decoded(stop)["policy"] == "detach"
    (record,) = records
    assert (record.outcome, record.policy, record.stopped_by) == ("cancelled", "detach", "owner")
    assert record.detached is False  # its client stayed
    error = msgspec.json.decode(result.body.split(b"event: error\ndata: ")[1].split(b"\n")[0])
    assert error["error"]["type"] == "cancelled"
    assert error["error"]["stopped_by"] == "owner"


def _middlewares(app: Starlette) -> list[Any]:
    found = []
    layer: Any = app.middleware_stack or app.build_middleware_stack()
    while layer is not None:
        found.append(layer)
        layer = getattr(layer, "app", None)
    return found


@pytest.mark.parametrize(
    ("method", "path", "status", "problem"),
    [
        ("GET", "/cancel", 405, "method-not-allowed"),
        ("PUT", "/cancel", 405, "method-not-allowed"),
        ("POST", "", 405, "method-not-allowed"),
        ("POST", "/stream", 405, "method-not-allowed"),
        ("POST", "/cancel/", 404, None),
    ],
)
async def test_bad_stop_requests_get_a_problem(
    method: str, path: str, status: int, problem: str | None
) -> None:
    upstream = Upstream()
    app = streaming_app(upstream, events=5, interval=0)
    install(app, backend=MemoryBackend())
    async with lifespan(app):
        done = await drive(app, path="/chat", headers=ALICE)
        generation_id = done.header("x-generation-id")
        result = await drive(
            app, method=method, path=f"/generations/{generation_id}{path}", headers=ALICE
        )
    assert result.status == status
    if problem is not None:
        assert result.header("content-type") == "application/problem+json"
        assert decoded(result)["type"] == f"urn:asgi-disconnect:problem:{problem}"
        allow = result.header("allow")
        assert allow == ("POST" if path == "/cancel" else "GET, HEAD")


async def test_an_unknown_generation_cannot_be_stopped() -> None:
    app = streaming_app(Upstream())
    install(app, backend=MemoryBackend())
    result = await drive(app, method="POST", path="/generations/gen_" + "Z" * 24 + "/cancel")
    assert result.status == 404


@pytest.fixture(params=["sqlite", "postgres"])
def replicated_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


async def test_a_stop_on_one_replica_stops_the_work_running_on_another(
    replicated_url: str,
) -> None:
    url = replicated_url
    upstream = Upstream()
    records: list[UsageRecord] = []
    a = streaming_app(upstream, events=1000)
    install(a, backend=connect(url, flush_interval=0.02), sinks=[records.append])
    b = streaming_app(Upstream())
    install(b, backend=connect(url, flush_interval=0.02))
    async with lifespan(a), lifespan(b):
        cut = await drive(a, path="/report", headers=ALICE, disconnect_after_bytes=200)
        generation_id = cut.header("x-generation-id")
        await asyncio.sleep(0.2)  # flushed: B knows it
        asked = time.monotonic()
        stop = await drive(
            b, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE
        )
        assert stop.status in (200, 202)
        await eventually(lambda: upstream.closed == 1, timeout=1.5)
        stopped_after = time.monotonic() - asked
        await eventually(lambda: records)

        async def stored_status() -> str:
            result = await drive(b, path=f"/generations/{generation_id}", headers=ALICE)
            return str(decoded(result)["status"])

        async with asyncio.timeout(5):
            while await stored_status() != "cancelled":
                await asyncio.sleep(0.05)
    assert stopped_after < 1.0
    assert records[0].outcome == "cancelled"
    assert upstream.sent < 1000


class Unreachable(MemoryBackend):
    async def principal_of(self, generation_id: str) -> str | None:
        raise ConnectionError("connection refused")


@pytest.mark.parametrize(
    ("method", "action"), [("GET", ""), ("GET", "/stream"), ("POST", "/cancel")]
)
async def test_a_store_that_fails_is_a_clear_503(method: str, action: str) -> None:
    app = streaming_app(Upstream())
    install(app, backend=Unreachable())
    result = await drive(
        app, method=method, path="/generations/gen_" + "Q" * 24 + action, headers=ALICE
    )
    assert result.status == 503
    assert result.header("retry-after") == "1"
    assert decoded(result)["type"] == "urn:asgi-disconnect:problem:generation-store-unavailable"


async def test_a_stop_across_replicas_stops_the_provider_billing() -> None:
    """Replica A relays a detached generation from FakeProvider over real TCP; its client
    left. A Stop sent to replica B closes A's upstream: the provider stops generating, so
    what it billed stays near what the generation holds."""
    import contextlib
    import tempfile

    import httpx

    from asgi_disconnect.testing import FakeProvider
    from asgi_disconnect.upstream import open_stream

    url = f"sqlite:///{tempfile.mkdtemp()}/g.db"
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with FakeProvider(tokens=400, tokens_per_second=100) as provider:
        client = httpx.AsyncClient(base_url=provider.url, timeout=httpx.Timeout(None))

        @disconnect_policy("detach")
        async def relay(request: Request) -> StreamingResponse:
            outgoing = client.build_request("POST", "/v1/chat/completions", json=body)
            return StreamingResponse(
                await open_stream(client, outgoing), media_type="text/event-stream"
            )

        a = Starlette(routes=[Route("/relay", relay)])
        install(a, backend=connect(url, flush_interval=0.02))
        b = streaming_app(Upstream())
        install(b, backend=connect(url, flush_interval=0.02))
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(lifespan(a))
            await stack.enter_async_context(lifespan(b))
            cut = await drive(a, path="/relay", headers=ALICE, disconnect_after_bytes=300)
            generation_id = cut.header("x-generation-id")
            await asyncio.sleep(0.5)
            stop = await drive(
                b, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE
            )
            assert stop.status in (200, 202)
            (upstream,) = await provider.await_requests(1)
            assert await upstream.await_closed(timeout=2)
            await asyncio.sleep(0.2)
            stored = await drive(b, path=f"/generations/{generation_id}/stream", headers=ALICE)
        await client.aclose()
    held = stored.body.count(b'"content":"') - stored.body.count(b'"content":""')
    assert 0 < upstream.tokens_sent < 400
    assert held > 0
    assert upstream.tokens_sent / held < 1.15, (upstream.tokens_sent, held)


async def test_stopped_idempotent_work_is_not_stored_as_an_answer() -> None:
    """With every middleware on: detached work under an Idempotency-Key, its client gone,
    stopped by its owner. Exactly one record, cancelled; nothing stored for the key, so a
    retry runs the work again rather than replay a stopped answer."""
    upstream = Upstream()
    records: list[UsageRecord] = []
    app = streaming_app(upstream)
    install(app, backend=MemoryBackend(), sinks=[records.append], idempotency=True)
    keyed = [*ALICE, ("idempotency-key", "stop-1")]
    async with lifespan(app):
        cut = await drive(app, path="/report", headers=keyed, disconnect_after_bytes=200)
        generation_id = cut.header("x-generation-id")
        stop = await drive(
            app, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE
        )
        assert stop.status == 200
        await eventually(lambda: records)
        upstream.events = 3
        for _ in range(100):  # the release of the claim lands a moment after the end
            retry = await drive(app, path="/report", headers=keyed)
            if retry.status != 409:
                break
            await asyncio.sleep(0.01)
        await eventually(lambda: len(records) == 2)
    assert [record.outcome for record in records] == ["cancelled", "complete"]
    assert retry.header("idempotent-replayed") is None
    assert upstream.opened == 2
    assert retry.body.endswith(b"data: [DONE]\n\n")


async def test_a_client_that_leaves_while_its_stop_cancels_the_work_changes_nothing() -> None:
    """A Stop moves the exchange to ``cancelling``; the client's disconnect that follows,
    on a route that detaches, does not detach the work it is cancelling: the policy applies
    once, while the exchange runs."""
    records: list[UsageRecord] = []
    streaming = asyncio.Event()
    cleaning = asyncio.Event()

    class Slow(Response):
        """Streams until cancelled; then closes its provider's connection, slowly."""

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            headers = [(b"content-type", b"text/event-stream")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            try:
                while True:
                    await send({"type": "http.response.body", "body": EVENT, "more_body": True})
                    streaming.set()
                    await asyncio.sleep(0.01)
            finally:
                cleaning.set()
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.3)

    @disconnect_policy("detach")
    async def report(request: Request) -> Response:
        return Slow()

    app = Starlette(routes=[Route("/report", report)])
    install(app, backend=MemoryBackend(), sinks=[records.append])
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = http_scope("/report", headers=[(b"authorization", b"Bearer alice")])
    async with lifespan(app):
        mw = next(m for m in _middlewares(app) if isinstance(m, DisconnectMiddleware))
        request = asyncio.ensure_future(app(scope, request_then_disconnect(gone), send))
        await asyncio.wait_for(streaming.wait(), 5)
        (generation_id,) = {
            value.decode()
            for message in sent
            for name, value in message.get("headers", ())
            if name == b"x-generation-id"
        }
        # The Stop answers once the work ended: the client leaves meanwhile.
        stopping = asyncio.ensure_future(
            drive(app, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE)
        )
        await asyncio.wait_for(cleaning.wait(), 5)
        gone.set()  # the client leaves while the app's finally block still runs
        await asyncio.wait_for(request, 5)
        stop = await stopping
        assert stop.status == 200
        assert decoded(stop)["policy"] == "detach"
        await eventually(lambda: records)
    (record,) = records
    assert record.outcome == "cancelled"
    assert (record.policy, record.stopped_by) == ("detach", "owner")
    assert mw.counters.stopped == 1
    assert mw.counters.detached == 0
    assert mw.counters.disconnects == 1


async def test_a_stop_waits_for_the_generations_end_without_asking_the_store_again_and_again() -> (
    None
):
    """The work takes a moment to stop (its cleanup closes an upstream): the Stop answers
    200 once it ended, woken by the end itself; the store is asked how it stands once before
    and once after, not every few milliseconds meanwhile."""
    closed = asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                yield EVENT
                await asyncio.sleep(0.01)
        finally:
            with anyio.CancelScope(shield=True):
                await asyncio.sleep(0.3)  # closing the upstream takes a while
            closed.set()

    @disconnect_policy("detach")
    async def report(request: Request) -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/report", report)])
    backend = MemoryBackend()
    install(app, backend=backend)
    asked: list[str] = []
    get = backend.get

    async def counted_get(generation_id: str) -> Any:
        asked.append(generation_id)
        return await get(generation_id)

    backend.get = counted_get  # type: ignore[method-assign]
    async with lifespan(app):
        cut = await drive(app, path="/report", headers=ALICE, disconnect_after_bytes=200)
        generation_id = cut.header("x-generation-id")
        assert generation_id is not None
        asked.clear()
        stop = await drive(
            app, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE
        )
        assert closed.is_set(), "answered once the work ended"
    assert stop.status == 200
    assert decoded(stop)["status"] == "cancelled"
    assert len(asked) == 2, asked  # the lookup before the Stop, the answer after it
