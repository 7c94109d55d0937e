"""Idempotency claims on PostgreSQL: through the middleware vs raw asyncpg, side by side.

Fresh keys at a fixed concurrency. The middleware path is a whole request (key parsed,
body fingerprinted, claim, a tiny app, the response stored); the raw path is the same two
statements issued directly with asyncpg: ``INSERT ... ON CONFLICT DO NOTHING RETURNING``
then the completing ``UPDATE``. Also counts database round trips per fresh request, in
total and before the app runs (the target is one).

    python -m benchmarks.claims [--requests 3000] [--concurrency 32] [--rounds 3]
        [--postgres postgresql://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import statistics
import time
from typing import Any

import asyncpg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_disconnect import IdempotencyMiddleware, connect
from asgi_disconnect.testing import drive

queries = 0
at_app_start: list[int] = []


def count(record: Any) -> None:
    global queries
    queries += 1


async def counting_setup(conn: asyncpg.Connection) -> None:
    conn.add_query_logger(count)


async def skip_reset(conn: asyncpg.Connection) -> None:
    if conn.is_in_transaction():
        await conn.execute("rollback")


async def create(request: Request) -> JSONResponse:
    at_app_start.append(queries)
    return JSONResponse({"id": "ch_1", "amount": 1000}, status_code=201)


async def fresh_charge(mw: Any) -> None:
    """One POST under a new Idempotency-Key: the claim is always won."""
    result = await drive(
        mw,
        method="POST",
        path="/charges",
        body=b'{"amount":1000}',
        headers=[("authorization", "Bearer bench"), ("idempotency-key", secrets.token_hex(12))],
    )
    assert result.status == 201, result.body


async def through_middleware(mw: Any, n: int, concurrency: int) -> float:
    semaphore = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with semaphore:
            await fresh_charge(mw)

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - started)


async def raw(pool: asyncpg.Pool, table: str, n: int, concurrency: int) -> float:
    semaphore = asyncio.Semaphore(concurrency)

    async def one() -> None:
        key = secrets.token_hex(12)
        async with semaphore:
            owner = await pool.fetchval(
                f"insert into {table} (principal, key, owner, status, expires_at) "
                "values ('bench', $1, $2, 'running', now() + interval '1 day') "
                "on conflict do nothing returning owner",
                key,
                "o" + key,
            )
            assert owner is not None
            await pool.execute(
                f"update {table} set status = 'completed', response = $3 "
                "where principal = 'bench' and key = $1 and owner = $2",
                key,
                "o" + key,
                b"r",
            )

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - started)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
    schema = "bench_" + secrets.token_hex(4)
    pool = await asyncpg.create_pool(
        args.postgres, min_size=4, max_size=4, reset=skip_reset, setup=counting_setup
    )
    backend = connect("postgresql://", pool=pool, schema=schema)
    await backend.open()
    table = f'"{schema}".bench_raw'
    await pool.execute(
        f"create table {table} (principal text, key text, owner text, "
        "status text, expires_at timestamptz, response bytea, "
        "primary key (principal, key))"
    )
    mw = IdempotencyMiddleware(
        Starlette(routes=[Route("/charges", create, methods=["POST"])]), backend=backend
    )
    try:
        # Round trips, one request at a time so that the counts are exact.
        global queries
        before_app, total = [], []
        for _ in range(100):
            start = queries
            await fresh_charge(mw)
            before_app.append(at_app_start[-1] - start)
            total.append(queries - start)
        rates: dict[str, list[float]] = {"middleware": [], "raw asyncpg": []}
        for _ in range(args.rounds):
            rates["middleware"].append(
                await through_middleware(mw, args.requests, args.concurrency)
            )
            rates["raw asyncpg"].append(await raw(pool, table, args.requests, args.concurrency))
    finally:
        await backend.aclose()
        await pool.execute(f'drop schema if exists "{schema}" cascade')
        await pool.close()
    print(
        f"fresh claims on PostgreSQL, concurrency {args.concurrency}, "
        f"{args.requests} requests x {args.rounds} rounds (median):"
    )
    middleware = statistics.median(rates["middleware"])
    baseline = statistics.median(rates["raw asyncpg"])
    print(f"  through IdempotencyMiddleware  {middleware:9,.0f} claim+complete/s")
    print(f"  raw asyncpg, same statements   {baseline:9,.0f} claim+complete/s")
    print(f"  ratio {middleware / baseline:.2f}")
    print(
        f"  database round trips per fresh request: {statistics.median(before_app):.0f} "
        f"before the app runs, {statistics.median(total):.0f} in all"
    )


if __name__ == "__main__":
    asyncio.run(main())
