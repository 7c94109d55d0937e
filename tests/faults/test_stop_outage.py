"""Stop across two server processes, with PostgreSQL stopped and started in between."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from asgi_disconnect.testing import request
from tests.apps import eventually
from tests.faults.cluster import Cluster
from tests.faults.helpers import serve

pytestmark = [pytest.mark.anyio, pytest.mark.server]

AUTH = {"authorization": "Bearer alice"}
UNAVAILABLE = "urn:asgi-disconnect:problem:generation-store-unavailable"


async def test_stop_reaches_another_replica_and_an_outage_is_a_clear_503(
    cluster: Cluster, fault_url: str, tmp_path: Path
) -> None:
    """A detached generation runs on replica A for 16 s; its client left. With PostgreSQL
    down, replica B answers status reads and a Stop with 503 and Retry-After (nothing
    stops, nothing is lost). Once it is back, a Stop sent to B ends the generation on A
    within a second, stored as ``cancelled`` with the output produced until then."""
    env = {"FAULTS_PG_URL": fault_url, "FAULTS_RUNS": str(tmp_path / "runs")}
    with (
        serve(env, tmp_path / "a.log") as (a, _),
        serve(env, tmp_path / "b.log") as (b, _),
    ):
        first = await request(
            f"{a}/report?n=800&interval=0.02",
            method="POST",
            headers=AUTH,
            disconnect_after_bytes=40,
        )
        generation_id = first.headers["x-generation-id"]
        async with httpx.AsyncClient(base_url=b, timeout=30) as client:

            async def known_on_b() -> bool:
                got = await client.get(f"/generations/{generation_id}", headers=AUTH)
                return got.status_code == 200 and got.json()["status"] == "running"

            await eventually(known_on_b, 10, "the generation readable on replica B")
            await asyncio.to_thread(cluster.stop, "immediate")
            read = await client.get(f"/generations/{generation_id}", headers=AUTH)
            stop = await client.post(f"/generations/{generation_id}/cancel", headers=AUTH)
            for answer in (read, stop):
                assert answer.status_code == 503, answer.text
                assert answer.headers["content-type"] == "application/problem+json"
                assert answer.json()["type"] == UNAVAILABLE
                assert answer.headers["retry-after"] == "1"
            await asyncio.to_thread(cluster.start)

            async def stopped() -> bool:
                got = await client.post(f"/generations/{generation_id}/cancel", headers=AUTH)
                return got.status_code in (200, 202)

            await eventually(stopped, 15, "a Stop accepted once the database is back")
            asked = time.monotonic()

            async def cancelled() -> bool:
                got = await client.get(f"/generations/{generation_id}", headers=AUTH)
                return got.status_code == 200 and got.json()["status"] == "cancelled"

            await eventually(cancelled, 10, "the generation cancelled on replica A")
            took = time.monotonic() - asked
            info = (await client.get(f"/generations/{generation_id}", headers=AUTH)).json()
            stored = await client.get(f"/generations/{generation_id}/stream", headers=AUTH)
    assert took < 2.0, f"stopped {took:.2f} s after the Stop"
    assert info["policy"] == "detach"  # the route's: the Stop cancelled it, stopped_by says
    events = stored.content.count(b"data: ")
    assert 0 < events < 800, events
    body = stored.content.split(b"event: error")[0]
    assert body == b"".join(b"data: %05d\n\n" % i for i in range(body.count(b"data: ")))
    # One error frame ends it, the one written when it stopped.
    assert stored.content.count(b"event: error") == 1
    assert b'"type":"cancelled"' in stored.content
