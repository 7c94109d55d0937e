"""A client that stops reading, on a durable store: the producer never waits on it.

``install()`` (idempotency, drain, metering) on uvicorn with a SQLite store. A client reads
the head of a 48 MiB event stream and stops reading with its socket open. The upstream
finishes at its own pace meanwhile. Memory lets go of what the store has, including the
client's backlog, so the process holds about a flush interval of it, whatever the client
does. When the client reads again, the writer reads its backlog back from the store and the
client gets every byte, in order. One usage record. On the memory backend the producer
still waits for such a client (``max_lag_bytes``): there memory is the only copy."""

from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import MemoryBackend, RequestState, UsageRecord, connect, install
from asgi_disconnect.testing import run_server, stalled_request
from tests.apps import as_tester, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.server]

MIB = 1 << 20
EVENT = 64 << 10  # each event: "data: " + payload + "\n\n"
EVENTS = 768  # 48 MiB


def event(number: int) -> bytes:
    payload = (b"%08d" % number) * ((EVENT - 8) // 8)
    return b"data: " + payload[: EVENT - 8] + b"\n\n"


WHOLE = b"".join(event(n) for n in range(EVENTS))


class Upstream:
    """What the app produced, and when, and the resident bytes of its log as it went."""

    def __init__(self) -> None:
        # Set in the server's thread: read with eventually(), not awaited.
        self.finished = threading.Event()
        self.finished_at = 0.0
        self.resident_peak = 0
        self.state: RequestState | None = None


def app(upstream: Upstream, records: list[UsageRecord], backend: object) -> Starlette:
    async def stream(request: Request) -> StreamingResponse:
        state = request.scope["asgi_disconnect"]
        assert isinstance(state, RequestState)
        upstream.state = state

        async def body() -> AsyncIterator[bytes]:
            for number in range(EVENTS):
                yield event(number)
                generation = state.generation
                if generation is not None:
                    resident = generation.size - generation.base
                    upstream.resident_peak = max(upstream.resident_peak, resident)
                await asyncio.sleep(0.001)
            upstream.finished_at = time.monotonic()
            upstream.finished.set()

        return StreamingResponse(body(), media_type="text/event-stream")

    application = Starlette(routes=[Route("/v1/stream", stream)])
    install(
        application,
        backend=backend,  # type: ignore[arg-type]
        sinks=[records.append],
        idempotency=True,
        drain={"signals": False, "drain_token": "op"},
        principal=as_tester,
        max_lag_seconds=60,
    )
    return application


async def test_a_client_that_stops_reading_does_not_slow_the_upstream_on_sqlite(
    tmp_path: Path,
) -> None:
    upstream = Upstream()
    records: list[UsageRecord] = []
    served = app(upstream, records, connect(f"sqlite:///{tmp_path / 'g.db'}"))
    tracemalloc.start()
    try:
        with run_server(served, server="uvicorn") as server:
            async with await stalled_request(
                f"{server.url}/v1/stream", read_bytes=64 << 10
            ) as client:
                stalled_at = time.monotonic()
                tracemalloc.reset_peak()
                baseline = tracemalloc.get_traced_memory()[0]
                # The client reads nothing more; the upstream goes on at its own pace.
                await eventually(upstream.finished.is_set, timeout=30, what="the upstream's end")
                read_while_stalled = len(client.body)
                await asyncio.sleep(0.5)  # a few flushes: memory lets go of what is stored
                state = upstream.state
                assert state is not None
                generation = state.generation
                assert generation is not None
                held_after = generation.size - generation.base
                peak = tracemalloc.get_traced_memory()[1] - baseline
                result = await client.resume(timeout=60)
            await eventually(lambda: records, timeout=10, what="the usage record")
    finally:
        tracemalloc.stop()
    assert upstream.finished_at > stalled_at
    assert read_while_stalled < 4 * MIB  # it did stall: the rest waited in the store
    # The bound this test states: the 48 MiB stream never had more than 16 MiB in the
    # process at once (output waiting for the store, the client's last 16 KiB, the event
    # stream's kept end), and a flush after it ended, the log holds only that end (at most
    # 960 KiB) and the client's last 16 KiB.
    assert upstream.resident_peak < 16 * MIB, upstream.resident_peak
    assert peak < 24 * MIB, peak
    assert held_after <= 1 * MIB, held_after
    assert result.complete
    assert client.body == WHOLE  # every byte, in order: the backlog read back from the store
    (record,) = records
    assert record.delivered_bytes == record.produced_bytes == len(WHOLE)
    assert record.outcome == "truncated"  # no terminal marker in this stream


async def test_on_the_memory_backend_the_producer_still_waits_for_a_stalled_client() -> None:
    upstream = Upstream()
    records: list[UsageRecord] = []
    served = app(upstream, records, MemoryBackend())
    with run_server(served, server="uvicorn") as server:
        async with await stalled_request(f"{server.url}/v1/stream", read_bytes=64 << 10) as client:
            await asyncio.sleep(3)
            # Memory is the only copy: the producer waits once it is max_lag_bytes ahead.
            assert not upstream.finished.is_set()
            assert upstream.resident_peak < 12 * MIB
            result = await client.resume(timeout=60)
        await eventually(lambda: records, timeout=10, what="the usage record")
    assert result.complete
    assert client.body == WHOLE
