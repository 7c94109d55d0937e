"""PostgreSQL stops while a usage record is owed: the *record owed* mark on a generation's
row outlives the restart, and the record is stored once, whoever writes it."""

from __future__ import annotations

import asyncio
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
from asgi_disconnect.testing._driver import lifespan
from tests.faults.cluster import Cluster
from tests.unit.test_takeover import GID, _died_owing_a_record

pytestmark = [pytest.mark.anyio, pytest.mark.server]

# The sweepers' own lease: a mark one of them claimed lapses this long after its last renewal.
LEASE = 1.0


def sweeper(url: str, *sinks: Callable[[UsageRecord], object]) -> DisconnectMiddleware:
    """A replica that sweeps every 0.1 s; what its sweeps write goes to ``sinks`` and to its
    own store."""
    backend = connect(url, flush_interval=0.05, lease=LEASE, sweep_interval=0.1)
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
    """Poll ``check`` (a failed read counts as not yet) for at most ``seconds``."""
    try:
        async with asyncio.timeout(seconds):
            while True:
                try:
                    if await check():
                        return
                except (OSError, asyncpg.PostgresError):
                    pass
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {seconds} s: {what}") from None


async def paid(url: str) -> bool:
    """One record stored and the mark cleared."""
    row = await mark(url)
    return not row["record_owed"] and len(await stored(url)) == 1


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
