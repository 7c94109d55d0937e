"""The stack's overhead in throughput: a bare Starlette app beside the same app wrapped.

The apps asked for (``--apps``, from ``benchmarks.apps.APPS``: by default bare,
DisconnectMiddleware alone and ``install()``; add ``correlation-id``, ``otel`` and ``otel-
request-span`` for the peers) run side by side (one uvicorn process each, one worker); the
load alternates between them in rounds so that machine noise hits all alike. Prints
requests/s on a small JSON route, streams/s and chunks/s on a 1,000-chunk SSE route (its
generator never yields, so the client writer coalesces what waits), and on a paced one (a
trip through the event loop per chunk, as a relay reading an upstream does), and the ratios.

The load comes from wrk when it is installed (apt-get install wrk), else from a small
asyncio client, which is slower than the server and so flattens the ratios.

    python -m benchmarks.overhead [--rounds 5] [--seconds 3] [--connections 8] [--apps ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import statistics
import subprocess
from collections.abc import Iterator

from benchmarks._load import run_load
from benchmarks._uvicorn import HOST, ROOT, free_port, uvicorn_command, wait_until_listening
from benchmarks.apps import SSE_EVENTS

ROUTES = ("/json", "/sse", "/sse-paced")


# With two cores or more, the servers share one core and the load generator has another:
# no migrations, and neither server competes with the load for its core.
PINNED = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2
SERVER_CPU, LOAD_CPU = sorted(os.sched_getaffinity(0))[:2] if PINNED else (None, None)


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def serve(app: str, factory: bool = False) -> Iterator[tuple[int, int]]:
    port = free_port()
    proc = subprocess.Popen(
        uvicorn_command(app, port, factory=factory),
        cwd=ROOT,
        # wrk hangs up on streams still in flight at the end of each run: keep that quiet.
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: _pin(SERVER_CPU),
    )
    try:
        wait_until_listening(port, 10, app)
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.wait(10)


def wrk(port: int, route: str, connections: int, seconds: float) -> float:
    """Requests per second measured by wrk."""
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{max(1, round(seconds))}s",
            f"http://{HOST}:{port}{route}",
        ],
        check=True,
        capture_output=True,
        text=True,
        preexec_fn=lambda: _pin(LOAD_CPU),
    ).stdout
    match = re.search(r"Requests/sec:\s+([\d.]+)", out)
    assert match is not None, out
    return float(match.group(1))


def measure(port: int, route: str, connections: int, seconds: float) -> float:
    if shutil.which("wrk"):
        return wrk(port, route, connections, seconds)
    done, _ = asyncio.run(run_load(HOST, port, route, connections=connections, duration=seconds))
    return done / seconds


def main() -> None:
    from benchmarks.apps import APPS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument(
        "--apps", nargs="+", choices=list(APPS), default=["bare", "disconnect", "install"]
    )
    args = parser.parse_args()
    names = ["bare", *(name for name in args.apps if name != "bare")]
    results: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(serve(*APPS[name])) for name in names}
        for port, _ in servers.values():  # warm-up
            for route in ROUTES:
                measure(port, route, 4, 0.5)
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else list(reversed(names))
            for route in ROUTES:
                for name in order:
                    port, pid = servers[name]
                    before = cpu_seconds(pid)
                    rate = measure(port, route, args.connections, args.seconds)
                    used = cpu_seconds(pid) - before
                    results.setdefault((name, route), []).append(rate)
                    # Server CPU per request: steadier than throughput on a noisy machine.
                    cpu.setdefault((name, route), []).append(used / (rate * args.seconds))
    print(
        f"uvicorn (h11, asyncio), {args.rounds} rounds x {args.seconds}s, "
        f"{args.connections} connections, load from {'wrk' if shutil.which('wrk') else 'asyncio'}"
        f"{f'; servers on CPU {SERVER_CPU}, load on CPU {LOAD_CPU}' if PINNED else ''}; "
        "median per round"
    )
    for route, unit in (
        ("/json", "requests/s"),
        ("/sse", "streams/s"),
        ("/sse-paced", "streams/s"),
    ):
        bare = statistics.median(results[("bare", route)])
        bare_cpu = statistics.median(cpu[("bare", route)]) * 1e6
        per = "request" if route == "/json" else "stream"
        for name in names:
            rate = statistics.median(results[(name, route)])
            used = statistics.median(cpu[(name, route)]) * 1e6
            chunks = f"  ({rate * SSE_EVENTS:,.0f} chunks/s)" if route != "/json" else ""
            print(
                f"{route:10} {name:18} {rate:9.1f} {unit}, ratio {rate / bare:.3f}{chunks}; "
                f"server CPU per {per} {used:,.0f} us, as a ratio {bare_cpu / used:.3f}"
            )


if __name__ == "__main__":
    main()
