"""PostgreSQL stops and starts again while requests keep claiming new keys."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.apps import eventually
from tests.faults.cluster import Cluster
from tests.faults.helpers import claim_rows, headers, runs, serve

pytestmark = [pytest.mark.anyio, pytest.mark.server]

UNAVAILABLE = "urn:asgi-disconnect:problem:idempotency-store-unavailable"


async def test_claims_while_the_database_is_down_get_503_then_work(
    cluster: Cluster, fault_url: str, tmp_path: Path
) -> None:
    """Four clients claim a new key every 30 ms; the database stops at 0.5 s and starts
    again a second later. A request is answered 200 (its handler ran, once) or 503 with
    Retry-After (it did not run); after the restart every key settles, the 200s replay and
    the 503s run, once, at their first retry: none is held by a claim nobody runs."""
    ran = tmp_path / "runs"
    env = {"FAULTS_PG_URL": fault_url, "FAULTS_RUNS": str(ran), "FAULTS_SLEEP": "0.1"}
    answers: dict[str, httpx.Response] = {}
    with serve(env, tmp_path / "server.log") as (base, _):
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:

            async def post(key: str) -> httpx.Response:
                return await client.post("/charge", content=b"{}", headers=headers(key))

            before = await post("before")
            assert before.status_code == 200
            restarted = asyncio.Event()

            async def claim_new_keys(worker: int) -> None:
                n = 0
                while not restarted.is_set():
                    key = f"w{worker}-{n:03d}"
                    answers[key] = await post(key)
                    n += 1
                    await asyncio.sleep(0.03)
                # Half a second more against the restarted database.
                for _ in range(10):
                    key = f"w{worker}-{n:03d}"
                    answers[key] = await post(key)
                    n += 1
                    await asyncio.sleep(0.03)

            workers = [asyncio.ensure_future(claim_new_keys(i)) for i in range(4)]
            await asyncio.sleep(0.5)
            await asyncio.to_thread(cluster.stop, "immediate")
            stopped = time.monotonic()
            await asyncio.sleep(0.3)
            during = await post("before")  # a stored answer cannot be read either
            await asyncio.sleep(max(0.0, stopped + 1.0 - time.monotonic()))
            await asyncio.to_thread(cluster.start)
            restarted.set()
            await asyncio.gather(*workers)

            async def settled() -> bool:
                return all(row["status"] == "completed" for row in await claim_rows(fault_url))

            await eventually(settled, 10, "every claim left is completed")
            retries = dict(zip(answers, await asyncio.gather(*map(post, answers)), strict=True))
            replay = await post("before")
    assert during.status_code == 503
    refused = {key for key, answer in answers.items() if answer.status_code == 503}
    served = {key for key, answer in answers.items() if answer.status_code == 200}
    assert refused | served == set(answers), {a.status_code for a in answers.values()}
    print(f"{len(served)} answered, {len(refused)} refused (503)")
    assert refused, "no request reached the middleware while the database was down"
    # Some handlers straddled the stop: they answered while their settle could not land.
    straddled = (tmp_path / "server.log").read_text().count("settling the idempotency claim")
    print(f"{straddled} answered while the database was down")
    assert straddled >= 1
    for key in refused:
        problem = msgspec.json.decode(answers[key].content)
        assert problem["type"] == UNAVAILABLE
        assert answers[key].headers["retry-after"] == "5"
    started, ended = runs(ran)
    for key, retry in retries.items():
        assert retry.status_code == 200, (key, retry.status_code, retry.text)
        if key in served:
            assert retry.headers.get("idempotent-replayed") == "true", key
            assert retry.content == answers[key].content
        else:
            assert "idempotent-replayed" not in retry.headers, key
    assert started == dict.fromkeys([*answers, "before"], 1), "a handler ran twice"
    assert ended == started
    assert replay.headers.get("idempotent-replayed") == "true"
    assert replay.content == before.content
