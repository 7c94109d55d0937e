"""Output waiting for the store is bounded per process: past ``max_pending_bytes`` the
producers wait on the store, never on their clients.

``install()`` (idempotency, drain, metering) on uvicorn with a SQLite store whose every
commit takes 40 ms (a slow disk). Eight clients start detached 12 MiB streams and leave at
once: nothing waits on a client, and the producers run as fast as they can. The output not
yet written never passes the bound by more than what each producer holds before it asks
the store (2 MiB); the producers
waited on the store, which was logged once; every byte of every stream is stored, each
request has its one usage record."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DurableBackend, UsageRecord, connect, disconnect_policy, install
from asgi_disconnect.testing import request, run_server
from tests.apps import as_tester, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.server]

MIB = 1 << 20
CHUNK = 64 << 10
CHUNKS = 192  # 12 MiB
STREAMS = 8
BOUND = 8 * MIB
# What a producer's log holds before it asks the store (Generation.hold, HOLD_CHECK).
HOLD_CHECK = 2 * MIB


def slow_commits(db: sqlite3.Connection) -> None:
    def trace(statement: str) -> None:
        if statement.lower().startswith("commit"):
            time.sleep(0.04)

    db.set_trace_callback(trace)


def event(stream: int, number: int) -> bytes:
    return b"data: " + (b"%02d%06d" % (stream, number)) * ((CHUNK - 8) // 8) + b"\n\n"


async def test_producers_wait_on_a_slow_store_past_the_bound_never_on_clients(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = connect(f"sqlite:///{tmp_path / 'g.db'}", init=slow_commits, max_pending_bytes=BOUND)
    assert isinstance(backend, DurableBackend)
    peaks: list[int] = []
    records: list[UsageRecord] = []

    @disconnect_policy("detach")
    async def stream(request: Request) -> StreamingResponse:
        number = int(request.query_params["n"])

        async def body() -> AsyncIterator[bytes]:
            for index in range(CHUNKS):
                yield event(number, index)
                peaks.append(backend.pending_bytes())
                await asyncio.sleep(0)

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/stream", stream)])
    install(
        app,
        backend=backend,
        sinks=[records.append],
        idempotency=True,
        drain={"signals": False, "drain_token": "op"},
        principal=as_tester,
    )
    with caplog.at_level(logging.WARNING, logger="asgi_disconnect"), run_server(app) as server:
        left = await asyncio.gather(
            *(
                request(f"{server.url}/v1/stream?n={n}", disconnect_after_bytes=40)
                for n in range(STREAMS)
            )
        )
        ids = [result.headers["x-generation-id"] for result in left]
        await eventually(lambda: len(records) == STREAMS, timeout=120, what="every record")
        await eventually(
            lambda: backend.pending_bytes() == 0, timeout=60, what="everything written"
        )
        whole = {
            generation_id: b"".join([data async for data in backend.follow(generation_id, 0)])
            for generation_id in ids
        }
    assert all(result.stopped_by == "disconnect_after_bytes" for result in left)
    # The bound, give or take what each producer holds before it asks (the old code let
    # all 96 MiB wait for the store).
    assert max(peaks) <= BOUND + STREAMS * (HOLD_CHECK + CHUNK), max(peaks)
    assert backend.output.waits > 0
    said = [r for r in caplog.records if "producers wait for it" in r.getMessage()]
    assert len(said) == 1  # once (then at most once a minute), not per wait
    for n, generation_id in enumerate(ids):
        assert whole[generation_id] == b"".join(event(n, i) for i in range(CHUNKS))
    assert sorted(r.generation_id for r in records) == sorted(ids)
    assert all(r.detached and r.outcome == "truncated" for r in records)
