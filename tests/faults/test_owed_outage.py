"""PostgreSQL stops while a usage record is owed: the *record owed* mark on a generation's
row outlives the restart, and the record is stored once, whoever writes it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import asyncpg
import msgspec
import pytest
from starlette.applications import Starlette

from asgi_disconnect import DisconnectMiddleware, UsageRecord, connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._log import Generation, Status
from asgi_disconnect.testing._driver import lifespan
from tests.faults.cluster import Cluster
from tests.unit.test_backends import usage_record
from tests.unit.test_takeover import GID, _died_owing_a_record

pytestmark = [pytest.mark.anyio, pytest.mark.server]

# The sweepers' own lease: a mark one of them claimed lapses this long after its last renewal.
LEASE = 1.0


def sweeper(
    url: str, *sinks: Callable[[UsageRecord], object], lease: float = LEASE
) -> DisconnectMiddleware:
    """A replica that sweeps every 0.1 s; what its sweeps write goes to ``sinks`` and to its
    own store."""
    backend = connect(url, flush_interval=0.05, lease=lease, sweep_interval=0.1)
    assert isinstance(backend, DurableBackend)
    return DisconnectMiddleware(
        Starlette(), backend=backend, takeover_sinks=[*sinks, backend.record_usage]
    )


def backend_of(app: DisconnectMiddleware) -> DurableBackend:
    backend = app.backend
    assert isinstance(backend, DurableBackend)
    return backend


async def query(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    """``sql`` with ``{t}`` for the test's own schema, on a connection of its own."""
    parts = urlsplit(url)
    schema = parse_qs(parts.query)["schema"][0]
    conn = await asyncpg.connect(parts._replace(query="").geturl(), timeout=5)
    try:
        return list(await conn.fetch(sql.format(t=f'"{schema}".asgi_disconnect_'), *args))
    finally:
        await conn.close()


async def mark(url: str) -> asyncpg.Record:
    """The generation's row: its status, owner and mark, and whether its lease runs."""
    (row,) = await query(
        url,
        "select status, owner, record_owed, lease_until, lease_until > now() as leased "
        "from {t}generations where id = $1",
        GID,
    )
    return row


async def stored(url: str) -> list[UsageRecord]:
    """The usage records in the table, read past every backend."""
    rows = await query(url, "select record::text from {t}usage where generation_id = $1", GID)
    return [msgspec.json.decode(row[0], type=UsageRecord) for row in rows]


async def until(check: Callable[[], Awaitable[bool]], seconds: float, what: str) -> None:
    """Poll ``check`` for at most ``seconds`` (a read refused as the server starts counts as
    not yet)."""
    try:
        async with asyncio.timeout(seconds):
            while True:
                try:
                    if await check():
                        return
                except (OSError, asyncpg.CannotConnectNowError):
                    pass
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {seconds} s: {what}") from None


async def paid(url: str) -> bool:
    """One record stored and the mark cleared; read in one statement, so each poll also
    shows that the mark is never cleared without its record, nor a second record stored."""
    ((owed, records),) = await query(
        url,
        "select g.record_owed, (select count(*) from {t}usage u where u.generation_id = g.id) "
        "from {t}generations g where g.id = $1",
        GID,
    )
    assert owed or records == 1, "the mark was cleared without its record"
    assert records <= 1, f"{records} records stored"
    return not owed and records == 1


def assert_the_estimate(record: UsageRecord, text: str) -> None:
    """The record a sweep writes for a generation that ended whole, its owner dead."""
    assert record.generation_id == GID
    assert record.outcome == "complete"
    assert record.error_type == "owner_lost"
    assert record.principal == "alice"
    assert record.usage_source == "estimated"
    assert record.output_tokens == round(len(text) / 4)
    assert record.attempt == 1
    assert record.usage_note is not None
    assert "reached the client is unknown" in record.usage_note


async def assert_cleared(url: str) -> None:
    row = await mark(url)
    assert row["status"] == "complete"
    assert row["record_owed"] is False
    assert row["lease_until"] is None


async def test_a_mark_whose_lease_lapses_while_the_database_is_down_is_paid_once_after(
    cluster: Cluster, fault_url: str
) -> None:
    """The owner died owing the record of an answer that ended whole; the database stops
    while two replicas sweep, before the mark's lease lapsed, and stays down past it. Once
    it is back, one of them writes the record: estimated, the generation's own ending,
    stored once; the row's mark is cleared and later sweeps write nothing more."""
    text = await _died_owing_a_record(fault_url, paid=False, lease=3.0)
    records: list[UsageRecord] = []
    a, b = sweeper(fault_url, records.append), sweeper(fault_url, records.append)
    async with lifespan(a), lifespan(b):
        before = await mark(fault_url)
        assert before["record_owed"]
        assert before["leased"]  # nobody could take it yet
        await asyncio.to_thread(cluster.stop)
        # The mark lapses while nothing can be read or written.
        await asyncio.sleep(max(0.0, before["lease_until"].timestamp() - time.time()) + 0.5)
        assert records == []
        await asyncio.to_thread(cluster.start)
        await until(lambda: paid(fault_url), 20, "the record stored and the mark cleared")
        await asyncio.sleep(1.0)  # ten more sweeps each: none writes it again
        rows = await stored(fault_url)
    (record,) = records
    assert rows == [record]
    assert_the_estimate(record, text)
    await assert_cleared(fault_url)


@pytest.mark.parametrize("outage", [0.3, LEASE + 0.5], ids=["shorter", "longer"])
async def test_a_sweeper_that_could_not_read_what_it_claimed_leaves_the_mark_to_a_later_sweep(
    cluster: Cluster, fault_url: str, outage: float
) -> None:
    """The database stops the moment a sweeper's claim of the owed mark returns, for less
    than the sweeper's lease or for longer: it cannot read the generation to make the
    record. Once the database is back the mark is still on the row, and a later sweep (this
    replica's or another's) writes the record, once; a claim whose record was never made
    does not hold the mark for as long as its sweeper lives."""
    text = await _died_owing_a_record(fault_url, paid=False)
    records: list[UsageRecord] = []
    a = sweeper(fault_url, records.append)
    store = backend_of(a).store
    claim_owed = store.claim_owed
    claimed: list[str] = []

    async def claim_then_stop(*args: Any) -> list[str]:
        ids = await claim_owed(*args)
        if ids and not claimed:
            claimed.extend(ids)
            await asyncio.to_thread(cluster.stop)
        return ids

    store.claim_owed = claim_then_stop  # type: ignore[method-assign]

    async def has_claimed() -> bool:
        return bool(claimed)

    async with lifespan(a):
        await until(has_claimed, 10, "the sweeper claimed the mark")
        assert claimed == [GID]
        await asyncio.sleep(outage)
        await asyncio.to_thread(cluster.start)
        row = await mark(fault_url)
        assert row["record_owed"] is True  # not lost
        assert await stored(fault_url) == []
        async with lifespan(sweeper(fault_url, records.append)):
            await until(lambda: paid(fault_url), 10 * LEASE, "the record stored, mark cleared")
            await asyncio.sleep(1.0)  # more sweeps: none writes it again
            rows = await stored(fault_url)
    (record,) = records
    assert rows == [record]
    assert_the_estimate(record, text)
    await assert_cleared(fault_url)


@pytest.mark.parametrize(
    ("lease", "outage"), [(3.0, 0.3), (LEASE, LEASE + 0.5)], ids=["shorter", "longer"]
)
async def test_a_sweeper_whose_flush_of_the_record_failed_leaves_the_mark_until_it_is_stored(
    cluster: Cluster, fault_url: str, lease: float, outage: float
) -> None:
    """Two replicas sweep; the database stops as the one that claimed the mark hands the
    record to its sinks, so the flush that would store it and clear the mark fails. Once
    the database is back the record is stored once and the mark cleared, never the one
    without the other: by the sweeper's own retried flush when the outage
    was shorter than its hold of the mark (its sinks saw it once), or by whichever replica
    is first after a longer one (a second sweep may hand the same record to its sinks
    again; the store keeps one)."""
    text = await _died_owing_a_record(fault_url, paid=False)
    seen: dict[str, list[UsageRecord]] = {"a": [], "b": []}
    stopped: list[str] = []

    def stop_at_the_first(name: str) -> Callable[[UsageRecord], None]:
        def sink(record: UsageRecord) -> None:
            seen[name].append(record)
            if not stopped:
                stopped.append(name)
                # Blocks the loop until the server is down: the sweep's flush, which
                # carries the record and clears the mark, comes after it.
                cluster.stop()

        return sink

    a = sweeper(fault_url, stop_at_the_first("a"), lease=lease)
    b = sweeper(fault_url, stop_at_the_first("b"), lease=lease)

    async def has_stopped() -> bool:
        return bool(stopped)

    async with lifespan(a), lifespan(b):
        await until(has_stopped, 10, "a sweeper handed the record to its sinks")
        await asyncio.sleep(outage)
        assert not cluster.running()
        await asyncio.to_thread(cluster.start)
        await until(lambda: paid(fault_url), 10 * LEASE, "the record stored, mark cleared")
        await asyncio.sleep(1.0)  # more sweeps: none writes it again
        rows = await stored(fault_url)
    (record,) = rows
    assert_the_estimate(record, text)
    await assert_cleared(fault_url)
    (first,) = stopped
    assert seen[first] == [record]
    if outage < lease:
        assert seen[{"a": "b", "b": "a"}[first]] == []
    else:
        assert seen["a"] in ([], [record])
        assert seen["b"] in ([], [record])


@pytest.mark.parametrize(
    ("replicas", "lease", "outage"),
    [(1, 3.0, 0.3), (1, LEASE, LEASE + 0.5), (2, 3.0, 0.3)],
    ids=["alone-shorter", "alone-longer", "with-a-sweeper-shorter"],
)
async def test_a_live_owner_writes_the_record_it_owed_once_the_database_is_back(
    cluster: Cluster, fault_url: str, replicas: int, lease: float, outage: float
) -> None:
    """The owner is alive: its generation ended whole and is stored with the mark, its
    record waiting on its client's TCP. The database stops, for less than the owner's lease
    or for longer; the record is made while it is down (metering clears the mark and hands
    the record to the store). Once the database is back the owner's flush stores that
    record, the provider's, once, and clears the mark; its own sweeps, and another
    replica's while the mark's lease runs, write nothing."""
    owner = connect(fault_url, flush_interval=0.05, lease=lease, sweep_interval=0.1)
    assert isinstance(owner, DurableBackend)
    others: list[UsageRecord] = []
    async with owner, contextlib.AsyncExitStack() as stack:
        for _ in range(replicas - 1):
            await stack.enter_async_context(lifespan(sweeper(fault_url, others.append)))
        generation = Generation(GID, principal="alice", content_type="text/event-stream")
        generation.record_owed = True
        owner.register(generation)
        generation.append(b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
        generation.append(b"data: [DONE]\n\n")
        generation.finish(Status.COMPLETE)

        async def marked() -> bool:
            rows = await query(
                fault_url, "select 1 from {t}generations where id = $1 and record_owed", GID
            )
            return bool(rows)

        await until(marked, 10, "the generation stored ended, its record owed")
        row = await mark(fault_url)
        assert row["status"] == "complete"
        assert row["owner"] == owner.owner
        assert row["leased"]
        await asyncio.to_thread(cluster.stop)
        generation.record_owed = False  # as metering settles it, with the record
        record = msgspec.structs.replace(usage_record(GID), usage_source="provider")
        owner.record_usage(record)
        await asyncio.sleep(outage)
        await asyncio.to_thread(cluster.start)
        await until(lambda: paid(fault_url), 10 * LEASE, "the record stored, mark cleared")
        await asyncio.sleep(1.0)  # more sweeps and flushes: nothing is written again
        rows = await stored(fault_url)
        assert await owner.usage_of(GID) == [record]
    assert rows == [record]
    assert others == []
    await assert_cleared(fault_url)
