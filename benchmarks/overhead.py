"""DisconnectMiddleware's overhead: a bare Starlette app vs the same app wrapped, on uvicorn.

Both servers run side by side (one uvicorn process each, one worker); the load alternates
between them in rounds so that machine noise hits both alike. Prints requests/s on a small
JSON route, streams/s and chunks/s on a 1,000-chunk SSE route, and the ratios.

    python -m benchmarks.overhead [--rounds 5] [--seconds 3] [--connections 8]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from benchmarks._load import run_load
from benchmarks.apps import SSE_EVENTS

HOST = "127.0.0.1"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def serve(app: str) -> Iterator[int]:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            app,
            "--host",
            HOST,
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
            "--loop",
            "asyncio",
            "--http",
            "h11",
        ],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        for _ in range(500):
            with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.1):
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"{app} did not start")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    apps = {"bare": "benchmarks.apps:bare_app", "wrapped": "benchmarks.apps:wrapped_app"}
    results: dict[tuple[str, str], list[float]] = {}
    with serve(apps["bare"]) as bare_port, serve(apps["wrapped"]) as wrapped_port:
        ports = {"bare": bare_port, "wrapped": wrapped_port}
        for port in ports.values():  # warm-up
            asyncio.run(run_load(HOST, port, "/json", connections=4, duration=0.5))
            asyncio.run(run_load(HOST, port, "/sse", connections=4, duration=0.5))
        for round_ in range(args.rounds):
            order = ["bare", "wrapped"] if round_ % 2 == 0 else ["wrapped", "bare"]
            for route in ("/json", "/sse"):
                for name in order:
                    done, _ = asyncio.run(
                        run_load(
                            HOST,
                            ports[name],
                            route,
                            connections=args.connections,
                            duration=args.seconds,
                        )
                    )
                    results.setdefault((name, route), []).append(done / args.seconds)
    print(
        f"uvicorn (h11, asyncio), {args.rounds} rounds x {args.seconds}s, "
        f"{args.connections} connections; median per round"
    )
    for route, unit in (("/json", "requests/s"), ("/sse", "streams/s")):
        bare = statistics.median(results[("bare", route)])
        wrapped = statistics.median(results[("wrapped", route)])
        extra = ""
        if route == "/sse":
            extra = (
                f"  (chunks/s: bare {bare * SSE_EVENTS:,.0f}, wrapped {wrapped * SSE_EVENTS:,.0f})"
            )
        print(
            f"{route:6} {unit:11} bare {bare:9.1f}  wrapped {wrapped:9.1f}  "
            f"ratio {wrapped / bare:.3f}{extra}"
        )


if __name__ == "__main__":
    main()
