"""What the hot path's asyncio primitives cost beside anyio's, in instructions per use.

Supporting anyio's trio backend would mean anyio's portable primitives where the middleware
now uses asyncio's own: a future per wake-up, a task per writer, ``asyncio.timeout`` for a
bounded send. Each variant runs alone under callgrind (one process per variant, anyio on its
asyncio backend), minus an empty loop of the same length:

    python -m benchmarks.primitives [--uses 50000]

Needs valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys

VARIANTS = {
    "wake-up: asyncio future": "asyncio-future",
    "wake-up: anyio.Event": "anyio-event",
    "task: loop.create_task": "asyncio-task",
    "task: anyio task group": "anyio-taskgroup",
    "deadline: asyncio.timeout": "asyncio-timeout",
    "deadline: anyio.fail_after": "anyio-cancelscope",
}


async def _run(variant: str, uses: int) -> None:
    import anyio

    loop = asyncio.get_running_loop()

    async def noop() -> None:
        pass

    for _ in range(uses):
        if variant == "asyncio-future":
            future = loop.create_future()
            future.set_result(None)
            await future
        elif variant == "anyio-event":
            event = anyio.Event()
            event.set()
            await event.wait()
        elif variant == "asyncio-task":
            await loop.create_task(noop())
        elif variant == "anyio-taskgroup":
            async with anyio.create_task_group() as group:
                group.start_soon(noop)
        elif variant == "asyncio-timeout":
            async with asyncio.timeout(30):
                await noop()
        elif variant == "anyio-cancelscope":
            with anyio.fail_after(30):
                await noop()


def _instructions(variant: str, uses: int) -> int:
    out = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "benchmarks.primitives",
            "--run",
            variant,
            "--uses",
            str(uses),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise RuntimeError(out.stderr[-2000:])
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--uses", type=int, default=50_000)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        asyncio.run(_run(args.run, args.uses))
        return
    if not shutil.which("valgrind"):
        raise SystemExit("needs valgrind (apt-get install valgrind)")
    empty = _instructions("none", args.uses)
    print(f"instructions per use, {args.uses:,} uses each, anyio on asyncio")
    for label, variant in VARIANTS.items():
        per_use = (_instructions(variant, args.uses) - empty) / args.uses
        print(f"{label:28} {per_use:10,.0f}")


if __name__ == "__main__":
    main()
