"""Live tails on a SQLite replica that does not own the generations: CPU and queries.

A writer process produces ``--generations`` generations on one SQLite database, an event
every ``--every`` seconds each, for ``--seconds``. This process opens the same database as
another replica would and follows them with ``--tails`` readers spread over the
generations, through ``backend.follow()`` as ``GET /generations/{id}/stream`` does. It
prints its own CPU time over the writer's run (every thread, as a share of one core) and
the SQL statements its connection ran per second (sqlite3's trace callback), and checks
that every reader got every byte.

    python -m benchmarks.tails [--tails 300] [--generations 1] [--seconds 5] [--every 0.02]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asgi_disconnect import connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._log import Generation, Status

EVENT = b'data: {"choices":[{"delta":{"content":"token"}}]}\n\n'


def generation_id(number: int) -> str:
    return f"gen_{number:024d}"


async def write(url: str, generations: int, seconds: float, every: float) -> None:
    backend = connect(url)
    await backend.open()
    try:
        made = [Generation(generation_id(n), principal="") for n in range(generations)]
        for generation in made:
            backend.register(generation)
        print("writing", flush=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for generation in made:
                generation.append(EVENT)
            await asyncio.sleep(every)
        for generation in made:
            generation.finish(Status.COMPLETE)
    finally:
        await backend.aclose()


async def read(args: argparse.Namespace, url: str) -> tuple[float, float, int]:
    statements = 0

    def count(_: str) -> None:
        nonlocal statements
        statements += 1

    backend = connect(url, init=lambda db: db.set_trace_callback(count))
    assert isinstance(backend, DurableBackend)
    await backend.open()
    try:
        ids = [generation_id(n) for n in range(args.generations)]
        async with asyncio.timeout(30):
            while any([await backend.get(gid) is None for gid in ids]):
                await asyncio.sleep(0.01)

        got = [0] * args.tails

        async def tail(n: int, gid: str) -> int:
            async for data in backend.follow(gid, 0):
                got[n] += len(data)
            return got[n]

        cpu, wall, before = time.process_time(), time.monotonic(), statements
        readers = [asyncio.ensure_future(tail(n, ids[n % len(ids)])) for n in range(args.tails)]
        _, pending = await asyncio.wait(readers, timeout=args.seconds + 30)
        if pending:
            stuck = sorted({ids[n % len(ids)] for n, r in enumerate(readers) if r in pending})
            raise TimeoutError(
                f"{len(pending)} readers never ended, of {stuck[:3]}...: stored as "
                f"{[await backend.get(gid) for gid in stuck[:3]]}, "
                f"{[got[n] for n, r in enumerate(readers) if r in pending][:3]} bytes read"
            )
        sizes = [reader.result() for reader in readers]
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        ran = statements - before
        final = {gid: (await backend.get(gid)) for gid in ids}
        for n, size in enumerate(sizes):
            info = final[ids[n % len(ids)]]
            assert info is not None
            assert info.status is Status.COMPLETE
            assert size == info.size, (size, info.size)
        return cpu / wall, ran / wall, sum(sizes)
    finally:
        await backend.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tails", type=int, default=300)
    parser.add_argument("--generations", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--every", type=float, default=0.02)
    parser.add_argument("--write", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        asyncio.run(write(args.write, args.generations, args.seconds, args.every))
        return
    logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'tails.db'}"
        writer = subprocess.Popen(
            [
                *(sys.executable, "-m", "benchmarks.tails", "--write", url),
                *("--generations", str(args.generations), "--seconds", str(args.seconds)),
                *("--every", str(args.every)),
            ],
            stdout=subprocess.PIPE,
        )
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline() == b"writing\n"
            share, rate, total = asyncio.run(read(args, url))
        finally:
            writer.wait(timeout=60)
    print(
        f"{args.tails} tails over {args.generations} generation(s) for {args.seconds:g} s "
        f"(an event every {args.every:g} s each): reader CPU {share:.0%} of a core, "
        f"{rate:,.0f} SQL statements/s, {total:,} bytes read, every reader complete"
    )


if __name__ == "__main__":
    main()
