"""RequestState's hooks: an observer outside the stack gets each request's usage record
once (``on_usage``), whether metering runs the request or not, and whenever it asks; and
how the exchange went as one frozen ``Outcome``, so far (``progress``) and once at its end
(``on_end``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from asgi_disconnect import (
    DisconnectMiddleware,
    Ending,
    MemoryBackend,
    MeteringMiddleware,
    Outcome,
    Policy,
    RequestState,
    UsageRecord,
    install,
)
from asgi_disconnect.testing import drive, lifespan
from tests.apps import Probe, as_tester, sse_app

pytestmark = pytest.mark.anyio


class Observer:
    """Outermost, as TelemetryMiddleware is: asks for the record before or after the app."""

    def __init__(self, app: ASGIApp, *, ask: str = "after") -> None:
        self.app = app
        self.ask = ask
        self.records: list[UsageRecord | None] = []
        self.settled = asyncio.Event()

    def got(self, record: UsageRecord | None) -> None:
        self.records.append(record)
        self.settled.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = RequestState("gen_observed", "tester")
        scope["asgi_disconnect"] = state
        if self.ask == "before":
            state.on_usage(self.got)
        await self.app(scope, receive, send)
        if self.ask == "after":
            state.on_usage(self.got)


@pytest.mark.parametrize("ask", ["before", "after"])
async def test_the_record_metering_settles_reaches_the_observer_once(ask: str) -> None:
    app = sse_app(Probe(), chunks=3, delay=0)
    install(app, backend=MemoryBackend(), principal=as_tester)
    observer = Observer(app, ask=ask)
    result = await drive(observer, path="/cancel")
    assert result.complete
    await asyncio.wait_for(observer.settled.wait(), 5)
    await asyncio.sleep(0.05)  # nothing more may arrive
    (record,) = observer.records
    assert record is not None
    assert record.generation_id == "gen_observed"
    assert record.outcome == "truncated"  # sse_app's stream has no terminal marker
    assert record.delivered_bytes == len(result.body)


async def test_without_metering_the_observer_hears_none_when_the_exchange_ends() -> None:
    mw = DisconnectMiddleware(sse_app(Probe(), chunks=3, delay=0), backend=MemoryBackend())
    observer = Observer(mw, ask="before")
    result = await drive(observer, path="/cancel")
    assert result.complete
    await asyncio.wait_for(observer.settled.wait(), 5)
    assert observer.records == [None]


async def test_detached_work_settles_its_record_when_it_ends_under_a_disconnect() -> None:
    probe = Probe()
    app = sse_app(probe, chunks=20, delay=0.01)
    install(app, backend=MemoryBackend(), principal=as_tester)
    observer = Observer(app)
    async with lifespan(app):
        result = await drive(observer, path="/detach", disconnect_after_bytes=30)
        assert result.disconnected
        assert observer.records == []  # the work goes on: its record is not known yet
        await asyncio.wait_for(observer.settled.wait(), 5)
    assert probe.finished.is_set()
    (record,) = observer.records
    assert record is not None
    assert record.policy == "detach"
    assert record.detached is True


async def test_a_hook_that_raises_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = sse_app(Probe(), chunks=2, delay=0)
    install(app, backend=MemoryBackend(), principal=as_tester)
    heard: list[Any] = []

    def broken(record: UsageRecord | None) -> None:
        raise RuntimeError("observer bug")

    async def outer(scope: Scope, receive: Receive, send: Send) -> None:
        state = RequestState("gen_hooks", "tester")
        scope["asgi_disconnect"] = state
        state.on_usage(broken)
        state.on_usage(heard.append)
        await app(scope, receive, send)

    with caplog.at_level(logging.ERROR, logger="asgi_disconnect"):
        result = await drive(outer, path="/cancel")
        for _ in range(100):
            if heard:
                break
            await asyncio.sleep(0.01)
    assert result.status == 200
    assert len(heard) == 1
    assert heard[0] is not None
    assert heard[0].generation_id == "gen_hooks"
    assert "a usage hook failed" in caplog.text


class Between:
    """A middleware between DisconnectMiddleware and metering that changes the messages."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def marked(message: Any) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                message = {**message, "body": message["body"].upper()}
            await send(message)

        await self.app(scope, receive, marked)


@pytest.mark.parametrize("between", [False, True], ids=["direct", "wrapped"])
async def test_metering_hooks_in_only_where_nothing_changes_the_messages(between: bool) -> None:
    records: list[UsageRecord] = []
    hooked: list[bool] = []
    metering = MeteringMiddleware(sse_app(Probe(), chunks=3, delay=0), sinks=[records.append])

    async def watch(scope: Scope, receive: Receive, send: Send) -> None:
        await metering(scope, receive, send)
        hooked.append(scope["asgi_disconnect"].message_hook is not None)

    inner: ASGIApp = Between(watch) if between else watch
    mw = DisconnectMiddleware(inner, backend=MemoryBackend(), principal=as_tester)
    result = await drive(mw, path="/cancel")
    assert result.complete
    for _ in range(100):
        if records:
            break
        await asyncio.sleep(0.01)
    (record,) = records
    # Wrapped, metering sees what the app sent; DisconnectMiddleware logs what reached it.
    assert record.produced_bytes == len(result.body)
    assert (result.body.upper() == result.body) is between
    assert hooked == [not between]  # a hook where nothing sits between, else a wrapped send


def test_a_send_that_is_not_the_apps_gets_no_hook() -> None:
    state = RequestState("gen_x", "tester")

    async def app_send(message: Any) -> None:
        pass

    async def other(message: Any) -> None:
        pass

    state.app_send = app_send
    assert state.on_message(other, print) is False
    assert state.message_hook is None
    assert state.on_message(app_send, print) is True
    assert state.message_hook is print
    state.off_message(print)
    assert state.message_hook is None


class EndObserver:
    """Outermost: reads how the exchange goes so far when the app returns, and its outcome
    through on_end, as the other middlewares do."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.outcomes: list[Outcome] = []
        self.at_return: Outcome | None = None
        self.ended = asyncio.Event()
        self.state: RequestState | None = None

    def end(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        self.ended.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state = RequestState("gen_ended", "tester")
        scope["asgi_disconnect"] = state
        state.on_end(self.end)
        await self.app(scope, receive, send)
        self.at_return = state.progress()


async def test_the_outcome_is_published_once_frozen_when_a_cancel_ends_under_a_disconnect() -> None:
    probe = Probe()
    app = sse_app(probe, chunks=50, delay=0.01)
    install(app, backend=MemoryBackend(), principal=as_tester)
    observer = EndObserver(app)
    async with lifespan(app):
        result = await drive(observer, path="/cancel", disconnect_after_bytes=30)
        await asyncio.wait_for(observer.ended.wait(), 5)
    assert result.disconnected
    (outcome,) = observer.outcomes
    assert outcome.ending is Ending.CANCELLED
    assert outcome.policy is Policy.CANCEL
    assert outcome.disconnect_reason == "client"
    assert outcome.detached is False
    assert 30 <= outcome.delivered_bytes <= outcome.produced_bytes < 50 * 30
    assert outcome.status == 200
    state = observer.state
    assert state is not None
    assert state.outcome is outcome  # published once: read after, it is the same object
    assert state.progress() is outcome
    with pytest.raises(AttributeError):
        outcome.delivered_bytes = 0  # type: ignore[misc]
    late: list[Outcome] = []
    state.on_end(late.append)  # asked after the end: called at once, with the same
    assert late == [outcome]
    assert late[0] is outcome


async def test_progress_says_detached_work_goes_on_until_its_outcome_says_how_it_ended() -> None:
    probe = Probe()
    app = sse_app(probe, chunks=20, delay=0.01)
    install(app, backend=MemoryBackend(), principal=as_tester)
    observer = EndObserver(app)
    async with lifespan(app):
        result = await drive(observer, path="/detach", disconnect_after_bytes=30)
        assert result.disconnected
        at_return = observer.at_return
        assert at_return is not None
        # The response is over, the work is not: no ending yet, and detached.
        assert at_return.ending is None
        assert at_return.detached is True
        assert at_return.policy is Policy.DETACH
        assert observer.outcomes == []
        await asyncio.wait_for(observer.ended.wait(), 5)
    assert probe.finished.is_set()
    (outcome,) = observer.outcomes
    assert outcome.ending is Ending.CUT  # its client was gone before the end
    assert outcome.detached is True
    assert outcome.produced_bytes > at_return.produced_bytes
    assert outcome.delivered_bytes < outcome.produced_bytes


async def test_an_on_end_hook_that_raises_is_logged_and_the_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = RequestState("gen_x", "tester")
    seen: list[Outcome] = []

    def broken(outcome: Outcome) -> None:
        raise RuntimeError("boom")

    state.on_end(broken)
    state.on_end(seen.append)
    with caplog.at_level(logging.ERROR, logger="asgi_disconnect"):
        state.finish(Ending.DELIVERED)
        state.finish(Ending.FAILED)  # later calls do nothing
    assert [o.ending for o in seen] == [Ending.DELIVERED]
    assert "a callback at the end of a request failed" in caplog.text
    assert seen[0].policy is None
    assert seen[0].disconnect_reason is None


def test_the_identity_is_given_once() -> None:
    state = RequestState("gen_1", "alice")
    assert (state.generation_id, state.principal) == ("gen_1", "alice")
    with pytest.raises(AttributeError):
        state.generation_id = "gen_2"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        state.principal = "mallory"  # type: ignore[misc]
    assert (state.generation_id, state.principal) == ("gen_1", "alice")
