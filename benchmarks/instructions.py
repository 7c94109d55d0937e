"""The stack's overhead in CPU instructions, beside peers: free of the machine's timing noise.

Each app of ``benchmarks.apps.APPS`` asked for (``--apps``; by default all: bare,
asgi-correlation-id, opentelemetry-instrumentation-asgi with its defaults and with one span
per request, DisconnectMiddleware alone, the same with ``client_timeout=None`` (no transport
watch: the difference is what judging clients by their TCP costs), and ``install()``) is
served by uvicorn (h11, asyncio, one worker) under ``valgrind --tool=callgrind``. One
keep-alive connection sends warm-up requests, the counters are zeroed, the measured requests
follow one after another,
and the counts are dumped: instructions per request (or per stream) of the whole server
process, what each app adds to bare, per chunk for the streams, and the ratio bare / app
(the throughput ratio it stands for). The same binary, inputs and environment give the same
counts whatever else the machine is doing, so this is the figure to judge a change by;
``benchmarks.overhead`` gives the throughput.

    python -m benchmarks.instructions [--requests 1000] [--streams 20] [--apps bare install]

Needs valgrind (``apt-get install valgrind``) and, for the peers, ``pip install -e
'.[bench]'``; each app takes about a minute per route.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from benchmarks._uvicorn import HOST, ROOT, free_port, uvicorn_command, wait_until_listening


class Client:
    """Sequential keep-alive HTTP/1.1 requests on one socket; checks every response."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=120)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.buffer += data
        head, _, self.buffer = self.buffer.partition(marker)
        return head

    def _read_exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("the server closed the connection")
            self.buffer += data
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data

    def get(self, path: str) -> int:
        """One request; returns the body size."""
        self.sock.sendall(f"GET {path} HTTP/1.1\r\nhost: {HOST}\r\n\r\n".encode())
        head = self._read_until(b"\r\n\r\n").lower()
        if not head.startswith(b"http/1.1 200"):
            raise RuntimeError(f"{path}: {head[:40]!r}")
        match = re.search(rb"content-length: *(\d+)", head)
        if match:
            return len(self._read_exactly(int(match.group(1))))
        size = 0
        while True:
            length = int(self._read_until(b"\r\n"), 16)
            size += len(self._read_exactly(length + 2)) - 2
            if length == 0:
                return size


@contextlib.contextmanager
def under_callgrind(
    app: str, out_dir: str, *, factory: bool = False
) -> Iterator[tuple[int, int, str]]:
    port = free_port()
    out = os.path.join(out_dir, f"{app.rsplit(':', 1)[1]}.%p")
    proc = subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            *uvicorn_command(app, port, factory=factory),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # Hash randomisation changes dict layouts, and so the counts, from run to run.
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    try:
        wait_until_listening(port, 120, f"{app} under valgrind")
        yield port, proc.pid, out.replace("%p", str(proc.pid))
    finally:
        proc.terminate()
        proc.wait(60)


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True)


def _dumped_total(prefix: str, before: set[str]) -> int:
    for _ in range(600):
        new = set(glob.glob(prefix + ".*")) - before
        for path in new:
            with open(path) as dump:
                text = dump.read()
            match = re.search(r"^totals: (\d+)", text, re.MULTILINE)
            if match:
                return int(match.group(1))
        time.sleep(0.1)
    raise RuntimeError("callgrind wrote no dump")


def count(
    app: str, route: str, requests: int, warmup: int, out_dir: str, *, factory: bool = False
) -> float:
    """Instructions the server process executes per request on ``route``."""
    with under_callgrind(app, out_dir, factory=factory) as (port, pid, prefix):
        client = Client(port)
        try:
            for _ in range(warmup):
                client.get(route)
            _control("-z", str(pid))
            for _ in range(requests):
                client.get(route)
            before = set(glob.glob(prefix + ".*"))
            _control("-d", str(pid))
            total = _dumped_total(prefix, before)
        finally:
            client.close()
    return total / requests


# route -> (warm-up requests, what one measures); streams warm up past metering's first
# answers of a model, which it reads whole to calibrate its estimates.
ROUTES = {
    "/json": (200, "request"),
    "/app-json": (200, "request"),
    "/sse": (10, "stream"),
    "/sse-llm": (10, "stream"),
    "/sse-paced": (10, "stream"),
    "/sse-paced-detach": (10, "stream"),
}


def main() -> None:
    from benchmarks.apps import APPS, SSE_EVENTS

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000, help="measured /json requests")
    parser.add_argument("--streams", type=int, default=20, help="measured /sse streams")
    parser.add_argument("--apps", nargs="+", choices=list(APPS), default=list(APPS))
    parser.add_argument(
        "--routes", nargs="+", choices=list(ROUTES), default=list(ROUTES), help="routes to run"
    )
    args = parser.parse_args()
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    names = ["bare", *(name for name in args.apps if name != "bare")]
    plan = [
        (route, args.requests if unit == "request" else args.streams, warmup, unit)
        for route, (warmup, unit) in ROUTES.items()
        if route in args.routes
    ]
    print("uvicorn (h11, asyncio) under callgrind; instructions of the server process")
    with tempfile.TemporaryDirectory() as out_dir:
        for route, requests, warmup, unit in plan:
            counts: dict[str, float] = {}
            for name in names:
                app, factory = APPS[name]
                counts[name] = count(app, route, requests, warmup, out_dir, factory=factory)
                bare, own = counts["bare"], counts[name]
                added = own - bare
                per_chunk = f", {added / SSE_EVENTS:+,.0f} per chunk" if unit == "stream" else ""
                print(
                    f"{route:10} {name:18} per {unit} {own:14,.0f}  "
                    f"({added:+,.0f}{per_chunk}); ratio {bare / own:.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
