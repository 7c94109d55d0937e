"""What writing live generations durably costs in CPU, per generation, on each backend.

N generations (``--generations``, default 100) each append a chunk of 230 bytes every 48 ms
(a 10 s stream of 208 chunks, the shape `benchmarks.load` relays) for ``--steps`` steps,
their client keeping up; the backend flushes every ``--flush-interval`` seconds. Printed:
the process's CPU time (every thread: SQLite writes in one of its own) per generation, for
each backend side by side. The memory backend writes nothing: its figure is the producers'
own cost, to subtract.

    python -m benchmarks.flush_cost
    python -m benchmarks.flush_cost --flush-interval 0.2 --backend sqlite postgres
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from asgi_disconnect import Status, connect
from asgi_disconnect._log import Generation
from benchmarks.load import _drop_schema

PG_DSN = os.environ.get("ASGI_DISCONNECT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
CHUNK = b"data: " + b"x" * 222 + b"\n\n"


class Client:
    delivered_bytes = 0


async def measure(url: str, args: argparse.Namespace) -> float:
    options: dict[str, Any] = {}
    if not url.startswith("memory:"):
        options["flush_interval"] = args.flush_interval
    backend = connect(url, **options)
    await backend.open()
    try:
        generations = []
        for n in range(args.generations):
            generation = Generation(f"gen_{n:024d}", principal="bench")
            client = Client()
            generation.reader = client
            backend.register(generation)
            generations.append((generation, client))
        started = time.process_time()
        for _ in range(args.steps):
            for generation, client in generations:
                generation.append(CHUNK)
                client.delivered_bytes = generation.size
            await asyncio.sleep(0.048)
        for generation, _ in generations:
            generation.finish(Status.COMPLETE)
        await asyncio.sleep(max(0.2, 2 * args.flush_interval))
        return (time.process_time() - started) / args.generations
    finally:
        await backend.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--generations", type=int, default=100)
    parser.add_argument("--steps", type=int, default=100, help="chunks per generation")
    parser.add_argument("--flush-interval", type=float, default=0.05)
    parser.add_argument(
        "--backend", nargs="+", default=["memory", "sqlite", "postgres"], help="which to run"
    )
    parser.add_argument("--pg-dsn", default=PG_DSN)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="asgi-disconnect-flush-"))
    schema = "flush_" + secrets.token_hex(4)
    urls = {
        "memory": "memory://",
        "sqlite": f"sqlite:///{workdir / 'generations.db'}",
        "postgres": f"{args.pg_dsn}?schema={schema}",
    }
    try:
        print(
            f"{args.generations} generations, a {len(CHUNK)}-byte chunk every 48 ms for "
            f"{args.steps} steps, flush_interval {args.flush_interval} s"
        )
        for name in args.backend:
            cpu = asyncio.run(measure(urls[name], args))
            print(f"{name:9} {cpu * 1000:6.2f} ms CPU per generation")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if "postgres" in args.backend:
            asyncio.run(_drop_schema(args.pg_dsn, schema))


if __name__ == "__main__":
    main()
