"""Instructions per request of an app's ASGI callable alone: no server, no socket, no timers.

Each app of ``benchmarks.apps`` asked for is driven in this process through its ASGI
callable (lifespan started, requests one after another, each with a receive that waits for
the response's end and then says ``http.disconnect``), under ``valgrind --tool=callgrind``,
twice: with ``--warm`` requests and with ``--warm + --requests``. The difference over
``--requests`` is the figure: what one request costs the app and the middlewares, free of
the server's share and of the machine's load (``benchmarks.instructions`` counts the whole
server process; timer-driven work there grows with the wall clock). A stream route
(``/sse-paced``, 1,000 chunks) is counted per stream; divide by 1,000 for a chunk.

    python -m benchmarks.in_process --apps bare disconnect install --route /json
    python -m benchmarks.in_process --apps disconnect --route /sse-paced --requests 10 --warm 4

Needs valgrind. Run from the tree to measure (``PYTHONPATH=<tree>``): before and after a
change, two trees side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
from typing import Any

APPS = ("bare", "disconnect", "install", "telemetry", "correlation-id")


def _app(name: str) -> Any:
    from benchmarks import apps

    if name == "bare":
        return apps.bare_app
    if name == "disconnect":
        return apps.wrapped_app
    if name == "install":
        return apps.installed_app()
    if name == "telemetry":
        return apps.installed_telemetry_app()
    if name == "correlation-id":
        return apps.correlation_app()
    raise SystemExit(f"unknown app {name!r}; one of {', '.join(APPS)}")


async def _drive(app: Any, path: str, requests: int) -> None:
    """Start the app's lifespan, then send ``requests`` GETs of ``path`` one at a time."""
    startup: asyncio.Queue[dict[str, str]] = asyncio.Queue()
    await startup.put({"type": "lifespan.startup"})
    started = asyncio.Event()

    async def lifespan_send(message: dict[str, Any]) -> None:
        if message["type"].startswith("lifespan.startup"):
            started.set()

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    lifespan = asyncio.ensure_future(app(scope, startup.get, lifespan_send))
    await asyncio.wait(
        [asyncio.ensure_future(started.wait()), lifespan], return_when=asyncio.FIRST_COMPLETED
    )
    for _ in range(requests):
        await _one(app, path)
    await asyncio.sleep(0.01)


async def _one(app: Any, path: str) -> None:
    ended = asyncio.Event()
    asked = False

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await ended.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            ended.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1:8000")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    await app(scope, receive, send)


def _collected(app: str, path: str, requests: int) -> int:
    """Instructions of a whole run of this module as the child (``--child``)."""
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "benchmarks.in_process",
            "--child",
            app,
            path,
            str(requests),
        ],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ.copy(),
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no count for {app}:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        import logging

        logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
        app, path, requests = sys.argv[2], sys.argv[3], int(sys.argv[4])
        asyncio.run(_drive(_app(app), path, requests))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--apps", nargs="+", default=["bare", "disconnect", "install"])
    parser.add_argument("--route", default="/json")
    parser.add_argument("--requests", type=int, default=500, help="measured requests")
    parser.add_argument("--warm", type=int, default=100, help="requests in both runs")
    args = parser.parse_args()
    bare = None
    for app in args.apps:
        if app not in APPS:
            parser.error(f"unknown app {app!r}; one of {', '.join(APPS)}")
        low = _collected(app, args.route, args.warm)
        high = _collected(app, args.route, args.warm + args.requests)
        each = (high - low) // args.requests
        if bare is None:
            bare = each
        first = args.apps[0]
        print(f"{app:15} {args.route:12} {each:>12,} per request {each - bare:>+12,} over {first}")


if __name__ == "__main__":
    main()
