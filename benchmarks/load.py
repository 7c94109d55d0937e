"""Many concurrent SSE streams through a relay gateway, bare and with ``install()``, on uvicorn.

A Starlette gateway (`benchmarks._gateway`) relays ``POST /v1/chat/completions`` from a
FakeProvider with httpx. The same app runs bare (no asgi_disconnect) and with ``install()``
on each backend asked for (``--backend memory sqlite postgres``), each in a fresh uvicorn
process per level (one worker, h11, asyncio). For each level of concurrency (``--levels 100
500 1000``) and each contender in turn (the order rotates between levels), N clients open
their streams within ``--ramp`` seconds: 20% disconnect mid-stream, 5% stall (stop reading
with the socket open and a small receive buffer, and close after ``--stall-seconds``), the
rest read to the end. Streams are ``--seconds`` long (default 10) and about ``--kb`` KB
(default 49, the figures of the issue), paced by the provider. The same seed gives every
contender the same clients, disconnecting and stalling at the same moments. A stream of 49
KB fits in the socket buffers of a stalled client and the server, so a stall usually goes
unnoticed by the server: its record says ``complete`` unless the client closes before the
stream ends.

Per contender and level it prints:

- completed: clients that read a complete stream (chunked end and ``data: [DONE]``) out of
  those meant to; ``errors``: clients whose socket failed or that gave up;
- records: usage records the wrapped app's counting sink saw (exactly one per request is
  the contract), read from the server's ``GET /stats``; their outcomes in ``--verbose``;
- TTFB p50 / p99: from sending the request to the first body byte, at the client;
- CPU/stream: the server process's user + system CPU (``/proc/PID/stat``) from the start of
  the level until every upstream call ended and every record was emitted, per stream;
- RSS: the server's resident memory before the level (idle, a fresh process after one
  warm-up request), its peak (sampled every 50 ms) and after the level settled; per stream:
  (peak - idle) / N;
- billed / delivered: tokens FakeProvider sent upstream (``tokens_sent``) against tokens
  the clients received;
- reached p50 / p99: from sending the request to its arrival at the provider (the
  gateway's share of the TTFB: a saturated server shows here first);
- upstream / client: p50 length of a complete stream at the provider and at the client,
  against ``--seconds``: a longer client figure means the server fell behind the provider,
  a longer upstream figure that the load side (provider and clients share one core) did;
  ``load core`` is that side's CPU over wall time.

With two cores or more, the servers run on one core and the provider (a thread of this
process) and the clients (a process of their own) on another, so the load is never
accounted to the server.

    python -m benchmarks.load                                   # 100, 500, 1000; memory, sqlite
    python -m benchmarks.load --levels 100 --seconds 3          # a quick run
    python -m benchmarks.load --levels 100 500 --seconds 5 --backend memory sqlite postgres
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from asgi_disconnect.testing import FakeProvider
from benchmarks._uvicorn import HOST, ROOT, free_port, uvicorn_command, wait_until_listening
from benchmarks.overhead import LOAD_CPU, PINNED, SERVER_CPU, _pin, cpu_seconds

CHAT = "/v1/chat/completions"
PG_DSN = os.environ.get("ASGI_DISCONNECT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _load_cpu() -> tuple[float, float]:
    """CPU seconds of this process (the provider's thread) and of the finished clients."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class PeakSampler:
    """The largest RSS of a process, sampled every 50 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Server:
    name: str
    port: int
    pid: int
    wrapped: bool


@contextlib.contextmanager
def serve(name: str, app: str, env: dict[str, str], log: Path) -> Iterator[Server]:
    port = free_port()
    with log.open("wb") as errors:
        proc = subprocess.Popen(
            [*uvicorn_command(app, port), "--factory"],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=errors,
            preexec_fn=lambda: _pin(SERVER_CPU),
        )
        try:
            wait_until_listening(port, 30, f"{name} ({app})")
            yield Server(name, port, proc.pid, wrapped=name != "bare")
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def get_stats(server: Server) -> dict[str, Any]:
    response = httpx.get(f"http://{HOST}:{server.port}/stats", timeout=10)
    response.raise_for_status()
    return response.json()  # type: ignore[no-any-return]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@dataclass
class Result:
    contender: str
    streams: int
    meant_to_complete: int
    completed: int
    errors: int
    records: int | None
    outcomes: dict[str, int]
    ttfb_p50: float | None
    ttfb_p99: float | None
    reach_p50: float | None
    reach_p99: float | None
    cpu_per_stream: float
    rss_idle: int
    rss_peak: int
    rss_settled: int
    billed: int
    delivered: int
    upstream_p50: float | None
    stream_p50: float | None
    load_busy: float
    settled: bool
    notes: list[str] = field(default_factory=list)

    @property
    def rss_per_stream(self) -> float:
        return (self.rss_peak - self.rss_idle) / self.streams


def run_level(
    server: Server, provider: FakeProvider, streams: int, args: argparse.Namespace
) -> Result:
    provider.reset()
    load_before = _load_cpu()
    wall_before = time.monotonic()
    before = get_stats(server)
    cpu_before = cpu_seconds(server.pid)
    idle = rss_bytes(server.pid)
    with PeakSampler(server.pid) as sampler:
        command = [
            sys.executable,
            "-m",
            "benchmarks._stream_clients",
            "--port",
            str(server.port),
            "--streams",
            str(streams),
            "--seconds",
            str(args.seconds),
            "--disconnect",
            str(args.disconnect),
            "--stall",
            str(args.stall),
            "--stall-seconds",
            str(args.stall_seconds),
            "--ramp",
            str(args.ramp),
        ]
        out = subprocess.run(
            command,
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=args.seconds * 4 + args.stall_seconds + args.ramp + 120,
            preexec_fn=lambda: _pin(LOAD_CPU),
        ).stdout
        clients: list[dict[str, Any]] = json.loads(out)["clients"]
        load_cpu = [b - a for a, b in zip(load_before, _load_cpu(), strict=True)]
        load_wall = time.monotonic() - wall_before
        # Settled: no relay runs, every upstream call ended, a record for every relay.
        deadline = time.monotonic() + args.settle
        settled = False
        while time.monotonic() < deadline:
            stats = get_stats(server)
            started = stats["relays_started"] - before["relays_started"]
            upstream_done = all(r.closed_at is not None for r in provider.requests)
            records_done = not server.wrapped or stats["records"] - before["records"] >= started
            if upstream_done and records_done and stats["relays_in_flight"] == 0:
                settled = True
                break
            time.sleep(0.1)
        cpu_used = cpu_seconds(server.pid) - cpu_before
    time.sleep(1.0)
    after = get_stats(server)
    requests = provider.requests
    notes = []
    if not settled:
        notes.append(
            f"not settled after {args.settle:.0f}s: relays started "
            f"{after['relays_started'] - before['relays_started']}, in flight "
            f"{after['relays_in_flight']}; upstream calls {len(requests)}, open "
            f"{sum(r.closed_at is None for r in requests)}; records "
            f"{after['records'] - before['records']}"
        )
    duplicates = after.get("duplicates", 0) - before.get("duplicates", 0)
    if duplicates:
        notes.append(f"{duplicates} generation(s) with more than one usage record")
    ttfbs = [c["ttfb"] for c in clients if c["ttfb"] is not None]
    # How long a request took to reach the provider through the gateway (one monotonic clock).
    sent = {f"client-{c['client']}": c["sent_at"] for c in clients}
    reach = [r.started_at - sent[r.body["user"]] for r in requests if r.body.get("user") in sent]
    finished = [r.closed_at - r.started_at for r in requests if r.finished and r.closed_at]
    outcomes = {
        k: v - before["outcomes"].get(k, 0)
        for k, v in after["outcomes"].items()
        if v - before["outcomes"].get(k, 0)
    }
    return Result(
        contender=server.name,
        streams=streams,
        meant_to_complete=sum(c["kind"] == "complete" for c in clients),
        completed=sum(c["complete"] for c in clients),
        errors=sum(c["error"] is not None for c in clients),
        records=after["records"] - before["records"] if server.wrapped else None,
        outcomes=outcomes,
        ttfb_p50=percentile(ttfbs, 0.50),
        ttfb_p99=percentile(ttfbs, 0.99),
        reach_p50=percentile(reach, 0.50),
        reach_p99=percentile(reach, 0.99),
        cpu_per_stream=cpu_used / streams,
        rss_idle=idle,
        rss_peak=sampler.peak,
        rss_settled=rss_bytes(server.pid),
        billed=sum(r.tokens_sent for r in requests),
        delivered=sum(c["tokens"] for c in clients),
        upstream_p50=statistics.median(finished) if finished else None,
        stream_p50=percentile([c["duration"] for c in clients if c["complete"]], 0.5),
        load_busy=sum(load_cpu) / load_wall,
        settled=settled,
        notes=notes,
    )


def warm_up(server: Server) -> None:
    headers = {"x-fake-tokens": "20", "x-fake-rate": "0"}
    with httpx.Client(timeout=30) as client:
        for _ in range(20):
            response = client.post(
                f"http://{HOST}:{server.port}{CHAT}", json={"stream": True}, headers=headers
            )
            assert b"[DONE]" in response.content, response.content[-200:]
    if server.wrapped:  # their records too, so that a level counts its own alone
        deadline = time.monotonic() + 10
        while get_stats(server)["records"] < 20 and time.monotonic() < deadline:
            time.sleep(0.02)


def bytes_per_token(provider: FakeProvider) -> float:
    def size(tokens: int) -> int:
        headers = {"x-fake-tokens": str(tokens), "x-fake-rate": "0"}
        body = {"stream": True, "stream_options": {"include_usage": True}}
        return len(httpx.post(provider.url + CHAT, json=body, headers=headers, timeout=30).content)

    return (size(1100) - size(100)) / 1000


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


COLUMNS = (
    ("contender", 9),
    ("streams", 7),
    ("completed", 9),
    ("err", 3),
    ("records", 7),
    ("TTFB ms p50/p99", 15),
    ("reached ms", 11),
    ("CPU/stream", 10),
    ("RSS MB idle/peak/settled", 24),
    ("RSS/stream", 10),
    ("billed", 7),
    ("delivered", 9),
    ("upstream", 8),
    ("client", 6),
    ("load core", 9),
)


def row(r: Result) -> list[str]:
    mb = 1024 * 1024
    return [
        r.contender,
        str(r.streams),
        f"{r.completed}/{r.meant_to_complete}",
        str(r.errors),
        "-" if r.records is None else str(r.records),
        f"{ms(r.ttfb_p50)}/{ms(r.ttfb_p99)}",
        f"{ms(r.reach_p50)}/{ms(r.reach_p99)}",
        f"{r.cpu_per_stream * 1000:.1f} ms",
        f"{r.rss_idle / mb:.0f}/{r.rss_peak / mb:.0f}/{r.rss_settled / mb:.0f}",
        f"{r.rss_per_stream / 1024:.0f} KB",
        str(r.billed),
        str(r.delivered),
        "-" if r.upstream_p50 is None else f"{r.upstream_p50:.1f}s",
        "-" if r.stream_p50 is None else f"{r.stream_p50:.1f}s",
        f"{r.load_busy:.0%}",
    ]


def print_table(results: list[Result], args: argparse.Namespace, tokens: int) -> None:
    print()
    print(
        f"uvicorn (h11, asyncio), one worker; {tokens} tokens per stream over {args.seconds:g}s "
        f"(~{args.kb:g} KB); {args.disconnect:.0%} disconnect, {args.stall:.0%} stall "
        f"(closing after {args.stall_seconds:g}s); ramp {args.ramp:g}s"
        + (
            f"; server on CPU {SERVER_CPU}, provider and clients on CPU {LOAD_CPU}"
            if PINNED
            else ""
        )
    )

    def line(cells: list[str]) -> str:
        first, *rest = zip(cells, (width for _, width in COLUMNS), strict=True)
        return " ".join([f"{first[0]:<{first[1]}}", *(f"{c:>{w}}" for c, w in rest)])

    print(line([name for name, _ in COLUMNS]))
    print(line(["-" * width for _, width in COLUMNS]))
    ordered = sorted(results, key=lambda r: (r.streams, r.contender != "bare", r.contender))
    for r in ordered:
        print(line(row(r)))
        if args.verbose and r.outcomes:
            print(f"{'':9} usage record outcomes: {r.outcomes}")
        for note in r.notes:
            print(f"{'':9} {note}")
    print(
        "reached: from sending the request to its arrival at the provider; upstream, client: "
        "p50 length of a complete stream at the provider and at the client; load core: CPU of "
        "provider + clients / wall time"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", type=int, nargs="+", default=[100, 500, 1000])
    parser.add_argument("--seconds", type=float, default=10.0, help="stream length")
    parser.add_argument("--kb", type=float, default=49.0, help="stream size (SSE body)")
    parser.add_argument(
        "--backend",
        nargs="+",
        choices=["memory", "sqlite", "postgres"],
        default=["memory", "sqlite"],
    )
    parser.add_argument("--disconnect", type=float, default=0.20, help="share of clients")
    parser.add_argument("--stall", type=float, default=0.05, help="share of clients")
    parser.add_argument(
        "--stall-seconds", type=float, default=None, help="default: the stream length"
    )
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds to open all streams")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds to wait after")
    parser.add_argument(
        "--flush-interval", type=float, help="a durable backend's flush_interval (default 0.05)"
    )
    parser.add_argument("--pg-dsn", default=PG_DSN)
    parser.add_argument("--json", type=Path, help="also write the results there")
    parser.add_argument("--verbose", action="store_true", help="usage record outcomes")
    parser.add_argument("--keep", action="store_true", help="keep the server logs and database")
    args = parser.parse_args()
    if args.stall_seconds is None:
        args.stall_seconds = args.seconds
    # The provider's thread inherits this thread's CPU: it shares the load's core.
    _pin(LOAD_CPU)
    workdir = Path(tempfile.mkdtemp(prefix="asgi-disconnect-load-"))
    schema = "load_" + secrets.token_hex(4)
    backends = {
        "memory": "memory://",
        "sqlite": f"sqlite:///{workdir / 'generations.db'}",
        "postgres": f"{args.pg_dsn}?schema={schema}",
    }
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        probe = stack.enter_context(FakeProvider(tokens=10, tokens_per_second=0))
        tokens = max(1, round(args.kb * 1000 / bytes_per_token(probe)))
        probe.stop()
        provider = stack.enter_context(
            FakeProvider(tokens=tokens, tokens_per_second=tokens / args.seconds)
        )
        env = {"LOAD_UPSTREAM": provider.url}
        if args.flush_interval is not None:
            env["LOAD_FLUSH_INTERVAL"] = str(args.flush_interval)
        contenders = [("bare", "benchmarks._gateway:bare_app", env)]
        for name in args.backend:
            contenders.append(
                (name, "benchmarks._gateway:wrapped_app", {**env, "LOAD_BACKEND": backends[name]})
            )
        for index, level in enumerate(args.levels):
            shift = index % len(contenders)
            for name, app, app_env in contenders[shift:] + contenders[:shift]:
                # A process of its own per level: its idle RSS is a fresh one's, so the
                # peak above it is this level's alone.
                with serve(name, app, app_env, workdir / f"{name}-{level}.log") as server:
                    warm_up(server)
                    print(f"{server.name:8} {level:5} streams ...", end=" ", flush=True)
                    result = run_level(server, provider, level, args)
                results.append(result)
                print(
                    f"completed {result.completed}/{result.meant_to_complete}, "
                    f"CPU/stream {result.cpu_per_stream * 1000:.1f} ms",
                    flush=True,
                )
    if "postgres" in args.backend:
        asyncio.run(_drop_schema(args.pg_dsn, schema))
    print_table(results, args, tokens)
    if args.keep:
        print(f"server logs and the SQLite database: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))


async def _drop_schema(dsn: str, schema: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(dsn)
    try:
        await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await connection.close()


if __name__ == "__main__":
    main()
