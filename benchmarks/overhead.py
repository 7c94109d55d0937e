"""DisconnectMiddleware's overhead: a bare Starlette app vs the same app wrapped, on uvicorn.

Both servers run side by side (one uvicorn process each, one worker); the load alternates
between them in rounds so that machine noise hits both alike. Prints requests/s on a small
JSON route, streams/s and chunks/s on a 1,000-chunk SSE route (its generator never yields,
so the client writer coalesces what waits), and on a paced one (a trip through the event
loop per chunk, as a relay reading an upstream does), and the ratios.

The load comes from wrk when it is installed (apt-get install wrk), else from a small
asyncio client, which is slower than the server and so flattens the ratios.

    python -m benchmarks.overhead [--rounds 5] [--seconds 3] [--connections 8]
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
def serve(app: str) -> Iterator[tuple[int, int]]:
    port = free_port()
    proc = subprocess.Popen(
        uvicorn_command(app, port),
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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    apps = {"bare": "benchmarks.apps:bare_app", "wrapped": "benchmarks.apps:wrapped_app"}
    results: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    with (
        serve(apps["bare"]) as (bare_port, bare_pid),
        serve(apps["wrapped"]) as (
            wrapped_port,
            wrapped_pid,
        ),
    ):
        ports = {"bare": bare_port, "wrapped": wrapped_port}
        pids = {"bare": bare_pid, "wrapped": wrapped_pid}
        for port in ports.values():  # warm-up
            for route in ROUTES:
                measure(port, route, 4, 0.5)
        for round_ in range(args.rounds):
            order = ["bare", "wrapped"] if round_ % 2 == 0 else ["wrapped", "bare"]
            for route in ROUTES:
                for name in order:
                    before = cpu_seconds(pids[name])
                    rate = measure(ports[name], route, args.connections, args.seconds)
                    used = cpu_seconds(pids[name]) - before
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
        wrapped = statistics.median(results[("wrapped", route)])
        extra = ""
        if route != "/json":
            extra = (
                f"  (chunks/s: bare {bare * SSE_EVENTS:,.0f}, wrapped {wrapped * SSE_EVENTS:,.0f})"
            )
        print(
            f"{route:10} {unit:11} bare {bare:9.1f}  wrapped {wrapped:9.1f}  "
            f"ratio {wrapped / bare:.3f}{extra}"
        )
        bare_cpu = statistics.median(cpu[("bare", route)]) * 1e6
        wrapped_cpu = statistics.median(cpu[("wrapped", route)]) * 1e6
        per = "request" if route == "/json" else "stream"
        print(
            f"{'':10} server CPU per {per}: bare {bare_cpu:,.0f} us  "
            f"wrapped {wrapped_cpu:,.0f} us  (+{wrapped_cpu - bare_cpu:,.0f} us); "
            f"as a throughput ratio {bare_cpu / wrapped_cpu:.3f}"
        )


if __name__ == "__main__":
    main()
