"""Time to first byte through the quickstart's gateway with httpx's default connection pool
and with the quickstart's own (``httpx.Limits``), at one level of concurrent streams.

``examples/gateway.py`` runs as it is, and again without its ``limits=`` line (httpx's
default: 100 connections), each on one uvicorn worker in front of one FakeProvider whose
streams last ``--seconds``. ``--streams`` clients (default 200) open their streams at once
and read them to the end; each reports the time from sending its request to the first body
byte, and whether the stream ended with ``data: [DONE]``; "reached" is when each request
arrived at the provider, from the moment the clients started. An upstream stream holds its
connection until it ends, so with the default pool the streams past the hundredth wait for
one to end before their request reaches the provider. The gateway, the provider and the
clients share the machine: on two cores, a token rate the gateway cannot keep up with at
this many streams delays every first byte, whatever the pool.

    python -m benchmarks.upstream_pool                       # 200 streams of 5 s
    python -m benchmarks.upstream_pool --streams 200 --seconds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from asgi_disconnect.testing import FakeProvider

from ._uvicorn import HOST, ROOT, free_port, uvicorn_command, wait_until_listening

GATEWAY = Path(ROOT) / "examples" / "gateway.py"
LIMITS = "    limits=httpx.Limits("
BODY = (
    b'{"model": "fake-model", "stream": true, "stream_options": {"include_usage": true},'
    b' "messages": [{"role": "user", "content": "hi"}]}'
)


def gateway_source(*, default_pool: bool) -> str:
    source = GATEWAY.read_text()
    lines = source.splitlines(keepends=True)
    if not any(line.startswith(LIMITS) for line in lines):
        raise SystemExit(f"{GATEWAY} sets no {LIMITS.strip()}...): nothing to compare")
    if default_pool:
        return "".join(line for line in lines if not line.startswith(LIMITS))
    return source


@contextlib.contextmanager
def gateway(source: str, upstream: str) -> Iterator[str]:
    """The gateway ``source`` under uvicorn, in a directory of its own (its SQLite store)."""
    with tempfile.TemporaryDirectory(prefix="upstream-pool-") as work:
        Path(work, "gateway.py").write_text(source)
        port = free_port()
        env = {**os.environ, "UPSTREAM_URL": upstream}
        proc = subprocess.Popen(
            uvicorn_command("gateway:app", port),
            cwd=work,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until_listening(port, 30, "the gateway")
            yield f"http://{HOST}:{port}"
        finally:
            proc.terminate()
            proc.wait(30)


async def one_stream(client: httpx.AsyncClient, url: str) -> tuple[float | None, bool]:
    """Seconds to the first body byte (None if none came) and whether the stream completed."""
    started = time.perf_counter()
    first: float | None = None
    tail = b""
    headers = {"authorization": "Bearer sk-anything", "content-type": "application/json"}
    try:
        async with client.stream("POST", url, content=BODY, headers=headers) as response:
            async for chunk in response.aiter_raw():
                if first is None:
                    first = time.perf_counter() - started
                tail = (tail + chunk)[-64:]
    except httpx.HTTPError:
        return first, False
    return first, response.status_code == 200 and tail.endswith(b"data: [DONE]\n\n")


async def level(
    url: str, streams: int, provider: FakeProvider
) -> tuple[list[tuple[float | None, bool]], list[float]]:
    """Each stream's TTFB and completeness, and when each request reached the provider (from
    the moment the clients started)."""
    # The clients' own pool is no limit: only the gateway's is measured.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        target = f"{url}/v1/chat/completions"
        await one_stream(client, target)  # warm-up: imports, the store's schema
        before = len(provider.requests)
        started = time.monotonic()
        results = await asyncio.gather(*(one_stream(client, target) for _ in range(streams)))
    reached = [request.started_at - started for request in provider.requests[before:]]
    return results, reached


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each stream")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    args = parser.parse_args()
    rate = args.tokens / args.seconds
    print(f"{args.streams} concurrent streams of {args.tokens} tokens at {rate:g}/s")
    print(
        f"{'pool':<34} {'TTFB p50':>9} {'TTFB p99':>9} {'reached p50':>12} {'reached p99':>12}"
        f" {'complete':>9}"
    )
    provider = FakeProvider(tokens=args.tokens, tokens_per_second=rate)
    with provider:
        for name, default_pool in (
            ("httpx's default (100 connections)", True),
            ("the quickstart's httpx.Limits", False),
        ):
            with gateway(gateway_source(default_pool=default_pool), provider.url) as url:
                results, reached = asyncio.run(level(url, args.streams, provider))
            firsts = [first for first, _ in results if first is not None]
            complete = sum(done for _, done in results)
            print(
                f"{name:<34} {statistics.median(firsts):>8.2f}s {percentile(firsts, 0.99):>8.2f}s"
                f" {statistics.median(reached):>11.2f}s {percentile(reached, 0.99):>11.2f}s"
                f" {complete:>5}/{args.streams}"
            )


if __name__ == "__main__":
    main()
