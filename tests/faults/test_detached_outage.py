"""PostgreSQL stops while a detached generation is being written, and comes back."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from asgi_disconnect.testing import request
from tests.apps import eventually
from tests.faults.cluster import Cluster
from tests.faults.helpers import claim_rows, headers, serve

pytestmark = [pytest.mark.anyio, pytest.mark.server]

EVENTS = 60
INTERVAL = 0.02
AUTH = {"authorization": "Bearer alice"}
EXPECTED = b"".join(b"data: %05d\n\n" % i for i in range(EVENTS))


async def test_a_detached_generation_rides_out_a_restart_and_its_key_settles(
    cluster: Cluster, fault_url: str, tmp_path: Path
) -> None:
    """The client leaves after 40 bytes; the generation goes on, detached, for 1.2 s. The
    database stops right after the client left and starts again once the generation has
    ended: the log must hold every byte, once, with the final status, read from another
    process; the idempotency claim, settled when the generation ended, must replay it."""
    env = {"FAULTS_PG_URL": fault_url, "FAULTS_RUNS": str(tmp_path / "runs")}
    with serve(env, tmp_path / "a.log") as (base, _):
        began = time.monotonic()
        first = await request(
            f"{base}/report?n={EVENTS}&interval={INTERVAL}",
            method="POST",
            headers=headers("report-1"),
            disconnect_after_bytes=40,
        )
        generation_id = first.headers["x-generation-id"]
        assert EXPECTED.startswith(first.body)
        await asyncio.to_thread(cluster.stop, "immediate")
        # Past the generation's end, by the clock of the process that runs it.
        await asyncio.sleep(max(0.0, began + EVENTS * INTERVAL + 0.5 - time.monotonic()))
        await asyncio.to_thread(cluster.start)

        async def settled() -> bool:
            return [row["status"] for row in await claim_rows(fault_url)] == ["completed"]

        await eventually(settled, 10, "the claim of the detached generation completed")
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            retry = await client.post(
                f"/report?n={EVENTS}&interval={INTERVAL}", headers=headers("report-1")
            )
        with serve(env, tmp_path / "b.log") as (other, _):
            async with httpx.AsyncClient(base_url=other, timeout=30) as client:

                async def complete() -> bool:
                    got = await client.get(f"/generations/{generation_id}", headers=AUTH)
                    return bool(got.json()["status"] == "complete")

                # The other process reads the database only: the owner's last flush is there.
                await eventually(complete, 10, "the generation complete in the database")
                info = msgspec.json.decode(
                    (await client.get(f"/generations/{generation_id}", headers=AUTH)).content
                )
                stored = await client.get(f"/generations/{generation_id}/stream", headers=AUTH)
    log = (tmp_path / "a.log").read_text()
    # The outage straddled the writes and the end: both had to be retried.
    assert "output is kept in memory and retried" in log
    # The settle waited for the store: to read the generation back, or to store it.
    assert "settling the idempotency claim 'report-1'" in log
    assert info["size"] == len(EXPECTED)
    assert stored.content == EXPECTED, "the log lost or doubled bytes across the restart"
    assert retry.status_code == 200
    assert retry.headers.get("idempotent-replayed") == "true"
    assert retry.headers["x-generation-id"] == generation_id
    assert retry.content == EXPECTED
