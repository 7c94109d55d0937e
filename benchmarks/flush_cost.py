"""What writing live generations durably costs in CPU, with a fixed and an adaptive window.

N generations (``--generations``, default 10, 100 and 1,000, one run each) each append a
chunk of 230 bytes every 48 ms (a 10 s stream of 208 chunks, the shape `benchmarks.load`
relays) for ``--steps`` steps, their client keeping up. Each durable backend runs twice, in
one process run after the other on a fresh database: flushing every ``--flush-interval``
seconds whatever the load (``max_flush_interval`` equal to it), then with its default
adaptive window (``--max-flush-interval``, default four flush intervals). Printed: the
process's CPU time (every thread: SQLite writes in one of its own) per generation per 100
chunks, side by side, and the windows the adaptive flusher chose (sampled every step: the
median and the largest over the run's second half, once it settled). The memory backend
writes nothing: its figure is the producers' own cost, to subtract.

    python -m benchmarks.flush_cost
    python -m benchmarks.flush_cost --generations 1000 --backend sqlite postgres
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asgi_disconnect import DurableBackend, Status, connect
from asgi_disconnect._log import Generation
from benchmarks.load import _drop_schema

PG_DSN = os.environ.get("ASGI_DISCONNECT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
CHUNK = b"data: " + b"x" * 222 + b"\n\n"
STEP = 0.048


class Client:
    delivered_bytes = 0


@dataclass
class Run:
    cpu: float  # seconds per generation per 100 chunks
    windows: list[float] = field(default_factory=list)  # sampled every step

    def settled(self) -> str:
        late = self.windows[len(self.windows) // 2 :]
        if not late:
            return ""
        return f"{statistics.median(late) * 1000:.0f} ms (max {max(late) * 1000:.0f})"


async def measure(url: str, generations: int, steps: int, options: dict[str, Any]) -> Run:
    backend = connect(url, **options)
    await backend.open()
    durable = backend if isinstance(backend, DurableBackend) else None
    windows: list[float] = []
    try:
        live = []
        for n in range(generations):
            generation = Generation(f"gen_{n:024d}", principal="bench")
            client = Client()
            generation.reader = client
            backend.register(generation)
            live.append((generation, client))
        started = time.process_time()
        for _ in range(steps):
            for generation, client in live:
                generation.append(CHUNK)
                client.delivered_bytes = generation.size
            if durable is not None:
                windows.append(durable.flush_window)
            await asyncio.sleep(STEP)
        for generation, _ in live:
            generation.finish(Status.COMPLETE)
        settle = 0.2 if durable is None else 2 * durable.max_flush_interval
        await asyncio.sleep(max(0.2, settle))
        cpu = time.process_time() - started
        return Run(cpu / generations * 100 / steps, windows)
    finally:
        await backend.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--generations", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--steps", type=int, default=100, help="chunks per generation")
    parser.add_argument("--flush-interval", type=float, default=0.05)
    parser.add_argument(
        "--max-flush-interval", type=float, help="the adaptive window's ceiling (default 4x)"
    )
    parser.add_argument(
        "--backend", nargs="+", default=["memory", "sqlite", "postgres"], help="which to run"
    )
    parser.add_argument("--pg-dsn", default=PG_DSN)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="asgi-disconnect-flush-"))
    schemas: list[str] = []

    def fresh(name: str) -> str:
        if name == "memory":
            return "memory://"
        if name == "sqlite":
            return f"sqlite:///{workdir / secrets.token_hex(4)}.db"
        schemas.append("flush_" + secrets.token_hex(4))
        return f"{args.pg_dsn}?schema={schemas[-1]}"

    fixed = {"flush_interval": args.flush_interval, "max_flush_interval": args.flush_interval}
    adaptive: dict[str, Any] = {"flush_interval": args.flush_interval}
    if args.max_flush_interval is not None:
        adaptive["max_flush_interval"] = args.max_flush_interval
    try:
        print(
            f"a {len(CHUNK)}-byte chunk every {STEP * 1000:.0f} ms per generation for "
            f"{args.steps} steps; flush_interval {args.flush_interval} s"
        )
        print("CPU per generation per 100 chunks; the adaptive window once settled")
        print(f"{'generations':>11}  {'backend':9} {'fixed':>9} {'adaptive':>9}  window")
        for count in args.generations:
            for name in args.backend:
                if name == "memory":
                    run = asyncio.run(measure(fresh(name), count, args.steps, {}))
                    print(f"{count:>11}  {name:9} {run.cpu * 1000:6.2f} ms {'':>9}")
                    continue
                one = asyncio.run(measure(fresh(name), count, args.steps, fixed))
                other = asyncio.run(measure(fresh(name), count, args.steps, adaptive))
                print(
                    f"{count:>11}  {name:9} {one.cpu * 1000:6.2f} ms {other.cpu * 1000:6.2f} ms"
                    f"  {other.settled()}"
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        for schema in schemas:
            asyncio.run(_drop_schema(args.pg_dsn, schema))


if __name__ == "__main__":
    main()
