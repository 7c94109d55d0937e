"""PostgreSQL stops while a lagging client's backlog is in it, and comes back.

On a durable backend the client writer reads a lagging client's backlog back from the
store. Here a client stops reading a 48 MiB stream; the upstream finishes meanwhile and
memory lets go of what PostgreSQL has. The database stops; the client reads again; it gets
what was in flight, waits while the writer asks the store again, and once the database is
back it gets every byte, in order: a restart of the store does not cut it off."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from asgi_disconnect import UsageRecord, connect
from asgi_disconnect.testing import run_server, stalled_request
from tests.apps import eventually
from tests.faults.cluster import Cluster
from tests.integration.test_lagging_clients import WHOLE, Upstream, app

pytestmark = [pytest.mark.anyio, pytest.mark.server]

MIB = 1 << 20


async def test_a_lagging_clients_backlog_rides_out_a_database_restart(
    cluster: Cluster, fault_url: str, tmp_path: Path
) -> None:
    upstream = Upstream()
    records: list[UsageRecord] = []
    served = app(upstream, records, connect(fault_url))
    with run_server(served, server="uvicorn") as server:
        async with await stalled_request(f"{server.url}/v1/stream", read_bytes=64 << 10) as client:
            await eventually(upstream.finished.is_set, timeout=30, what="the upstream's end")
            state = upstream.state
            assert state is not None
            generation = state.generation
            assert generation is not None

            def stored() -> bool:
                assert generation is not None
                return generation.base >= generation.size - 1 * MIB  # the kept end

            # Memory let go of what PostgreSQL has: the client's backlog is there only.
            await eventually(stored, timeout=10, what="the stream stored and let go")
            await asyncio.to_thread(cluster.stop, "immediate")
            reading = asyncio.ensure_future(client.resume(timeout=60))
            await asyncio.sleep(2)
            # What was in flight arrived; the rest waits for the database.
            assert not reading.done()
            assert len(client.body) < len(WHOLE) // 4
            await asyncio.to_thread(cluster.start)
            result = await reading
        await eventually(lambda: records, timeout=10, what="the usage record")
    assert result.complete
    assert client.body == WHOLE
    (record,) = records
    assert record.delivered_bytes == len(WHOLE)
