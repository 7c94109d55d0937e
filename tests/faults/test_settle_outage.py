"""PostgreSQL stops while idempotent handlers run and comes back after they answered."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.apps import eventually
from tests.faults.cluster import Cluster
from tests.faults.helpers import claim_rows, headers, runs, serve

pytestmark = [pytest.mark.anyio, pytest.mark.server]


async def test_an_outage_during_settle_strands_no_key_and_runs_nothing_twice(
    cluster: Cluster, fault_url: str, tmp_path: Path
) -> None:
    """50 requests on one key and 20 on keys of their own; handlers take 1.5 s; the
    database stops (immediate) at 0.5 s and starts again at 2.5 s. Every response reached
    its client while the database was down, so every key must end stored, and retries
    must get those very bytes, never a second run."""
    ran = tmp_path / "runs"
    keys = ["shared"] * 50 + [f"key-{i:02d}" for i in range(20)]
    distinct = sorted(set(keys))
    env = {"FAULTS_PG_URL": fault_url, "FAULTS_RUNS": str(ran), "FAULTS_SLEEP": "1.5"}
    with serve(env, tmp_path / "server.log") as (base, _):
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as client:

            async def post(key: str) -> httpx.Response:
                return await client.post("/charge", content=b"{}", headers=headers(key))

            began = time.monotonic()
            calls = [asyncio.ensure_future(post(key)) for key in keys]

            async def all_started() -> bool:
                return sum(runs(ran)[0].values()) >= len(distinct)

            await eventually(all_started, 5, "every handler started")
            await asyncio.sleep(max(0.0, began + 0.5 - time.monotonic()))
            await asyncio.to_thread(cluster.stop, "immediate")
            first = await asyncio.gather(*calls)
            await asyncio.sleep(max(0.0, began + 2.5 - time.monotonic()))
            await asyncio.to_thread(cluster.start)
            restarted = time.monotonic()

            async def all_settled() -> bool:
                rows = await claim_rows(fault_url)
                return len(rows) == len(distinct) and all(r["status"] == "completed" for r in rows)

            await eventually(all_settled, 15, "every claim completed after the restart")
            settled_after = time.monotonic() - restarted
            retries = await asyncio.gather(*(post(key) for key in distinct))
    originals = {}
    for key, response in zip(keys, first, strict=True):
        if response.status_code == 200:
            assert "idempotent-replayed" not in response.headers
            assert key not in originals, f"{key} ran twice in the first wave"
            originals[key] = response
        else:
            # The other 49 on the shared key: it was still running (or the store was down).
            assert key == "shared"
            assert response.status_code in (409, 503)
            assert int(response.headers["retry-after"]) >= 1
    assert sorted(originals) == distinct
    started, ended = runs(ran)
    assert started == dict.fromkeys(distinct, 1), "a handler ran twice"
    assert ended == dict.fromkeys(distinct, 1)
    for key, retry in zip(distinct, retries, strict=True):
        assert retry.status_code == 200, (key, retry.status_code, retry.text)
        assert retry.headers.get("idempotent-replayed") == "true"
        assert retry.content == originals[key].content, f"{key}: the replay differs"
    rows = await claim_rows(fault_url)
    assert [r["status"] for r in rows] == ["completed"] * len(distinct)
    log = (tmp_path / "server.log").read_text()
    print(
        f"{log.count('settling the idempotency claim')} settles failed while the database was "
        f"down; all landed {settled_after:.2f} s after it accepted connections again"
    )
