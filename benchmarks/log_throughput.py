"""Generation-log throughput: 200 concurrent detached generations of 1,000 chunks each.

The same Starlette app behind DisconnectMiddleware, with the memory, SQLite and PostgreSQL
backends, side by side in one process, in alternating rounds. Each client disconnects
after its first bytes, so every generation is detached; a round ends when every
generation is complete *and* durable. Prints chunks/s and each ratio to memory.

    python -m benchmarks.log_throughput [--rounds 3] [--generations 200] [--chunks 1000]
        [--postgres postgresql://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, connect, disconnect_policy
from asgi_disconnect._backends import Backend, DurableBackend
from asgi_disconnect.testing import drive, lifespan

CHUNK = b'data: {"choices":[{"delta":{"content":"token"}}]}\n\n'


def make_app(chunks: int) -> Starlette:
    @disconnect_policy("detach")
    async def generate(request: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for _ in range(chunks):
                yield CHUNK
                await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/", generate)])


async def one_round(backend: Backend, generations: int, chunks: int) -> float:
    mw = DisconnectMiddleware(make_app(chunks), backend=backend)
    async with lifespan(mw):
        started = time.perf_counter()
        await asyncio.gather(
            *(drive(mw, disconnect_after_bytes=1, timeout=600) for _ in range(generations))
        )
        while len(mw.supervisor):
            await asyncio.sleep(0.005)
        if isinstance(backend, DurableBackend):
            while backend.pending_bytes() or len(backend._pending):
                await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - started
    assert mw.counters.detach_completed == generations, mw.counters.as_dict()
    return generations * chunks / elapsed


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--generations", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args()
    logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
    schema = "bench_" + secrets.token_hex(4)
    results: dict[str, list[float]] = {"memory": [], "sqlite": [], "postgres": []}
    try:
        await (await asyncpg.connect(args.postgres, timeout=5)).close()
    except Exception as exc:
        print(f"PostgreSQL at {args.postgres} unreachable ({exc}); skipping it")
        del results["postgres"]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for round_ in range(args.rounds):
                for name in results:
                    if name == "memory":
                        url = "memory://"
                    elif name == "sqlite":
                        url = f"sqlite:///{Path(tmp) / f'round{round_}.db'}"
                    else:
                        url = f"{args.postgres}?schema={schema}"
                    rate = await one_round(connect(url), args.generations, args.chunks)
                    results[name].append(rate)
        finally:
            if "postgres" in results:
                conn = await asyncpg.connect(args.postgres)
                await conn.execute(f'drop schema if exists "{schema}" cascade')
                await conn.close()
    print(
        f"{args.generations} concurrent detached generations x {args.chunks} chunks "
        f"({len(CHUNK)} B), {args.rounds} rounds, median chunks/s:"
    )
    memory = statistics.median(results["memory"])
    for name, rates in results.items():
        rate = statistics.median(rates)
        print(f"  {name:9} {rate:12,.0f} chunks/s   ratio to memory {rate / memory:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
