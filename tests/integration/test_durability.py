"""Durable generations across a SIGKILL, across replicas, and across a database restart."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time

import httpx
import msgspec
import pytest

from asgi_disconnect.testing import request
from tests.integration.processes import serve

pytestmark = [pytest.mark.anyio, pytest.mark.server]

FLUSH_INTERVAL = 0.05
# How far the flush window may grow under load: what a kill may lose, with the flush under way.
MAX_FLUSH_INTERVAL = 0.2


def server_process(
    url: str, *, lease: float = 15.0, slow_commit: float = 0.0
) -> contextlib.AbstractContextManager[tuple[str, subprocess.Popen[bytes]]]:
    """uvicorn serving tests.integration.durable_app in a process of its own; on SQLite,
    every commit taking ``slow_commit`` seconds."""
    return serve(
        "tests.integration.durable_app:app",
        {
            "ASGI_DISCONNECT_URL": url,
            "ASGI_DISCONNECT_LEASE": str(lease),
            "ASGI_DISCONNECT_FLUSH_INTERVAL": str(FLUSH_INTERVAL),
            "ASGI_DISCONNECT_MAX_FLUSH_INTERVAL": str(MAX_FLUSH_INTERVAL),
            "ASGI_DISCONNECT_SLOW_COMMIT": str(slow_commit),
        },
    )


def parse(body: bytes) -> list[tuple[int, float]]:
    events = []
    for frame in body.split(b"\n\n"):
        if frame.startswith(b"data: "):
            index, stamp = frame[6:].split()
            events.append((int(index), float(stamp)))
    return events


async def status(base: str, generation_id: str) -> dict[str, object]:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{base}/generations/{generation_id}")
    assert response.status_code == 200, response.text
    return msgspec.json.decode(response.content)  # type: ignore[no-any-return]


@pytest.fixture(params=["sqlite", "postgres"])
def shared_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


async def flush_window(base: str) -> float:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{base}/flush-window")
    return float(msgspec.json.decode(response.content)["window"])


async def kill_mid_generation(url: str, *, slow_commit: float = 0.0) -> tuple[float, float]:
    """A generation producing an event every 5 ms, its server SIGKILLed after a second:
    the newest event the store kept was produced how long before the kill, and the
    server's flush window just before it."""
    with server_process(url, lease=1.0, slow_commit=slow_commit) as (first, proc):
        started = await request(
            first + "/produce?n=100000&interval=0.005", disconnect_after_bytes=50
        )
        generation_id = started.headers["x-generation-id"]
        await asyncio.sleep(1.0)
        window = await flush_window(first)
        killed_at = time.time()
        proc.kill()
        proc.wait()
    with server_process(url, lease=1.0) as (second, _):
        async with asyncio.timeout(15):
            while (info := await status(second, generation_id))["status"] == "running":
                await asyncio.sleep(0.1)
        assert info["status"] == "interrupted"
        async with httpx.AsyncClient() as client:
            replay = await client.get(f"{second}/generations/{generation_id}/stream")
    events = parse(replay.content.split(b"event: error")[0])
    assert [i for i, _ in events] == list(range(len(events))), "a gap or a duplicate"
    assert replay.content.endswith(b"\n\n")
    assert b'event: error\ndata: {"error":{"type":"interrupted"' in replay.content
    assert int(info["size"]) == len(replay.content.split(b"event: error")[0])  # type: ignore[call-overload]
    lost = killed_at - events[-1][1]
    print(
        f"{url.split(':')[0]}: {len(events)} events kept; the newest was produced "
        f"{lost * 1000:.0f} ms before the kill (flush window {window * 1000:.0f} ms, "
        f"interval {FLUSH_INTERVAL * 1000:.0f} ms, ceiling {MAX_FLUSH_INTERVAL * 1000:.0f} ms)"
    )
    return lost, window


async def test_sigkill_keeps_what_was_flushed_and_marks_it_interrupted(shared_url: str) -> None:
    lost, window = await kill_mid_generation(shared_url)
    # Every event older than the window's ceiling (plus one flush's own time) survived.
    assert lost < MAX_FLUSH_INTERVAL + 0.1
    assert window <= MAX_FLUSH_INTERVAL


async def test_sigkill_on_a_slow_disk_loses_at_most_the_window_s_ceiling(sqlite_url: str) -> None:
    """Every commit takes 60 ms: flushing is the bottleneck, so the window has grown to its
    ceiling when the server is killed, and what is lost is still within it."""
    lost, window = await kill_mid_generation(sqlite_url, slow_commit=0.06)
    assert window == MAX_FLUSH_INTERVAL
    assert lost < MAX_FLUSH_INTERVAL + 0.1


async def test_a_replica_resumes_live_and_ends_when_the_owner_finishes(shared_url: str) -> None:
    with server_process(shared_url) as (a, _), server_process(shared_url) as (b, _):
        first = await request(a + "/produce?n=150&interval=0.01", disconnect_after_bytes=100)
        generation_id = first.headers["x-generation-id"]
        offset = len(first.body)
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream(
                "GET", f"{b}/generations/{generation_id}/stream", params={"offset": offset}
            ) as live,
        ):
            assert live.status_code == 200
            rest = b"".join([chunk async for chunk in live.aiter_raw()])
            ended_at = time.time()
        info = await status(b, generation_id)
    events = parse(first.body + rest)
    assert [i for i, _ in events] == list(range(150))
    assert info["status"] == "complete"
    assert info["size"] == len(first.body + rest)
    lag = ended_at - events[-1][1]
    print(
        f"{shared_url.split(':')[0]}: the replica's stream ended {lag * 1000:.0f} ms after "
        "the last event was produced on the owner"
    )
    assert lag < 1.0
