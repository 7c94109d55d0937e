"""A generation being appended while its PostgreSQL restarts: nothing lost, nothing twice."""

from __future__ import annotations

import asyncio

import pytest

from asgi_disconnect import DurableBackend, Status, connect
from asgi_disconnect._log import Generation
from tests.faults.cluster import Cluster
from tests.unit.test_backends import usage_record

pytestmark = pytest.mark.anyio


async def test_postgres_restart_mid_generation_loses_and_duplicates_nothing(
    cluster: Cluster, fault_url: str
) -> None:
    backend = connect(fault_url, flush_interval=0.05)
    assert isinstance(backend, DurableBackend)
    await backend.open()
    generation = Generation("gen_" + "R" * 24, principal="")
    backend.register(generation)

    async def produce() -> None:
        for i in range(400):
            generation.append(b"chunk %04d;" % i)
            await asyncio.sleep(0.01)
        generation.finish(Status.COMPLETE)

    record = usage_record(generation.id)
    try:
        producer = asyncio.ensure_future(produce())
        await asyncio.sleep(0.5)
        backend.record_usage(record)  # written by flushes that fail, then one that lands
        await asyncio.to_thread(cluster.stop, "fast")
        await asyncio.sleep(0.3)
        await asyncio.to_thread(cluster.start)
        async with asyncio.timeout(30):
            await producer
        async with asyncio.timeout(30):
            while backend.pending_bytes() or (await backend.get(generation.id)) is None:
                await asyncio.sleep(0.05)
            while (await backend.get(generation.id)).status is Status.RUNNING:  # type: ignore[union-attr]
                await asyncio.sleep(0.05)
    finally:
        await backend.aclose()
    reader = connect(fault_url)
    await reader.open()
    try:
        stored = b"".join([chunk async for chunk in reader.follow(generation.id, 0)])
        info = await reader.get(generation.id)
        records = await reader.usage_of(generation.id)
    finally:
        await reader.aclose()
    assert stored == b"".join(b"chunk %04d;" % i for i in range(400))
    # Flushed and read by no client: released from memory as it became durable.
    assert generation.base == generation.size
    assert stored.count(b";") == 400
    assert info is not None
    assert info.status is Status.COMPLETE
    assert records == [record], "the usage record, once"
