"""The backend contract on memory, SQLite and PostgreSQL, and what durability promises."""

from __future__ import annotations

import asyncio
import random
import re
import time

import anyio
import asyncpg
import pytest

from asgi_disconnect import BackendUnavailable, DisconnectMiddleware, UsageRecord, connect
from asgi_disconnect._backends import Backend, DurableBackend
from asgi_disconnect._log import Generation, Status
from asgi_disconnect.testing import drive
from tests.apps import TESTER, Probe, as_tester, sse_app

pytestmark = pytest.mark.anyio

GID = "gen_" + "A" * 24


def durable(url: str, **options: object) -> DurableBackend:
    options.setdefault("flush_interval", 0.02)
    backend = connect(url, **options)  # type: ignore[arg-type]
    assert isinstance(backend, DurableBackend)
    return backend


async def read_all(backend: Backend, generation_id: str, offset: int = 0) -> bytes:
    return b"".join([chunk async for chunk in backend.follow(generation_id, offset)])


async def settle(backend: DurableBackend) -> None:
    while await backend.flush():
        pass


async def test_round_trip(backend_url: str) -> None:
    backend = connect(backend_url)
    await backend.open()
    try:
        generation = Generation(GID, principal="alice", content_type="text/event-stream")
        backend.register(generation)
        for i in range(50):
            generation.append(b"data: %d\n\n" % i)
        generation.policy = "detach"
        generation.detached = True
        generation.finish(Status.COMPLETE)
        body = generation.read(0)
        if isinstance(backend, DurableBackend):
            await settle(backend)
            assert backend.pending_bytes() == 0
        info = await backend.get(GID)
        assert info is not None
        assert info.status is Status.COMPLETE
        assert info.size == len(body)
        assert info.policy == "detach"
        assert info.detached is True
        assert info.content_type == "text/event-stream"
        assert await backend.principal_of(GID) == "alice"
        assert await read_all(backend, GID) == body
        assert await read_all(backend, GID, 7) == body[7:]
        assert await read_all(backend, GID, len(body)) == b""
        assert await backend.get("gen_" + "B" * 24) is None
        assert await backend.principal_of("gen_" + "B" * 24) is None
        assert await read_all(backend, "gen_" + "B" * 24) == b""
    finally:
        await backend.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_another_process_reads_and_follows_live(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(f"{kind}_url")
    writer = durable(url)
    reader = durable(url, poll_interval=0.02)
    await writer.open()
    await reader.open()
    try:
        generation = Generation(GID, principal="alice")
        writer.register(generation)
        generation.append(b"first;")
        await settle(writer)

        async def produce() -> None:
            for i in range(20):
                generation.append(b"chunk %d;" % i)
                await asyncio.sleep(0.01)
            generation.finish(Status.COMPLETE)

        producer = asyncio.ensure_future(produce())
        async with asyncio.timeout(10):
            followed = await read_all(reader, GID, 2)
        await producer
        whole = b"first;" + b"".join(b"chunk %d;" % i for i in range(20))
        assert followed == whole[2:]
        info = await reader.get(GID)
        assert info is not None
        assert info.status is Status.COMPLETE
    finally:
        await writer.aclose()
        await reader.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_chunks_are_batched_not_one_statement_each(
    kind: str, request: pytest.FixtureRequest
) -> None:
    backend = durable(request.getfixturevalue(f"{kind}_url"), flush_interval=0.05)
    await backend.open()
    flushes = 0
    original = backend.store.flush

    async def counting(batch):  # type: ignore[no-untyped-def]
        nonlocal flushes
        flushes += 1
        await original(batch)

    backend.store.flush = counting  # type: ignore[method-assign]
    try:
        generation = Generation(GID, principal=TESTER)
        backend.register(generation)
        started = time.monotonic()
        for i in range(1000):
            generation.append(b"x%d" % i)
            if i % 100 == 0:
                await asyncio.sleep(0.01)
        generation.finish(Status.COMPLETE)
        async with asyncio.timeout(5):
            while backend.pending_bytes() or (await backend.get(GID)).status is Status.RUNNING:  # type: ignore[union-attr]
                await asyncio.sleep(0.01)
        elapsed = time.monotonic() - started
        assert flushes <= elapsed / 0.05 + 3
        assert flushes < 20
    finally:
        await backend.aclose()


async def committed_then_failed(backend: DurableBackend) -> None:
    """A flush whose COMMIT went through but whose caller was told it failed."""
    original = backend.store.flush

    async def ambiguous(batch):  # type: ignore[no-untyped-def]
        await original(batch)
        raise ConnectionError("the connection dropped during COMMIT")

    backend.store.flush = ambiguous  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await backend.flush()
    backend.store.flush = original  # type: ignore[method-assign]


async def committed_then_cancelled(backend: DurableBackend) -> None:
    """A flush cancelled (at shutdown, say) while its write went on to commit."""
    original = backend.store.flush
    writing = asyncio.Event()

    async def slow(batch):  # type: ignore[no-untyped-def]
        async def write() -> None:
            writing.set()
            await asyncio.sleep(0.05)
            await original(batch)

        await asyncio.shield(write())

    backend.store.flush = slow  # type: ignore[method-assign]
    flushing = asyncio.ensure_future(backend.flush())
    await writing.wait()
    flushing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await flushing
    backend.store.flush = original  # type: ignore[method-assign]
    await asyncio.sleep(0.1)  # the shielded write commits meanwhile, as a thread's would


async def failed_before_commit(backend: DurableBackend) -> None:
    async def refused(batch):  # type: ignore[no-untyped-def]
        raise ConnectionError("connection refused")

    original = backend.store.flush
    backend.store.flush = refused  # type: ignore[method-assign]
    with pytest.raises(ConnectionError):
        await backend.flush()
    backend.store.flush = original  # type: ignore[method-assign]


@pytest.fixture(params=["sqlite", "postgres"])
def durable_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


@pytest.mark.parametrize(
    "fault", [committed_then_failed, committed_then_cancelled, failed_before_commit]
)
async def test_a_flush_whose_outcome_is_unknown_loses_nothing_and_writes_nothing_twice(
    durable_url: str, fault: object
) -> None:
    url = durable_url
    writer = durable(url, flush_interval=5.0, lease=30.0)  # flushed by hand
    reader = durable(url)
    await writer.open()
    await reader.open()
    try:
        generation = Generation(GID, principal=TESTER)
        writer.register(generation)
        generation.append(b"one;")
        await settle(writer)
        generation.append(b"two;")
        record = usage_record(GID)
        writer.record_usage(record)
        await fault(writer)  # type: ignore[operator]
        generation.append(b"three;")
        await fault(writer)  # type: ignore[operator]
        generation.append(b"four;")
        generation.finish(Status.COMPLETE)
        await settle(writer)
        info = await reader.get(GID)
        assert info is not None
        assert info.status is Status.COMPLETE
        assert info.size == len(b"one;two;three;four;")
        assert await read_all(reader, GID) == b"one;two;three;four;"
        assert await read_all(reader, GID, 5) == b"wo;three;four;"
        # Its usage record went with two flushes that may have committed: stored once.
        assert await reader.usage_of(GID) == [record]
    finally:
        await writer.aclose()
        await reader.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_lost_owner_is_swept_as_interrupted_and_fenced(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(f"{kind}_url")
    crashed = durable(url, lease=0.3, sweep_interval=0.05)
    await crashed.open()
    generation = Generation(GID, principal=TESTER, content_type="text/event-stream")
    crashed.register(generation)
    generation.append(b"data: kept\n\n")
    await settle(crashed)
    # The owner loses its store, as with kill -9: nothing of it renews the lease.
    await crashed.store.aclose()
    survivor = durable(url, lease=0.3, sweep_interval=0.05)
    await survivor.open()
    try:
        async with asyncio.timeout(5):
            while (info := await survivor.get(GID)) is None or info.status is Status.RUNNING:
                await asyncio.sleep(0.05)
        assert info.status is Status.INTERRUPTED
        assert info.size == len(b"data: kept\n\n")
        # The old owner comes back and tries to complete it: the fence holds.
        await crashed.store.open()
        generation.append(b"data: late\n\n")
        generation.finish(Status.COMPLETE)
        await settle(crashed)
        after = await survivor.get(GID)
        assert after is not None
        assert after.status is Status.INTERRUPTED
        # Resumed through the middleware: the prefix, then an error frame.
        mw = DisconnectMiddleware(sse_app(Probe()), backend=survivor, principal=as_tester)
        replay = await drive(mw, path=f"/generations/{GID}/stream")
        assert replay.body.startswith(b"data: kept\n\n")
        assert b'event: error\ndata: {"error":{"type":"interrupted"' in replay.body
    finally:
        await survivor.aclose()
        await crashed.aclose()


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_finished_generations_expire_and_are_reaped(
    kind: str, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue(f"{kind}_url")
    backend = durable(url, ttl=0.2, reap_interval=0.05)
    await backend.open()
    try:
        for n in range(3):
            generation = Generation(f"gen_{n}" + "C" * 23, principal=TESTER)
            backend.register(generation)
            generation.append(b"bytes")
            generation.finish(Status.COMPLETE)
        await settle(backend)
        assert await backend.get("gen_0" + "C" * 23) is not None
        await asyncio.sleep(0.3)
        assert await backend.get("gen_0" + "C" * 23) is None
        async with asyncio.timeout(5):
            while await backend.store.reap(1000):
                pass
        assert await backend.store.read("gen_0" + "C" * 23, 0, 100) == b""
    finally:
        await backend.aclose()


async def test_unreachable_postgres_names_the_url_with_the_password_masked() -> None:
    backend = connect("postgresql://app:s3cret@127.0.0.1:1/nowhere")
    with pytest.raises(BackendUnavailable) as caught:
        await backend.open()
    message = str(caught.value)
    assert "postgresql://app:***@127.0.0.1:1/nowhere" in message
    assert "s3cret" not in message


async def test_unopenable_sqlite_names_the_url(tmp_path: object) -> None:
    backend = connect("sqlite:////nonexistent-dir/x/y.db")
    with pytest.raises(BackendUnavailable, match=re.escape("sqlite:////nonexistent-dir/x/y.db")):
        await backend.open()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://localhost", "unknown backend URL scheme 'redis'"),
        ("nothing", "needs a scheme"),
        ("sqlite://", "sqlite:///path"),
        ("sqlite:///", "sqlite:///path"),
        ("postgresql://h/db?schema=Bad-Name", "lower-case SQL identifier"),
    ],
)
def test_bad_urls_are_clear_errors(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        connect(url)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"flush_interval": 0}, "flush_interval"),
        ({"flush_max_bytes": 0}, "flush_max_bytes"),
        ({"lease": 0.01}, "lease"),
        ({"ttl": 0}, "ttl"),
    ],
)
def test_bad_durable_options(options: dict[str, object], sqlite_url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        connect(sqlite_url, **options)  # type: ignore[arg-type]


async def test_newer_schema_version_is_refused(postgres_url: str, postgres_dsn: str) -> None:
    backend = durable(postgres_url)
    await backend.open()
    await backend.aclose()
    schema = postgres_url.rsplit("schema=", 1)[1]
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute(
            f'update "{schema}".asgi_disconnect_meta '
            "set value = '99' where key = 'schema_version'"
        )
    finally:
        await conn.close()
    with pytest.raises(BackendUnavailable, match="schema version 99"):
        await durable(postgres_url).open()


async def test_sqlite_newer_schema_version_is_refused(sqlite_url: str) -> None:
    import sqlite3

    backend = durable(sqlite_url)
    await backend.open()
    await backend.aclose()
    db = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    db.execute("update asgi_disconnect_meta set value = '99' where key = 'schema_version'")
    db.commit()
    db.close()
    with pytest.raises(BackendUnavailable, match="schema version 99"):
        await durable(sqlite_url).open()


async def test_existing_pool_is_used_and_left_open(postgres_url: str, postgres_dsn: str) -> None:
    pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=3)
    try:
        schema = postgres_url.rsplit("schema=", 1)[1]
        backend = connect("postgresql://", pool=pool, schema=schema, flush_interval=0.02)
        await backend.open()
        generation = Generation(GID, principal=TESTER)
        backend.register(generation)
        generation.append(b"pooled")
        generation.finish(Status.COMPLETE)
        await backend.aclose()
        assert (
            await pool.fetchval(
                f'select size from "{schema}".asgi_disconnect_generations where id = $1', GID
            )
            == 6
        )
    finally:
        await pool.close()


async def test_the_memory_backend_answers_a_wait_for_size_at_once() -> None:
    # No other process writes to it: its generations are as big as they are now.
    backend = connect("memory://")
    generation = Generation(GID, principal=TESTER)
    backend.register(generation)
    generation.append(b"data: 0\n\n")
    asked = await backend.get(GID)
    assert asked is not None
    generation.append(b"data: 1\n\n")
    with anyio.fail_after(0.5):
        info = await backend.wait_for_size(asked, asked.size + 1000, timeout=5.0)
    assert (info.status, info.size) == (Status.RUNNING, generation.size)
    generation.finish(Status.COMPLETE)


async def test_resume_past_the_durable_size_waits_for_the_flush(sqlite_url: str) -> None:
    writer = durable(sqlite_url, flush_interval=0.3)
    reader = durable(sqlite_url, poll_interval=0.02)
    await writer.open()
    await reader.open()
    try:
        generation = Generation(GID, principal=TESTER)
        writer.register(generation)
        generation.append(b"persisted;")
        await settle(writer)
        generation.append(b"not yet durable;")
        # A client that read both chunks from the owner asks another replica for the rest.
        offset = generation.size
        mw = DisconnectMiddleware(sse_app(Probe()), backend=reader, principal=as_tester)

        async def finish_later() -> None:
            await asyncio.sleep(0.1)
            generation.append(b"the rest")
            generation.finish(Status.COMPLETE)

        later = asyncio.ensure_future(finish_later())
        resumed = await drive(
            mw, path=f"/generations/{GID}/stream", query_string=f"offset={offset}".encode()
        )
        await later
        assert resumed.status == 200
        assert resumed.body == b"the rest"
    finally:
        await writer.aclose()
        await reader.aclose()


async def test_resume_far_past_the_durable_size_is_416_at_once(sqlite_url: str) -> None:
    writer = durable(sqlite_url)
    reader = durable(sqlite_url, poll_interval=0.02)
    await writer.open()
    await reader.open()
    try:
        generation = Generation(GID, principal=TESTER)
        writer.register(generation)
        generation.append(b"persisted;")
        await settle(writer)
        mw = DisconnectMiddleware(sse_app(Probe()), backend=reader, principal=as_tester)
        # No owner is 1 GiB ahead of what it flushed 50 ms ago: no waiting for it.
        far = generation.size + (1 << 30)
        with anyio.fail_after(1):
            resumed = await drive(
                mw,
                path=f"/generations/{GID}/stream",
                query_string=f"offset={far}".encode(),
                timeout=1,
            )
        assert resumed.status == 416
        assert resumed.header("content-type") == "application/problem+json"
        assert resumed.header("content-range") == f"bytes */{generation.size}"
        generation.finish(Status.COMPLETE)
    finally:
        await writer.aclose()
        await reader.aclose()


async def test_a_postgres_flush_of_any_shape_is_one_round_trip(
    postgres_url: str, postgres_dsn: str
) -> None:
    """A new generation, its chunks, a change of policy, its usage record and its end: one
    statement. Under load a flush waits on the event loop once per round trip, and output
    waits in memory for it (docs/performance.md)."""
    calls: list[str] = []

    class Counted(asyncpg.Connection):  # type: ignore[misc]
        async def execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if "asgi_disconnect" in str(args[0]):  # not asyncpg's reset of a pool of yours
                calls.append(str(args[0]))
            return await super().execute(*args, **kwargs)

        async def executemany(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if "asgi_disconnect" in str(args[0]):  # not asyncpg's reset of a pool of yours
                calls.append(str(args[0]))
            return await super().executemany(*args, **kwargs)

        async def fetch(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if "asgi_disconnect" in str(args[0]):  # not asyncpg's reset of a pool of yours
                calls.append(str(args[0]))
            return await super().fetch(*args, **kwargs)

        async def fetchval(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            if "asgi_disconnect" in str(args[0]):  # not asyncpg's reset of a pool of yours
                calls.append(str(args[0]))
            return await super().fetchval(*args, **kwargs)

    pool = await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=3, connection_class=Counted)
    schema = postgres_url.rsplit("schema=", 1)[1]
    backend = connect("postgresql://", pool=pool, schema=schema, flush_interval=3, lease=30)
    try:
        await backend.open()
        assert isinstance(backend, DurableBackend)
        await asyncio.sleep(0.3)  # the worker's first round (heartbeat, sweep) is over
        generation = Generation(GID, principal=TESTER)
        generation.policy = "cancel"
        backend.register(generation)
        generation.append(b"data: first\n\n")
        calls.clear()
        assert not await backend.flush()  # created, with its first chunk
        (statement,) = calls
        assert ".asgi_disconnect_flush(" in statement
        for i in range(50):
            generation.append(b"data: %d\n\n" % i)
        generation.policy, generation.detached = "detach", True  # its client left
        generation.finish(Status.COMPLETE)
        backend.record_usage(usage_record(GID))
        calls.clear()
        assert not await backend.flush()  # chunks, the change, the record and the end
        assert calls == [statement]
        stored = await pool.fetchrow(
            f'select status, policy, detached, size from "{schema}".asgi_disconnect_generations '
            "where id = $1",
            GID,
        )
        assert dict(stored) == {
            "status": "complete",
            "policy": "detach",
            "detached": True,
            "size": generation.size,
        }
        expected = b"data: first\n\n" + b"".join(b"data: %d\n\n" % i for i in range(50))
        assert await read_all(backend, GID) == expected
        records = await pool.fetchval(
            f'select count(*) from "{schema}".asgi_disconnect_usage where request_id = $1', GID
        )
        assert records == 1
        # The same batch again (a commit whose outcome was unknown): nothing twice.
        backend.record_usage(usage_record(GID))
        await backend.flush()
        assert (
            await pool.fetchval(
                f'select count(*) from "{schema}".asgi_disconnect_usage where request_id = $1', GID
            )
            == 1
        )
    finally:
        await backend.aclose()
        await pool.close()


def usage_record(generation_id: str | None) -> UsageRecord:
    return UsageRecord(
        generation_id=generation_id,
        principal="alice",
        method="POST",
        route="/v1/chat",
        status_code=200,
        provider="openai_chat",
        model="m",
        outcome="cancelled",
        input_tokens=12,
        output_tokens=30,
        usage_source="estimated",
        produced_bytes=900,
        delivered_bytes=700,
        produced_output_tokens=30,
        delivered_output_tokens=23,
        time_to_first_event=0.1,
        duration=1.5,
        finish_reason=None,
        error_type=None,
        started_at=1.0,
    )


async def test_usage_records_waiting_for_the_store_are_bounded(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    backend = durable(sqlite_url, flush_interval=5.0, lease=30.0, max_pending_usage=10)
    await backend.open()
    try:
        records = [usage_record(f"gen_{n:024d}") for n in range(25)]
        for record in records[:20]:
            backend.record_usage(record)
        await failed_before_commit(backend)
        for record in records[20:]:
            backend.record_usage(record)
        assert backend.usage_dropped == 15
        assert any("dropped the oldest" in r.getMessage() for r in caplog.records)
        await settle(backend)
        assert await backend.usage_of(records[14].generation_id) == []  # type: ignore[arg-type]
        assert await backend.usage_of(records[15].generation_id) == [records[15]]  # type: ignore[arg-type]
        assert await backend.usage_of(records[24].generation_id) == [records[24]]  # type: ignore[arg-type]
    finally:
        await backend.aclose()


def test_a_bad_pending_usage_bound_is_refused(sqlite_url: str) -> None:
    with pytest.raises(ValueError, match="max_pending_usage"):
        durable(sqlite_url, max_pending_usage=0)


async def test_a_usage_table_from_before_request_ids_gets_the_column(sqlite_url: str) -> None:
    import sqlite3

    path = sqlite_url.removeprefix("sqlite:///")
    backend = durable(sqlite_url)
    await backend.open()
    await backend.aclose()
    db = sqlite3.connect(path)
    db.execute("drop index asgi_disconnect_usage_request")
    db.execute("alter table asgi_disconnect_usage drop column request_id")
    db.commit()
    db.close()
    backend = durable(sqlite_url)
    await backend.open()
    try:
        record = usage_record(GID)
        backend.record_usage(record)
        await settle(backend)
        backend.record_usage(record)  # the same request's record again: kept once
        await settle(backend)
        assert await backend.usage_of(GID) == [record]
    finally:
        await backend.aclose()


async def test_usage_records_are_stored(backend_url: str) -> None:
    backend = connect(backend_url)
    await backend.open()
    try:
        record = usage_record(GID)
        backend.record_usage(record)
        if isinstance(backend, DurableBackend):
            await settle(backend)
        assert await backend.usage_of(GID) == [record]
        assert await backend.usage_of("gen_" + "B" * 24) == []
    finally:
        await backend.aclose()


async def test_created_at_and_finished_at_read_the_same_live_and_stored(backend_url: str) -> None:
    # GET /generations/{id} answers from the live log while the generation runs here and
    # from the database once it is flushed and done, or from another replica.
    backend = connect(backend_url)
    replica = connect(backend_url) if backend_url != "memory://" else backend
    await backend.open()
    await replica.open()
    try:
        generation = Generation(GID, principal="alice")
        backend.register(generation)
        generation.append(b"data: 1\n\n")
        seen = [await backend.get(GID)]
        if isinstance(backend, DurableBackend):
            await settle(backend)
        seen.append(await replica.get(GID))
        generation.finish(Status.COMPLETE)
        finished = [await backend.get(GID)]
        if isinstance(backend, DurableBackend):
            await settle(backend)
        finished += [await backend.get(GID), await replica.get(GID)]
    finally:
        await backend.aclose()
        await replica.aclose()
    infos = [info for info in seen + finished if info is not None]
    assert len(infos) == 5
    assert [info.status for info in infos] == [Status.RUNNING] * 2 + [Status.COMPLETE] * 3
    assert {info.created_at for info in infos} == {generation.created_at}
    assert {info.finished_at for info in infos[2:]} == {generation.finished_at}
    assert generation.finished_at is not None
    assert generation.created_at <= generation.finished_at <= time.time()


@pytest.mark.parametrize("store", ["sqlite_url", "postgres_url"])
async def test_times_survive_the_database_exactly(
    store: str, request: pytest.FixtureRequest
) -> None:
    # Times are kept to the microsecond: any such float must read back unchanged.
    rng = random.Random(7)
    backend = durable(str(request.getfixturevalue(store)))
    await backend.open()
    times: dict[str, tuple[float, float]] = {}
    try:
        for i in range(300):
            micros = rng.randrange(0, 4_000_000_000 * 10**6)
            generation = Generation(f"gen_{i:024d}", principal="alice")
            generation.created_at = micros / 1e6
            backend.register(generation)
            generation.finish(Status.COMPLETE)
            generation.finished_at = (micros + rng.randrange(10**9)) / 1e6
            times[generation.id] = (generation.created_at, generation.finished_at)
        await settle(backend)
        assert backend.pending_bytes() == 0
        for generation_id, expected in times.items():
            info = await backend.get(generation_id)
            assert info is not None
            assert (info.created_at, info.finished_at) == expected
    finally:
        await backend.aclose()


async def test_postgres_closes_at_once_even_right_after_opening(postgres_url: str) -> None:
    # Closing while the listening connection is still being set up must not lose it,
    # or the pool's close waits for it (10 s) on every such shutdown.
    for _ in range(40):
        backend = durable(postgres_url)
        await backend.open()
        with anyio.fail_after(3):
            await backend.aclose()
