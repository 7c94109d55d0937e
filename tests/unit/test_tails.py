"""Live tails on a replica that does not own the generation: shared, capped, complete."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Callable

import pytest

from asgi_disconnect import DisconnectMiddleware, _resume, connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._log import Generation, Status
from asgi_disconnect.testing import drive
from tests.apps import TESTER, Probe, as_tester, sse_app

pytestmark = pytest.mark.anyio

POLL = 0.02


def durable(url: str, **options: object) -> DurableBackend:
    backend = connect(url, **options)  # type: ignore[arg-type]
    assert isinstance(backend, DurableBackend)
    return backend


async def settle(backend: DurableBackend) -> None:
    while await backend.flush():
        pass


class Statements:
    """Counts the SQL statements a SQLite backend's connection runs, through sqlite3's trace
    callback, which ``connect(..., init=)`` sets on the connection."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def trace(self, db: sqlite3.Connection) -> None:
        db.set_trace_callback(self.ran.append)

    @property
    def count(self) -> int:
        return len(self.ran)

    @property
    def reads(self) -> int:
        """The statements that read: what the tails' polling runs, without the backend's own
        upkeep (a heartbeat, a sweep), which writes."""
        return sum(1 for sql in self.ran if sql.lstrip().lower().startswith(("select", "with")))

    def about(self, generation_id: str) -> list[str]:
        return [sql for sql in self.ran if generation_id in sql]


@pytest.fixture
def statements() -> Statements:
    """What the reader of ``replicas`` runs (cleared where the counting starts)."""
    return Statements()


@pytest.fixture
async def replicas(
    sqlite_url: str, statements: Statements
) -> AsyncIterator[tuple[DurableBackend, DurableBackend]]:
    writer = durable(sqlite_url, flush_interval=5.0, lease=30.0)  # flushed by hand below
    reader = durable(sqlite_url, poll_interval=POLL, init=statements.trace)
    await writer.open()
    await reader.open()
    yield writer, reader
    await reader.aclose()
    await writer.aclose()


class Tail:
    def __init__(self, backend: DurableBackend, generation_id: str, offset: int = 0) -> None:
        self.offset = offset
        self.body = b""
        self.grew = asyncio.Event()
        self.task = asyncio.ensure_future(self._read(backend, generation_id))

    async def _read(self, backend: DurableBackend, generation_id: str) -> None:
        async for data in backend.follow(generation_id, self.offset):
            self.body += data
            self.grew.set()

    async def reach(self, size: int) -> None:
        while self.offset + len(self.body) < size:
            self.grew.clear()
            await self.grew.wait()


async def test_tails_of_one_generation_share_one_poller(
    replicas: tuple[DurableBackend, DurableBackend], statements: Statements
) -> None:
    writer, reader = replicas
    generation = Generation("gen_" + "T" * 24, principal=TESTER)
    writer.register(generation)
    generation.append(b"data: 0\n\n")
    await settle(writer)
    statements.ran.clear()
    loop = asyncio.get_running_loop()
    started = loop.time()
    tails = [Tail(reader, generation.id, offset=n % 5) for n in range(300)]
    async with asyncio.timeout(20):
        await asyncio.gather(*(tail.reach(generation.size) for tail in tails))
        changes = 10
        for n in range(1, changes + 1):
            generation.append(b"data: %d\n\n" % n)
            await settle(writer)
            await asyncio.gather(*(tail.reach(generation.size) for tail in tails))
        generation.finish(Status.COMPLETE)
        await settle(writer)
        await asyncio.gather(*(tail.task for tail in tails))
    intervals = (loop.time() - started) / POLL + 1
    body = b"".join(b"data: %d\n\n" % n for n in range(changes + 1))
    assert all(tail.body == body[tail.offset :] for tail in tails)
    # Per poll interval, and per change: a few statements, not two per reader (600 here).
    # Each reader's first read, from its own offset, is its own.
    assert statements.count - len(tails) < 2 * intervals + 4 * (changes + 1)


async def test_idle_tails_of_many_generations_cost_one_statement_per_interval(
    replicas: tuple[DurableBackend, DurableBackend], statements: Statements
) -> None:
    writer, reader = replicas
    made = [Generation(f"gen_{n:024d}", principal=TESTER) for n in range(100)]
    for generation in made:
        writer.register(generation)
        generation.append(b"data: start\n\n")
    await settle(writer)
    tails = [Tail(reader, generation.id) for generation in made for _ in range(3)]
    async with asyncio.timeout(20):
        await asyncio.gather(*(tail.reach(made[0].size) for tail in tails))
        statements.ran.clear()
        loop = asyncio.get_running_loop()
        started = loop.time()
        # Nothing changes for a while: the polling is all that runs.
        await asyncio.sleep(20 * POLL)
        ran, intervals = statements.reads, (loop.time() - started) / POLL
        for generation in made:
            generation.finish(Status.COMPLETE)
        await settle(writer)
        await asyncio.gather(*(tail.task for tail in tails))
    assert all(tail.body == b"data: start\n\n" for tail in tails)
    # One statement per poll interval for the whole store, not one per generation (100).
    assert ran <= intervals + 2, statements.ran


async def test_a_reader_that_joins_late_or_lags_gets_every_byte(
    replicas: tuple[DurableBackend, DurableBackend],
) -> None:
    writer, reader = replicas
    generation = Generation("gen_" + "L" * 24, principal=TESTER)
    writer.register(generation)
    async with asyncio.timeout(20):
        for n in range(50):
            generation.append(b"%d;" % n * (n + 1))
            await settle(writer)
            if n == 0:
                early = Tail(reader, generation.id)
            if n == 25:
                late = Tail(reader, generation.id, offset=7)
            if n % 10 == 0:
                await early.reach(generation.size)
        generation.finish(Status.COMPLETE)
        await settle(writer)
        await asyncio.gather(early.task, late.task)
    body = b"".join(b"%d;" % n * (n + 1) for n in range(50))
    assert len(body) == generation.size
    assert early.body == body
    assert late.body == body[7:]


async def test_a_tail_ends_with_a_generation_that_expired(
    replicas: tuple[DurableBackend, DurableBackend], sqlite_url: str
) -> None:
    writer, reader = replicas
    generation = Generation("gen_" + "E" * 24, principal=TESTER)
    writer.register(generation)
    generation.append(b"data: 0\n\n")
    await settle(writer)
    tail = Tail(reader, generation.id)
    async with asyncio.timeout(20):
        await tail.reach(generation.size)
        await asyncio.to_thread(expire, sqlite_url, generation.id)
        await tail.task
    assert tail.body == b"data: 0\n\n"
    generation.finish(Status.COMPLETE)


def expire(sqlite_url: str, generation_id: str) -> None:
    """Expire the generation in the file, from a connection of our own."""
    with contextlib.closing(sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))) as db, db:
        db.execute(
            "update asgi_disconnect_generations set expires_at = 0 where id = ?", (generation_id,)
        )


@pytest.fixture(params=["sqlite", "postgres"])
def durable_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


async def test_readers_of_one_generation_query_the_store_once_per_change(
    durable_url: str,
) -> None:
    writer = durable(durable_url, flush_interval=5.0, lease=30.0)
    reader = durable(durable_url, poll_interval=POLL)
    await writer.open()
    await reader.open()
    calls = {"info": 0, "read": 0}
    store = reader.store
    info, read = store.info, store.read

    async def counted_info(generation_id: str):  # type: ignore[no-untyped-def]
        calls["info"] += 1
        return await info(generation_id)

    async def counted_read(generation_id: str, offset: int, limit: int) -> bytes:
        calls["read"] += 1
        return await read(generation_id, offset, limit)

    store.info = counted_info  # type: ignore[method-assign]
    store.read = counted_read  # type: ignore[method-assign]
    try:
        generation = Generation("gen_" + "Q" * 24, principal=TESTER)
        writer.register(generation)
        generation.append(b"data: 0\n\n")
        await settle(writer)
        tails = [Tail(reader, generation.id) for _ in range(100)]
        changes = 10
        async with asyncio.timeout(20):
            await asyncio.gather(*(tail.reach(generation.size) for tail in tails))
            for n in range(1, changes + 1):
                generation.append(b"data: %d\n\n" % n)
                await settle(writer)
                await asyncio.gather(*(tail.reach(generation.size) for tail in tails))
            generation.finish(Status.COMPLETE)
            await settle(writer)
            await asyncio.gather(*(tail.task for tail in tails))
        body = b"".join(b"data: %d\n\n" % n for n in range(changes + 1))
        assert all(tail.body == body for tail in tails)
        # Each reader's first read is its own; after that, a few calls per change, shared.
        # (Per reader, it was one info and one read each poll: thousands here.)
        assert calls["read"] <= len(tails) + 2 * (changes + 2)
        assert calls["info"] <= 4 * (changes + 2)
    finally:
        await reader.aclose()
        await writer.aclose()


async def test_a_client_that_leaves_stops_following_at_once(
    replicas: tuple[DurableBackend, DurableBackend], statements: Statements
) -> None:
    writer, reader = replicas
    generation = Generation("gen_" + "G" * 24, principal=TESTER, content_type="text/event-stream")
    writer.register(generation)
    generation.append(b"data: 0\n\n")
    await settle(writer)
    mw = DisconnectMiddleware(sse_app(Probe()), backend=reader, principal=as_tester)
    result = await drive(mw, path=f"/generations/{generation.id}/stream", disconnect_after_bytes=1)
    assert result.disconnected
    assert result.body == b"data: 0\n\n"
    # Its tail is gone with it, poller and all: the reader no longer asks the store about the
    # generation (one look may have been under way as it left), while it goes on running.
    statements.ran.clear()
    await asyncio.sleep(10 * POLL)
    assert len(statements.about(generation.id)) <= 1
    generation.finish(Status.COMPLETE)


# -- readers past the stored end ------------------------------------------------------


def is_lookup(sql: str) -> bool:
    """A generation's row read by id: a request's own ``principal_of`` and ``get``, or a
    tail's look at the store."""
    return "asgi_disconnect_generations" in sql and "where id = " in sql and "principal" in sql


@pytest.fixture(params=["sqlite", "postgres"])
def database(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """A database URL, and the DSN of its server on PostgreSQL."""
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url")), None
    return str(request.getfixturevalue("postgres_url")), str(
        request.getfixturevalue("postgres_dsn")
    )


@pytest.fixture
async def counted(
    database: tuple[str, str | None], statements: Statements
) -> AsyncIterator[tuple[DurableBackend, DurableBackend]]:
    """Two replicas on one database (SQLite, then PostgreSQL): a writer flushed by hand, and a
    reader whose every statement ``statements`` records, generation ids included."""
    import asyncpg

    url, dsn = database
    pool = None
    if dsn is None:
        reader = durable(url, poll_interval=POLL, init=statements.trace)
    else:

        async def init(conn: asyncpg.Connection) -> None:
            conn.add_query_logger(
                lambda record: statements.ran.append(f"{record.query} {record.args}")
            )

        async def rollback(conn: asyncpg.Connection) -> None:
            # As the store's own pool: no reset query on release, which would count.
            if conn.is_in_transaction():
                await conn.execute("rollback")

        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, init=init, reset=rollback)
        reader = durable("postgresql://", pool=pool, schema=url.rsplit("schema=", 1)[1])
    writer = durable(url, flush_interval=5.0, lease=30.0)  # flushed by hand below
    await writer.open()
    await reader.open()
    yield writer, reader
    await reader.aclose()
    if pool is not None:
        await pool.close()
    await writer.aclose()


async def wait_until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(POLL / 4)


async def test_readers_past_the_stored_end_cost_queries_per_change_not_per_reader(
    counted: tuple[DurableBackend, DurableBackend], statements: Statements
) -> None:
    writer, reader = counted
    generation = Generation("gen_" + "W" * 24, principal=TESTER)
    writer.register(generation)
    generation.append(b"data: 0\n\n")
    await settle(writer)
    changes = 10
    events = [b"data: %d\n\n" % n for n in range(1, changes + 1)]
    # Clients that read the next ten events from the owner, and some that read further.
    target = generation.size + len(b"".join(events))
    beyond = target + 1000
    mw = DisconnectMiddleware(sse_app(Probe()), backend=reader, principal=as_tester)
    path = f"/generations/{generation.id}/stream"
    loop = asyncio.get_running_loop()
    statements.ran.clear()
    started = loop.time()
    waiting = [
        asyncio.ensure_future(drive(mw, path=path, query_string=b"offset=%d" % offset))
        for offset in [target] * 100 + [beyond] * 10
    ]
    async with asyncio.timeout(20):
        # Every request has read the generation's row twice (its owner, then its status).
        await wait_until(lambda: sum(map(is_lookup, statements.ran)) >= 2 * len(waiting))
        mark, read, window = statements.count, statements.reads, loop.time()
        # The owner stores nine events, one flush (one change, one NOTIFY) at a time, 50 ms
        # apart; none of them reaches what the readers wait for.
        for event in events[:-1]:
            generation.append(event)
            await settle(writer)
            await asyncio.sleep(0.05)
        assert not any(request.done() for request in waiting)
        # Its reads: the backend's own upkeep (a heartbeat, a sweep) writes, now and then.
        ran, intervals = statements.reads - read, (loop.time() - window) / POLL
        # The tenth reaches the target: the first hundred get their bytes, live.
        generation.append(events[-1])
        await settle(writer)
        # The rest wait out the bound, then are told what is stored.
        answered = await asyncio.gather(*waiting[100:])
        waited = loop.time() - started
        generation.append(b"data: the rest\n\n")
        generation.finish(Status.COMPLETE)
        await settle(writer)
        streamed = await asyncio.gather(*waiting[:100])
    # While 110 readers waited: a few statements per change and per poll interval (SQLite's
    # change poller) for all of them. A query per reader every 20 ms was 2,500 here.
    assert ran <= 4 * len(events) + intervals + 6, statements.ran[mark:]
    assert all(result.status == 200 for result in streamed)
    assert all(result.body == b"data: the rest\n\n" for result in streamed)
    assert all(result.status == 416 for result in answered)
    assert all(result.header("content-range") == f"bytes */{target}" for result in answered)
    assert _resume._OFFSET_WAIT <= waited < _resume._OFFSET_WAIT + 3


async def test_a_reader_past_the_stored_end_that_leaves_stops_waiting(
    counted: tuple[DurableBackend, DurableBackend], statements: Statements
) -> None:
    writer, reader = counted
    generation = Generation("gen_" + "V" * 24, principal=TESTER)
    writer.register(generation)
    generation.append(b"data: 0\n\n")
    await settle(writer)
    mw = DisconnectMiddleware(sse_app(Probe()), backend=reader, principal=as_tester)
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await drive(
        mw,
        path=f"/generations/{generation.id}/stream",
        query_string=b"offset=%d" % (generation.size + 10),
        disconnect_after_seconds=0.3,
    )
    assert result.disconnected
    assert result.status is None
    assert loop.time() - started < _resume._OFFSET_WAIT / 2
    # Its tail stopped with it: nothing asks the store about the generation any more (one
    # look may have been under way as it left), over more than a PostgreSQL poll interval.
    statements.ran.clear()
    await asyncio.sleep(1.5)
    assert len(statements.about(generation.id)) <= 1
    generation.finish(Status.COMPLETE)


async def test_a_reader_past_the_stored_end_of_a_generation_that_ends_short_is_416_then(
    counted: tuple[DurableBackend, DurableBackend],
) -> None:
    writer, reader = counted
    generation = Generation("gen_" + "U" * 24, principal=TESTER)
    writer.register(generation)
    generation.append(b"data: 0\n\n")
    await settle(writer)
    mw = DisconnectMiddleware(sse_app(Probe()), backend=reader, principal=as_tester)
    loop = asyncio.get_running_loop()
    started = loop.time()
    asked = asyncio.ensure_future(
        drive(
            mw,
            path=f"/generations/{generation.id}/stream",
            query_string=b"offset=%d" % (generation.size + 100),
        )
    )
    generation.append(b"data: last\n\n")
    generation.finish(Status.COMPLETE)
    await settle(writer)
    result = await asked
    assert loop.time() - started < _resume._OFFSET_WAIT / 2
    assert result.status == 416
    assert result.header("content-range") == f"bytes */{generation.size}"
