"""PostgreSQL restarts around a takeover: the owner is SIGKILLed while the database is down,
and the database stops again while the survivor writes the continuation."""

from __future__ import annotations

import asyncio
import time

import pytest

from asgi_disconnect.testing import FakeProvider
from tests.faults.cluster import Cluster
from tests.integration.test_takeover import (
    FULL_TEXT,
    LEASE,
    RATE,
    TOKENS,
    info,
    read_whole,
    replica,
    start,
    terminal_markers,
    text_of,
    until_stored,
    until_taken_over,
    usage,
)

pytestmark = [pytest.mark.anyio, pytest.mark.server]


async def test_a_takeover_waits_out_a_database_restart_and_finishes_the_answer_whole(
    cluster: Cluster, fault_url: str
) -> None:
    """The owner dies while the database is down; nobody can take the generation over until
    it is back, and then exactly one replica does. A second restart, while that replica
    writes the continuation, loses no byte and adds no terminal marker: the answer reads
    back whole, and each attempt has its usage record."""
    kind = "continue_final_message"
    with FakeProvider(tokens=TOKENS, tokens_per_second=RATE / 2) as provider:
        with (
            replica(fault_url, provider) as (a, owner),
            replica(fault_url, provider) as (b, _),
        ):
            generation_id = await start(a, kind)
            await until_stored(b, generation_id, 1001)
            cluster.stop()
            owner.kill()
            owner.wait()
            await asyncio.sleep(LEASE + 1)  # the lease lapses while nothing can be read
            cluster.start()
            restarted = time.monotonic()
            await until_taken_over(b, generation_id)
            taken = int((await info(b, generation_id))["size"])
            await until_stored(b, generation_id, taken + 500)
            cluster.stop()
            await asyncio.sleep(1.0)  # the continuation goes on; its flushes wait
            cluster.start()
            whole = await read_whole(b, generation_id)
            final = await info(b, generation_id)
        records = await usage(fault_url, generation_id)
    print(f"taken over {time.monotonic() - restarted:.1f} s after the database came back")
    assert final["status"] == "complete", final
    assert final["attempt"] == 2
    assert terminal_markers(kind, whole) == 1
    assert text_of(kind, whole) == FULL_TEXT
    assert sorted(record.attempt for record in records) == [1, 2]
    calls = [call for call in provider.requests if call.path == "/v1/chat/completions"]
    assert len(calls) == 2  # the first attempt and its one continuation
