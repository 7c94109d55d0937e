"""An upstream that resets, stalls, ends early or sends garbage, relayed through uvicorn.

After each: exactly one usage record, the generation never `complete`, the client's stream
ends with an error frame (or the client left), and the upstream connection is closed.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from asgi_disconnect import MemoryBackend, UsageRecord
from asgi_disconnect.testing import FakeProvider, request, run_server
from tests.integration.gateway import make_gateway

pytestmark = [pytest.mark.anyio, pytest.mark.server]


async def settled_records(records: list[UsageRecord], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not records:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # nothing more may arrive


@pytest.mark.parametrize(
    ("fault", "outcome", "error_type"),
    [
        ("reset-after=20", "error", "stream_error"),
        ("truncate-after=20", "truncated", "truncated_stream"),
        # Garbage after the tokens is no event at all: the stream lacks its marker.
        ("garbage-after=20", "truncated", "truncated_stream"),
    ],
)
async def test_a_broken_upstream_never_reads_complete(
    fault: str, outcome: str, error_type: str
) -> None:
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    with FakeProvider(tokens=80, tokens_per_second=400, fault=fault) as provider:
        app, _ = make_gateway(provider.url, backend=backend, sinks=[records.append])
        with run_server(app) as srv:
            result = await request(srv.url + "/in-generator", method="POST", timeout=20)
            (upstream,) = await provider.await_requests(1)
            assert await upstream.await_closed(timeout=5)
            await settled_records(records)
    assert upstream.fault_applied
    assert result.status == 200
    (record,) = records
    assert record.outcome == outcome, record
    generation_id = result.headers.get("x-generation-id")
    assert generation_id is not None
    info = await backend.get(generation_id)
    assert info is not None
    assert info.status == "failed", info
    tail = result.body[result.body.rfind(b"event: error") :]
    assert tail.startswith(b"event: error\ndata: ")
    payload = msgspec.json.decode(tail.split(b"data: ", 1)[1].split(b"\n", 1)[0])
    assert payload["error"]["type"] == error_type


async def test_a_stalled_upstream_is_cancelled_when_the_client_gives_up() -> None:
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    with FakeProvider(tokens=80, tokens_per_second=400, fault="stall-after=10") as provider:
        app, _ = make_gateway(provider.url, backend=backend, sinks=[records.append])
        with run_server(app) as srv:
            result = await request(
                srv.url + "/in-generator", method="POST", disconnect_after_seconds=0.8
            )
            (upstream,) = await provider.await_requests(1)
            assert await upstream.await_closed(timeout=5)
            await settled_records(records)
    (record,) = records
    assert record.outcome == "cancelled"
    generation_id = result.headers.get("x-generation-id")
    assert generation_id is not None
    info = await backend.get(generation_id)
    assert info is not None
    assert info.status == "cancelled"
    assert upstream.connection_closed_early


async def test_clients_that_send_their_headers_slowly_hold_nothing_up() -> None:
    """Two clients trickle their request head a few bytes at a time, a third gives up half
    way; plain requests go on meanwhile. Each request that reached the app gets one record;
    the abandoned one never reached it and costs nothing."""
    records: list[UsageRecord] = []
    with FakeProvider(tokens=20, tokens_per_second=400) as provider:
        app, _ = make_gateway(provider.url, backend=MemoryBackend(), sinks=[records.append])
        with run_server(app) as srv:
            head = (
                f"POST /in-generator HTTP/1.1\r\nhost: {srv.host}\r\n"
                "content-length: 0\r\nconnection: close\r\n\r\n"
            ).encode()

            async def trickle(give_up: bool) -> bytes:
                reader, writer = await asyncio.open_connection(srv.host, srv.port)
                try:
                    for start in range(0, len(head), 4):
                        if give_up and start >= len(head) // 2:
                            return b""
                        writer.write(head[start : start + 4])
                        await writer.drain()
                        await asyncio.sleep(0.03)
                    async with asyncio.timeout(10):
                        return await reader.read()
                finally:
                    writer.close()

            slow = asyncio.gather(trickle(False), trickle(False), trickle(True))
            plain = [
                await request(srv.url + "/in-generator", method="POST", timeout=10)
                for _ in range(3)
            ]
            answers = await slow
            async with asyncio.timeout(10):
                while len(records) < 5:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
    assert all(result.status == 200 for result in plain)
    assert all(b"data: [DONE]" in answer for answer in answers[:2])
    assert answers[2] == b""
    assert len(records) == 5
    assert {record.outcome for record in records} == {"complete"}
