"""What handing a send to the task that finishes it costs on asyncio's public API, in CPU
instructions (``valgrind --tool=callgrind``), for the Python that runs this:

- a task switch: the producer wakes another task through a future, as the client writer's
  task is woken on Python 3.11;
- an eager task (Python 3.12+): ``asyncio.Task(coro, eager_start=True)`` for a send that
  finishes at once, over stepping the same coroutine by hand.

Each figure is the difference of two runs (1,000 and 11,000 iterations) over 10,000, so the
interpreter's start-up cancels out.

    python -m benchmarks.scheduling

Needs valgrind (``apt-get install valgrind``).
"""

from __future__ import annotations

import asyncio
import contextvars
import re
import subprocess
import sys

SMALL, LARGE = 1_000, 11_000


async def _switch(iterations: int, wake: bool) -> None:
    loop = asyncio.get_running_loop()
    box: dict[str, asyncio.Future[None] | None] = {"waiter": None}

    async def writer() -> None:
        while True:
            waiter = box["waiter"] = loop.create_future()
            await waiter

    task = loop.create_task(writer())
    await asyncio.sleep(0)
    for _ in range(iterations):
        waiter = box["waiter"]
        if wake and waiter is not None and not waiter.done():
            box["waiter"] = None
            waiter.set_result(None)
        await asyncio.sleep(0)
    task.cancel()


async def _send(message: object) -> None:
    return None


async def _eager(iterations: int, eager: bool) -> None:
    loop = asyncio.get_running_loop()
    context = contextvars.copy_context()
    message: dict[str, object] = {}
    for _ in range(iterations):
        coro = _send(message)
        if eager:
            task = asyncio.Task(coro, loop=loop, context=context, eager_start=True)  # type: ignore[call-arg]
            if not task.done() or task.exception() is not None:
                raise RuntimeError("the send did not finish in its first step")
        else:
            try:  # noqa: SIM105 (as the core steps a send: no context manager per send)
                coro.send(None)
            except StopIteration:
                pass


def _run(case: str, iterations: int, on: bool) -> None:
    main = _switch if case == "switch" else _eager
    asyncio.run(main(iterations, on))


def _instructions(case: str, iterations: int, on: bool) -> int:
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "benchmarks.scheduling",
            "--run",
            case,
            str(iterations),
            "1" if on else "0",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    assert found is not None, done.stderr
    return int(found.group(1))


def _per_iteration(case: str, on: bool) -> int:
    return (_instructions(case, LARGE, on) - _instructions(case, SMALL, on)) // (LARGE - SMALL)


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--run":
        _run(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1")
        return
    version = ".".join(map(str, sys.version_info[:2]))
    base = _per_iteration("switch", False)
    switched = _per_iteration("switch", True)
    print(f"Python {version}, instructions per iteration")
    print(f"  a loop iteration           {base:>8,}")
    print(f"  with a task switch         {switched:>8,}  (the switch: +{switched - base:,})")
    if sys.version_info >= (3, 12):
        stepped = _per_iteration("eager", False)
        eager = _per_iteration("eager", True)
        print(f"  a send stepped by hand     {stepped:>8,}")
        print(f"  the same in an eager task  {eager:>8,}  (the task: +{eager - stepped:,})")


if __name__ == "__main__":
    main()
