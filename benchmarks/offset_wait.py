"""Readers past the stored end on a PostgreSQL replica that does not own the generation.

Replica A produces a running generation and flushes part of it; ``--readers`` clients ask
replica B (another backend on the same database) for an offset just past what is stored,
as a client that read unflushed bytes from A would, and wait until B answers 416 (nothing
more is stored meanwhile, so each waits the whole bound). Run in a database of its own,
made and dropped here, it prints the transactions the database committed meanwhile
(``pg_stat_database.xact_commit``) and the statements B's connections ran (asyncpg's
query logger).

    python -m benchmarks.offset_wait [--readers 100] [--dsn postgresql://postgres@127.0.0.1/test]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from asgi_disconnect import DisconnectMiddleware, connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._log import Generation, Status
from asgi_disconnect.testing import drive

PRINCIPAL = "bench"


async def no_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("only the resume endpoint is asked")


async def rollback(conn: asyncpg.Connection) -> None:
    if conn.is_in_transaction():
        await conn.execute("rollback")


async def committed(conn: asyncpg.Connection) -> int:
    await conn.execute("select pg_stat_clear_snapshot()")
    value = await conn.fetchval(
        "select xact_commit from pg_stat_database where datname = current_database()"
    )
    return int(value)


async def measure(dsn: str, readers: int) -> tuple[int, int, float, set[int]]:
    statements = 0

    def count(_: object) -> None:
        nonlocal statements
        statements += 1

    async def init(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(count)

    writer = connect(dsn, flush_interval=5.0, lease=30.0)  # flushed by hand below
    assert isinstance(writer, DurableBackend)
    # As the store's own pool: no reset query on release, which would count once per query.
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=4, init=init, reset=rollback)
    reader = connect("postgresql://", pool=pool)
    monitor = await asyncpg.connect(dsn)
    try:
        await writer.open()
        await reader.open()
        generation = Generation("gen_" + secrets.token_urlsafe(18), principal=PRINCIPAL)
        writer.register(generation)
        generation.append(b"data: stored\n\n")
        while await writer.flush():
            pass
        mw = DisconnectMiddleware(no_app, backend=reader, principal=lambda scope: PRINCIPAL)
        path = f"/generations/{generation.id}/stream"
        # As a client that read 40 more bytes from A, which A has yet to flush.
        offset = f"offset={generation.size + 40}".encode()
        before, ran = await committed(monitor), statements
        started = time.monotonic()
        answers = await asyncio.gather(
            *(drive(mw, path=path, query_string=offset, timeout=30) for _ in range(readers))
        )
        waited = time.monotonic() - started
        ran = statements - ran
        generation.finish(Status.COMPLETE)
    finally:
        await reader.aclose()
        await pool.close()
        await writer.aclose()
    # A server process publishes its counts when it exits at the latest.
    await asyncio.sleep(1.5)
    after = await committed(monitor)
    await monitor.close()
    return after - before, ran, waited, {answer.status or 0 for answer in answers}


async def run(dsn: str, readers: int) -> tuple[int, int, float, set[int]]:
    admin = await asyncpg.connect(dsn)
    database = "asgi_disconnect_bench_" + secrets.token_hex(4)
    await admin.execute(f'create database "{database}"')
    try:
        parts = urlsplit(dsn)
        return await measure(urlunsplit(parts._replace(path="/" + database)), readers)
    finally:
        await admin.execute(f'drop database "{database}" with (force)')
        await admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--readers", type=int, default=100)
    parser.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
    transactions, statements, waited, statuses = asyncio.run(run(args.dsn, args.readers))
    print(
        f"{args.readers} readers past the stored end, answered {sorted(statuses)} after "
        f"{waited:.1f} s: {transactions:,} transactions committed in the database, "
        f"{statements:,} statements run by the replica they asked"
    )


if __name__ == "__main__":
    main()
