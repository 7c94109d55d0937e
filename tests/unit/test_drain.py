"""DrainMiddleware in-process: refusals while draining, readiness, the drain endpoint and
its bad input, what the deadline does to streams and to detached work, and the deadline it
suggests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import anyio
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import (
    DisconnectMiddleware,
    DrainMiddleware,
    MemoryBackend,
    UsageRecord,
    disconnect_policy,
    install,
)
from asgi_disconnect.testing import drive
from asgi_disconnect.testing._driver import lifespan
from tests.apps import as_tester, eventually

pytestmark = pytest.mark.anyio

EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
DRAINING = "urn:asgi-disconnect:problem:draining"
Part = TypeVar("Part")


def app_with(
    records: list[UsageRecord] | None = None,
    backend: MemoryBackend | None = None,
    idempotency: bool = False,
    **drain: Any,
) -> tuple[Starlette, DrainMiddleware]:
    async def body(events: int) -> AsyncIterator[bytes]:
        for _ in range(events):
            yield EVENT
            await asyncio.sleep(0.01)
        yield DONE

    async def chat(request: Request) -> StreamingResponse:
        events = int(request.query_params.get("events", "20"))
        return StreamingResponse(body(events), media_type="text/event-stream")

    @disconnect_policy("detach")
    async def report(request: Request) -> StreamingResponse:
        events = int(request.query_params.get("events", "20"))
        return StreamingResponse(body(events), media_type="text/event-stream")

    async def hello(request: Request) -> JSONResponse:
        return JSONResponse({"hello": True})

    async def slow(request: Request) -> JSONResponse:
        await asyncio.sleep(5)  # thinking before its first byte
        return JSONResponse({"late": True})

    app = Starlette(
        routes=[
            Route("/chat", chat),
            Route("/report", report),
            Route("/hello", hello),
            Route("/slow", slow),
        ]
    )
    install(
        app,
        backend=MemoryBackend() if backend is None else backend,
        sinks=[records.append] if records is not None else [],
        drain={"signals": False, **drain},
        idempotency=idempotency,
        principal=as_tester,
    )
    return app, _drain_of(app)


def _drain_of(app: Starlette) -> DrainMiddleware:
    app.middleware_stack = app.build_middleware_stack()
    return _part(app, DrainMiddleware)


def _part(app: Starlette, kind: type[Part]) -> Part:
    layer: Any = app.middleware_stack
    while not isinstance(layer, kind):
        layer = layer.app
    return layer


def problem(result: Any) -> dict[str, Any]:
    assert result.header("content-type") == "application/problem+json"
    return msgspec.json.decode(result.body)  # type: ignore[no-any-return]


def frames(body: bytes) -> list[dict[str, Any]]:
    return [
        msgspec.json.decode(block.split(b"data: ", 1)[1])["error"]
        for block in body.split(b"\n\n")
        if block.startswith(b"event: error\n")
    ]


async def test_while_draining_new_requests_get_503_and_work_in_flight_finishes() -> None:
    records: list[UsageRecord] = []
    app, drain = app_with(records, deadline=10, drain_token="op")
    operator = [("authorization", "Bearer op")]
    async with lifespan(app):
        ready = await drive(app, path="/readyz")
        assert ready.status == 200
        # Readiness for anyone; what runs, for the operator only.
        assert msgspec.json.decode(ready.body) == {"status": "ready"}
        ready = await drive(app, path="/readyz", headers=operator)
        assert msgspec.json.decode(ready.body) == {"status": "ready", "in_flight": 0}
        stream = asyncio.create_task(drive(app, path="/chat", query_string=b"events=30"))
        await eventually(lambda: drain.in_flight == 1)
        drained = asyncio.create_task(drain.drain())
        await eventually(lambda: drain.draining)

        refused = await drive(app, path="/hello")
        assert refused.status == 503
        assert refused.header("retry-after") == "5"
        assert problem(refused)["type"] == DRAINING
        not_ready = await drive(app, path="/readyz")
        assert not_ready.status == 503
        assert problem(not_ready)["type"] == DRAINING
        assert problem(not_ready)["detail"] == "Draining."
        told = await drive(app, path="/readyz", headers=operator)
        assert "1 request(s) in flight" in problem(told)["detail"]

        result = await stream
        await drained
        assert drain.drained
        assert result.body.endswith(DONE)  # finished before the deadline: whole
        assert frames(result.body) == []
        # Resume reads go on while draining.
        generation_id = result.header("x-generation-id")
        resumed = await drive(app, path=f"/generations/{generation_id}/stream")
        assert resumed.status == 200
        assert resumed.body == result.body
    (record,) = records
    assert record.outcome == "complete"


async def test_at_the_deadline_streams_get_an_interrupted_frame_and_detached_work_ends() -> None:
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    app, drain = app_with(records, backend, deadline=0.3, retry_after=7)
    async with lifespan(app):
        cut = await drive(
            app, path="/report", query_string=b"events=500", disconnect_after_bytes=3 * len(EVENT)
        )
        detached_id = cut.header("x-generation-id")
        stream = asyncio.create_task(drive(app, path="/chat", query_string=b"events=500"))
        await eventually(lambda: drain.in_flight == 1)
        await drain.drain()
        result = await stream
        assert result.complete  # ended properly, not cut
        assert not result.body.endswith(DONE)
        (frame,) = frames(result.body)
        assert frame["type"] == "interrupted"
        assert frame["stopped_by"] == "drain"
        assert frame["retry_after"] == 7
        assert frame["generation_id"] == result.header("x-generation-id")
        info = await backend.get(result.header("x-generation-id") or "")
        assert info is not None
        assert info.status == "interrupted"

        detached = await backend.get(detached_id or "")
        assert detached is not None
        assert detached.status == "interrupted"
        assert detached.size > 3 * len(EVENT)  # the prefix it produced is kept
        prefix = await drive(app, path=f"/generations/{detached_id}/stream")
        assert prefix.body.startswith(EVENT * 3)
        assert frames(prefix.body)[-1]["type"] == "interrupted"
    outcomes = sorted(record.outcome for record in records)
    assert outcomes == ["interrupted", "interrupted"]


async def test_interrupt_ends_the_running_generations_now_and_the_drain_with_them() -> None:
    backend = MemoryBackend()
    app, drain = app_with(backend=backend, deadline=600)
    disconnect = _part(app, DisconnectMiddleware)
    async with lifespan(app):
        assert disconnect.running == 0
        assert disconnect.interrupt() == 0
        cut = await drive(
            app,
            path="/report",
            query_string=b"events=100000",
            disconnect_after_bytes=3 * len(EVENT),
        )
        detached_id = cut.header("x-generation-id") or ""
        stream = asyncio.create_task(drive(app, path="/chat", query_string=b"events=100000"))
        await eventually(lambda: disconnect.running == 2)
        drained = asyncio.create_task(drain.drain())
        await eventually(lambda: drain.draining)
        assert disconnect.interrupt(retry_after=3) == 2
        with anyio.fail_after(30):  # the drain's own deadline is 600 s
            await drained
            result = await stream
        assert disconnect.running == 0
        (frame,) = frames(result.body)
        assert frame["type"] == "interrupted"
        assert frame["retry_after"] == 3
        detached = await backend.get(detached_id)
        assert detached is not None
        assert detached.status == "interrupted"
        assert detached.size > 3 * len(EVENT)  # the prefix it produced is kept


async def test_a_request_without_a_response_at_the_deadline_gets_503_to_retry() -> None:
    app, drain = app_with(deadline=0.2, retry_after=4)
    async with lifespan(app):
        slow = asyncio.create_task(drive(app, path="/slow"))
        await eventually(lambda: drain.in_flight == 1)
        await drain.drain()
        result = await slow
    assert result.status == 503
    assert result.header("retry-after") == "4"
    assert problem(result)["type"] == DRAINING


async def test_the_drain_endpoint_and_its_bad_input() -> None:
    app, drain = app_with(drain_token="s3cret")
    async with lifespan(app):
        wrong_method = await drive(app, path="/drainz")
        assert wrong_method.status == 405
        assert problem(wrong_method)["type"].endswith(":method-not-allowed")
        assert wrong_method.header("allow") == "POST"
        for bad in ("0", "-1", "abc", "nan", "1e9"):
            bad_deadline = await drive(
                app,
                method="POST",
                path="/drainz",
                query_string=f"deadline={bad}".encode(),
                headers=[("authorization", "Bearer s3cret")],
            )
            assert bad_deadline.status == 400, bad
            assert problem(bad_deadline)["type"].endswith(":invalid-drain-deadline")
        wrong_token = await drive(
            app, method="POST", path="/drainz", headers=[("authorization", "Bearer nope")]
        )
        assert wrong_token.status == 403
        assert problem(wrong_token)["type"].endswith(":drain-forbidden")
        assert not drain.draining  # nothing refused started a drain
        started = await drive(
            app,
            method="POST",
            path="/drainz",
            query_string=b"deadline=2&wait=true",
            headers=[("authorization", "Bearer s3cret")],
        )
        assert started.status == 200
        assert msgspec.json.decode(started.body) == {
            "status": "drained",
            "deadline": 2.0,
            "remaining": 0.0,
            "in_flight": 0,
        }
        assert (await drive(app, path="/hello")).status == 503


async def test_a_second_drain_answers_the_deadline_that_applies() -> None:
    app, drain = app_with(drain_token="op")
    operator = [("authorization", "Bearer op")]
    async with lifespan(app):
        stream = asyncio.create_task(drive(app, path="/chat", query_string=b"events=400"))
        await eventually(lambda: drain.in_flight == 1)
        first = await drive(
            app, method="POST", path="/drainz", query_string=b"deadline=2", headers=operator
        )
        assert first.status == 202
        second = await drive(
            app, method="POST", path="/drainz", query_string=b"deadline=60", headers=operator
        )
        answer = msgspec.json.decode(second.body)
        assert answer["deadline"] == 2.0  # the first drain's, which cuts the streams
        assert 0 < answer["remaining"] <= 2.0
        result = await stream
    assert frames(result.body)[-1]["type"] == "interrupted"


def _from(app: Any, address: str) -> Any:
    async def call(scope: Any, receive: Any, send: Any) -> None:
        scope["client"] = (address, 5000)
        await app(scope, receive, send)

    return call


async def test_without_a_token_no_one_drains_not_even_loopback() -> None:
    app, drain = app_with()
    async with lifespan(app):
        refused = await drive(app, method="POST", path="/drainz")  # the driver's loopback
        assert refused.status == 403
        assert problem(refused)["type"].endswith(":drain-forbidden")
        assert "no drain_token set" in problem(refused)["detail"]
        assert not drain.draining
        token_free = await drive(
            app, method="POST", path="/drainz", headers=[("authorization", "Bearer ")]
        )
        assert token_free.status == 403
        assert not drain.draining


async def test_the_token_drains_from_anywhere_and_a_wrong_one_from_nowhere() -> None:
    app, drain = app_with(drain_token="op")
    async with lifespan(app):
        wrong = await drive(
            _from(app, "127.0.0.1"),
            method="POST",
            path="/drainz",
            headers=[("authorization", "Bearer opx")],
        )
        assert wrong.status == 403
        allowed = await drive(
            _from(app, "10.0.0.7"),
            method="POST",
            path="/drainz",
            headers=[("authorization", "Bearer op")],
        )
        assert allowed.status == 202
        assert drain.draining


async def test_trusting_loopback_is_an_opt_in_that_a_forwarded_address_never_meets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, drain = app_with(trust_loopback=True)
    async with lifespan(app):
        assert any("trusts loopback" in r.message for r in caplog.records)
        elsewhere = await drive(_from(app, "10.0.0.7"), method="POST", path="/drainz")
        assert elsewhere.status == 403
        for header in ("x-forwarded-for", "forwarded", "x-real-ip"):
            forwarded = await drive(
                app, method="POST", path="/drainz", headers=[(header, "127.0.0.1")]
            )
            assert forwarded.status == 403, header
        assert not drain.draining
        allowed = await drive(app, method="POST", path="/drainz")
        assert allowed.status == 202
        assert drain.draining


@pytest.mark.parametrize("token", ["", "t\u00e9"])
def test_a_drain_token_that_cannot_be_sent_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="drain_token"):
        DrainMiddleware(Starlette(), drain_token=token)


async def test_the_suggested_deadline_follows_recent_requests() -> None:
    app, drain = app_with(deadline=30)
    assert drain.suggest_drain_deadline() == 30  # nothing observed yet
    async with lifespan(app):
        for _ in range(20):
            await drive(app, path="/hello")
        await drive(app, path="/chat", query_string=b"events=60")  # about 0.6 s
    # 21 requests: the 99th percentile is the slowest, 0.6 s and more, times 1.25, rounded up.
    assert drain.suggest_drain_deadline() == 1.0
    assert drain.suggest_drain_deadline(quantile=0.5) == 1.0
    with pytest.raises(ValueError, match="quantile"):
        drain.suggest_drain_deadline(quantile=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"deadline": 0}, "deadline"),
        ({"deadline": float("inf")}, "deadline"),
        ({"retry_after": -1}, "retry_after"),
        ({"retry_after": 1.5}, "retry_after"),
        ({"ready_path": "readyz"}, "ready_path"),
        ({"window": 0}, "window"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DrainMiddleware(Starlette(), **options)


async def test_a_drained_idempotent_stream_is_not_replayed_and_has_one_record() -> None:
    records: list[UsageRecord] = []
    app, drain = app_with(records, idempotency=True, deadline=0.2)
    keyed = [("authorization", "Bearer alice"), ("idempotency-key", "k-1")]
    async with lifespan(app):
        stream = asyncio.create_task(
            drive(app, path="/chat", query_string=b"events=500", headers=keyed)
        )
        await eventually(lambda: drain.in_flight == 1)
        await drain.drain()
        first = await stream
        assert [frame["type"] for frame in frames(first.body)] == ["interrupted"]
    await eventually(lambda: len(records) == 1)
    (record,) = records
    assert record.outcome == "interrupted"
    # The process restarts on the same store (a new stack, the same backend): the retry
    # runs again, for an interrupted answer was not stored as a complete one.
    app.middleware_stack = None
    async with lifespan(app):
        retry = await drive(app, path="/chat", query_string=b"events=3", headers=keyed)
    assert retry.header("idempotent-replayed") is None
    assert retry.body.endswith(DONE)
