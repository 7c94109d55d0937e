"""The takeover of a generation whose owner is gone, in one process: a DurableBackend plays
the dead owner (its worker stopped, as a killed process's would), a DisconnectMiddleware with
the upstream registered takes the generation over from the store and continues it against a
real FakeProvider; bad continuations end it ``interrupted`` with the provider's reason."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
from starlette.applications import Starlette

from asgi_disconnect import DisconnectMiddleware, UsageRecord, connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._continuation import encode, recorded
from asgi_disconnect._log import Generation, Status
from asgi_disconnect._records import Adopted
from asgi_disconnect.testing import FakeProvider
from asgi_disconnect.testing._driver import lifespan
from tests.unit.test_backends import usage_record

pytestmark = pytest.mark.anyio

GID = "gen_" + "K" * 24
TOKENS = 30


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    async with FakeProvider(tokens=TOKENS, tokens_per_second=0, background_ttl=0.0) as fake:
        yield fake


async def dead_owner(
    url: str,
    kind: str,
    path: str,
    stored: bytes,
    body: dict[str, object],
    *,
    trace: str | None = None,
) -> None:
    """A generation left by an owner that died with ``stored`` written."""
    owner = connect(url, flush_interval=0.02, lease=0.3)
    assert isinstance(owner, DurableBackend)
    await owner.open()
    try:
        generation = Generation(GID, principal="alice", content_type="text/event-stream")
        generation.policy = "detach"
        generation.detached = True
        continuation = recorded(
            kind,
            upstream="fake",
            method="POST",
            url=path,
            body=json.dumps(body).encode(),
            headers=[("content-type", "application/json")],
            trace=trace,
        )
        generation.continuation = ("fake", encode(continuation))
        owner.register(generation)
        generation.append(stored)
        while await owner.flush():
            pass
        await owner.flush()
        worker = owner._worker
        assert worker is not None
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    finally:
        owner._opened = False  # dead: nothing more is written, nothing flushed at close
        await owner.store.aclose()


def taker(url: str, client: httpx.AsyncClient, records: list[UsageRecord]) -> DisconnectMiddleware:
    backend = connect(url, flush_interval=0.02, lease=0.3, takeover_interval=0.05)
    return DisconnectMiddleware(
        Starlette(),
        backend=backend,
        upstreams={"fake": client},
        takeover_sinks=[records.append],
    )


async def ended(app: DisconnectMiddleware) -> Status:
    async with asyncio.timeout(10):
        while True:
            info = await app.backend.get(GID)
            if info is not None and info.status is not Status.RUNNING and info.attempt == 2:
                return info.status
            await asyncio.sleep(0.05)


async def test_an_expired_background_response_ends_interrupted_with_the_providers_reason(
    sqlite_url: str, provider: FakeProvider
) -> None:
    stored = (
        b"event: response.created\n"
        b'data: {"type":"response.created","sequence_number":0,'
        b'"response":{"id":"resp_gone","status":"in_progress"}}\n\n'
    )
    await dead_owner(
        sqlite_url,
        "responses",
        provider.url + "/v1/responses",
        stored,
        {"model": "fake-model", "input": "hi", "stream": True},
    )
    records: list[UsageRecord] = []
    async with httpx.AsyncClient() as client:
        app = taker(sqlite_url, client, records)
        async with lifespan(app):
            status = await ended(app)
            info = await app.backend.get(GID)
    assert status is Status.INTERRUPTED
    assert info is not None
    assert info.error is not None
    assert "404" in info.error
    assert "resp_gone" in info.error  # the provider's own words
    attempts = [record for record in records if record.attempt == 2]
    assert len(attempts) == 1
    assert attempts[0].error_type == "continuation_refused"
    assert app.counters.takeovers == 1


async def test_a_taken_over_generation_can_be_stopped_and_is_recorded_cancelled(
    sqlite_url: str,
) -> None:
    async with FakeProvider(tokens=400, tokens_per_second=50) as slow:
        body = {
            "model": "fake-model",
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        }
        stored = (
            b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"role":"assistant",'
            b'"content":"tok0 "},"finish_reason":null}]}\n\n'
        )
        await dead_owner(
            sqlite_url, "continue_final_message", slow.url + "/v1/chat/completions", stored, body
        )
        records: list[UsageRecord] = []
        async with httpx.AsyncClient() as client:
            app = taker(sqlite_url, client, records)
            async with lifespan(app):
                async with asyncio.timeout(10):
                    while GID not in app._takeovers:
                        await asyncio.sleep(0.02)
                (call,) = await slow.await_requests(1)
                assert await app.backend.request_cancel(GID)
                status = await ended(app)
                assert await call.await_closed(5)
                log = b"".join([chunk async for chunk in app.backend.follow(GID, 0)])
    assert status is Status.CANCELLED
    assert call.connection_closed_early  # the provider stopped generating, and billing
    (record,) = [record for record in records if record.attempt == 2]
    assert record.outcome == "cancelled"
    assert (record.policy, record.stopped_by) == ("detach", "owner")
    # Its frame says it in the same words: how it ended, and what stopped it.
    error = json.loads(log.rsplit(b"event: error\ndata: ", 1)[1].split(b"\n", 1)[0])["error"]
    assert (error["type"], error["stopped_by"]) == ("cancelled", "owner")


async def test_a_replica_that_drained_takes_nothing_over_while_it_shuts_down(
    sqlite_url: str, provider: FakeProvider
) -> None:
    """Past its drain's deadline a replica's lifespan still runs (the server's shutdown has yet
    to begin): its scan must not take back the work it just handed over, nor anyone's."""
    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    records: list[UsageRecord] = []
    async with httpx.AsyncClient() as client:
        app = taker(sqlite_url, client, records)
        async with lifespan(app):
            assert app.lifecycle is not None
            await app.lifecycle.drain(asyncio.get_running_loop().time(), 1)
            await dead_owner(
                sqlite_url,
                "continue_final_message",
                provider.url + "/v1/chat/completions",
                b'data: {"choices":[{"index":0,"delta":{"content":"tok0 "}}]}\n\n',
                body,
            )
            await asyncio.sleep(1.0)  # the lease lapses, and the scan runs every 0.05 s
            info = await app.backend.get(GID)
            assert info is not None
            assert (info.status, info.attempt) == (Status.RUNNING, 1)
    assert provider.requests == []


async def test_each_attempt_has_a_span_linked_to_the_first_and_is_counted(
    sqlite_url: str, provider: FakeProvider
) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from asgi_disconnect import install

    trace_id, span_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    stored = (
        b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"role":"assistant",'
        b'"content":"tok0 "},"finish_reason":null}]}\n\n'
    )
    await dead_owner(
        sqlite_url,
        "continue_final_message",
        provider.url + "/v1/chat/completions",
        stored,
        body,
        trace=f"00-{trace_id}-{span_id}-01",
    )
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    records: list[UsageRecord] = []
    async with httpx.AsyncClient() as client:
        app = Starlette()
        backend = connect(sqlite_url, flush_interval=0.02, lease=0.3, takeover_interval=0.05)
        install(
            app,
            backend=backend,
            sinks=[records.append],
            upstreams={"fake": client},
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
        )
        async with lifespan(app):
            async with asyncio.timeout(10):
                while not [r for r in records if r.attempt == 2]:
                    await asyncio.sleep(0.05)
    (span,) = [s for s in spans.get_finished_spans() if s.name == "asgi_disconnect.takeover"]
    assert span.attributes is not None
    assert span.attributes["asgi_disconnect.attempt"] == 2
    assert span.attributes["asgi_disconnect.continuation"] == "continue_final_message"
    assert span.attributes["asgi_disconnect.outcome"] == "complete"
    (link,) = span.links
    assert f"{link.context.trace_id:032x}" == trace_id
    assert f"{link.context.span_id:016x}" == span_id
    data = reader.get_metrics_data()
    points = [
        point
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "asgi_disconnect.generations.taken_over"
        for point in metric.data.data_points
    ]
    assert [(dict(p.attributes), p.value) for p in points] == [
        (
            {
                "asgi_disconnect.continuation": "continue_final_message",
                "asgi_disconnect.outcome": "complete",
            },
            1,
        )
    ]
    tracer_provider.shutdown()
    meter_provider.shutdown()


async def test_a_continuation_the_provider_breaks_off_ends_failed_with_an_error_frame(
    sqlite_url: str,
) -> None:
    """Never a silent truncation: the stitched log ends with the package's error frame."""
    async with FakeProvider(tokens=TOKENS, tokens_per_second=0, fault="reset-after=5") as bad:
        body = {
            "model": "fake-model",
            "stream": True,
            "messages": [{"role": "user", "content": "x"}],
        }
        stored = (
            b'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"role":"assistant",'
            b'"content":"tok0 "},"finish_reason":null}]}\n\n'
        )
        await dead_owner(
            sqlite_url, "continue_final_message", bad.url + "/v1/chat/completions", stored, body
        )
        records: list[UsageRecord] = []
        async with httpx.AsyncClient() as client:
            app = taker(sqlite_url, client, records)
            async with lifespan(app):
                status = await ended(app)
                info = await app.backend.get(GID)
                assert info is not None
                log = b"".join([chunk async for chunk in app.backend.follow(GID, 0)])
    assert status is Status.FAILED
    assert log.startswith(stored)
    assert log.endswith(b"\n\n")
    assert b"event: error\ndata: " in log[len(stored) :]
    assert b"data: [DONE]" not in log
    (record,) = [record for record in records if record.attempt == 2]
    assert record.outcome == "error"


async def test_a_cancelling_generation_whose_process_died_gets_its_record_from_the_sweeper(
    sqlite_url: str,
) -> None:
    """Not detached, so no replica continues it: the process that marks it interrupted writes
    the record its dead owner could not, estimated from the stored text, once."""
    owner = connect(sqlite_url, flush_interval=0.02, lease=0.3)
    assert isinstance(owner, DurableBackend)
    await owner.open()
    try:
        generation = Generation(GID, principal="alice", content_type="text/event-stream")
        owner.register(generation)
        text = "".join(f"tok{i} " for i in range(20))
        generation.append(
            b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text.encode()
        )
        while await owner.flush():
            pass
        worker = owner._worker
        assert worker is not None
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    finally:
        owner._opened = False  # dead: nothing more is written, nothing flushed at close
        await owner.store.aclose()
    records: list[UsageRecord] = []
    sweepers = []
    for _ in range(2):  # two replicas sweep; the store hands the generation to one
        backend = connect(sqlite_url, flush_interval=0.02, lease=0.3, sweep_interval=0.05)
        assert isinstance(backend, DurableBackend)
        sweepers.append(
            DisconnectMiddleware(
                Starlette(), backend=backend, takeover_sinks=[records.append, backend.record_usage]
            )
        )
    async with lifespan(sweepers[0]), lifespan(sweepers[1]):
        async with asyncio.timeout(10):
            while not records:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # more sweeps: none writes it again
        stored = await sweepers[1].backend.usage_of(GID)  # type: ignore[attr-defined]
    (record,) = records
    assert stored == [record]
    assert record.outcome == "interrupted"
    assert record.error_type == "owner_lost"
    assert record.principal == "alice"
    assert record.usage_source == "estimated"
    assert record.output_tokens == round(len(text) / 4)
    assert record.attempt == 1


async def _died_owing_a_record(url: str, *, paid: bool, lease: float = 0.3) -> str:
    """A process that ended its generation whole, its usage record still owed (waiting on
    its client's TCP), flushed that, and died: the text it stored. ``paid``: it wrote the
    record just before dying. ``lease``: how long its mark outlives it."""
    owner = connect(url, flush_interval=0.02, lease=lease)
    assert isinstance(owner, DurableBackend)
    await owner.open()
    text = "".join(f"tok{i} " for i in range(24))
    try:
        generation = Generation(GID, principal="alice", content_type="text/event-stream")
        generation.policy = "detach"  # its route's; its client never left: not detached
        generation.record_owed = True
        owner.register(generation)
        generation.append(
            b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % text.encode()
        )
        generation.append(b"data: [DONE]\n\n")
        generation.finish(Status.COMPLETE)
        while await owner.flush():
            pass
        if paid:
            generation.record_owed = False  # as metering settles it, with the record
            owner.record_usage(msgspec.structs.replace(usage_record(GID), usage_source="provider"))
            while await owner.flush():
                pass
        worker = owner._worker
        assert worker is not None
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
    finally:
        owner._opened = False  # dead: nothing more is written, nothing flushed at close
        await owner.store.aclose()
    return text


@pytest.fixture(params=["sqlite", "postgres"])
def sql_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


async def test_a_record_its_process_died_waiting_to_write_is_written_by_the_sweeper(
    sql_url: str,
) -> None:
    """The generation ended whole; its process was SIGKILLed while the record waited on the
    client's TCP acknowledgements. The mark it left on the row (renewed by its heartbeat
    while it lived) lapses, and one replica writes the record, estimated and said so,
    with the generation's own ending; once."""
    url = sql_url
    text = await _died_owing_a_record(url, paid=False)
    records: list[UsageRecord] = []
    sweepers = []
    for _ in range(2):
        backend = connect(url, flush_interval=0.02, lease=0.3, sweep_interval=0.05)
        assert isinstance(backend, DurableBackend)
        sweepers.append(
            DisconnectMiddleware(
                Starlette(), backend=backend, takeover_sinks=[records.append, backend.record_usage]
            )
        )
    async with lifespan(sweepers[0]), lifespan(sweepers[1]):
        async with asyncio.timeout(10):
            while not records:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.8)  # more sweeps, more leases lapsed: none writes it again
        stored = await sweepers[1].backend.usage_of(GID)  # type: ignore[attr-defined]
        info = await sweepers[0].backend.get(GID)  # type: ignore[attr-defined]
    (record,) = records
    assert stored == [record]
    assert record.outcome == "complete"
    assert record.error_type == "owner_lost"
    assert (record.policy, record.detached) == ("detach", False)
    assert record.usage_source == "estimated"
    assert record.output_tokens == round(len(text) / 4)
    assert record.usage_note is not None
    assert "reached the client is unknown" in record.usage_note
    assert info is not None
    assert info.status == Status.COMPLETE


async def test_a_record_written_before_its_process_died_is_not_written_again(
    sql_url: str,
) -> None:
    """The mark is cleared in the flush that writes the record: nothing is owed."""
    url = sql_url
    await _died_owing_a_record(url, paid=True)
    records: list[UsageRecord] = []
    backend = connect(url, flush_interval=0.02, lease=0.3, sweep_interval=0.05)
    assert isinstance(backend, DurableBackend)
    sweeper = DisconnectMiddleware(
        Starlette(), backend=backend, takeover_sinks=[records.append, backend.record_usage]
    )
    async with lifespan(sweeper):
        await asyncio.sleep(1.0)  # leases of 0.3 s, sweeps every 0.05 s
        stored = await backend.usage_of(GID)
    assert records == []
    assert [r.usage_source for r in stored] == ["provider"]


async def test_a_sweep_that_could_not_make_the_record_leaves_the_mark_to_the_next_one(
    sql_url: str,
) -> None:
    """The sweep that claimed the mark cannot read the generation to make its record (one
    read fails). Its claim holds the mark for a lease its heartbeat does not renew: a later
    sweep takes it again and writes the record, once."""
    url = sql_url
    text = await _died_owing_a_record(url, paid=False)
    records: list[UsageRecord] = []
    backend = connect(url, flush_interval=0.02, lease=0.3, sweep_interval=0.05)
    assert isinstance(backend, DurableBackend)
    sweeper = DisconnectMiddleware(
        Starlette(), backend=backend, takeover_sinks=[records.append, backend.record_usage]
    )
    lost = backend.store.lost
    failed: list[list[str]] = []

    async def lost_once(ids: list[str]) -> list[Adopted]:
        if not failed:
            failed.append(list(ids))
            raise OSError("the read failed")
        return await lost(ids)

    backend.store.lost = lost_once  # type: ignore[method-assign]
    async with lifespan(sweeper):
        async with asyncio.timeout(10):
            while not records:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.8)  # more sweeps, more leases lapsed: none writes it again
        stored = await backend.usage_of(GID)
    assert failed == [[GID]]
    (record,) = records
    assert stored == [record]
    assert record.usage_source == "estimated"
    assert record.output_tokens == round(len(text) / 4)


class _Outage:
    """A store whose every call fails while ``down`` (the database is unreachable)."""

    def __init__(self, store: object) -> None:
        self.store = store
        self.down = False

    def __getattr__(self, name: str) -> object:
        value = getattr(self.store, name)
        if not callable(value) or name in ("open", "aclose"):
            return value

        async def call(*args: object, **kwargs: object) -> object:
            if self.down:
                raise OSError("the database is unreachable")
            return await value(*args, **kwargs)

        return call


async def test_after_an_outage_nothing_is_swept_before_live_owners_could_renew(
    sql_url: str,
) -> None:
    """The store is unreachable for longer than the lease, for the owner a little longer
    than for another replica (it retries later). When the store is back, the live owner's
    mark has lapsed; the replica back first waits a lease and a retry before it sweeps, so
    the owner renews it, and writes its own record: the only one."""
    url = sql_url
    owner = connect(url, flush_interval=0.02, lease=0.3)
    assert isinstance(owner, DurableBackend)
    records: list[UsageRecord] = []
    backend = connect(url, flush_interval=0.02, lease=0.3, sweep_interval=0.05)
    assert isinstance(backend, DurableBackend)
    app = DisconnectMiddleware(
        Starlette(), backend=backend, takeover_sinks=[records.append, backend.record_usage]
    )
    async with owner, lifespan(app):
        generation = Generation(GID, principal="alice", content_type="text/event-stream")
        generation.record_owed = True
        owner.register(generation)
        generation.append(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
        generation.append(b"data: [DONE]\n\n")
        generation.finish(Status.COMPLETE)
        await asyncio.sleep(0.3)  # stored, marked, renewed
        owners, others = _Outage(owner.store), _Outage(backend.store)
        owner.store, backend.store = owners, others  # type: ignore[assignment]
        owners.down = others.down = True
        await asyncio.sleep(0.6)  # twice the lease: the mark lapses
        others.down = False
        await asyncio.sleep(0.4)  # the other replica is back, and would sweep
        owners.down = False
        await asyncio.sleep(1.0)  # past its wait: its sweeps find the mark renewed
        assert records == [], "a replica took a live owner's mark"
        generation.record_owed = False  # as metering settles it, with the record
        record = msgspec.structs.replace(usage_record(GID), usage_source="provider")
        owner.record_usage(record)
        async with asyncio.timeout(5):
            while await owner.usage_of(GID) != [record]:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        stored = await backend.usage_of(GID)
    assert records == []
    assert stored == [record]
