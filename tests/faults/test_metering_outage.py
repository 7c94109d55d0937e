"""PostgreSQL stops while a cancelled stream's record needs its text back from the store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
import pytest

from asgi_disconnect.metering import analyze
from asgi_disconnect.testing import request
from tests.apps import eventually
from tests.faults.cluster import Cluster
from tests.faults.helpers import serve

pytestmark = [pytest.mark.anyio, pytest.mark.server]

AUTH = {"authorization": "Bearer alice"}


async def rows(url: str, table: str, generation_id: str) -> list[asyncpg.Record]:
    parts = urlsplit(url)
    schema = parse_qs(parts.query)["schema"][0]
    conn = await asyncpg.connect(parts._replace(query="").geturl(), timeout=5)
    try:
        column = "id" if table == "generations" else "generation_id"
        return await conn.fetch(
            f'select * from "{schema}".asgi_disconnect_{table} where {column} = $1',
            generation_id,
        )
    finally:
        await conn.close()


async def test_a_cancel_whose_text_the_store_cannot_give_back_is_one_honest_record(
    cluster: Cluster, fault_url: str, tmp_path: Path
) -> None:
    """Through install() with idempotency on: a 10 s stream whose delivered bytes the log
    let go (stored and delivered); the database stops, then the client leaves. The record
    needs the stream's text for its estimate and the store cannot give it: it is still one
    record, cancelled, saying what it could not read, stored once the database is back; the
    generation is stored cancelled, not complete."""
    env = {"FAULTS_PG_URL": fault_url, "FAULTS_RUNS": str(tmp_path / "runs")}
    with serve(env, tmp_path / "a.log") as (base, _):
        stream = asyncio.ensure_future(
            request(
                f"{base}/chat?n=1000&interval=0.01",
                method="POST",
                headers=AUTH,
                disconnect_after_seconds=3.0,
            )
        )
        await asyncio.sleep(2.0)  # flushed and delivered: the log lets the first bytes go
        await asyncio.to_thread(cluster.stop, "immediate")
        cut = await stream
        generation_id = cut.headers["x-generation-id"]
        await asyncio.sleep(1.0)  # the record is made while the database is down
        await asyncio.to_thread(cluster.start)

        async def stored() -> bool:
            return bool(await rows(fault_url, "usage", generation_id))

        await eventually(stored, 20, "the usage record stored once the database is back")
        await asyncio.sleep(0.5)  # a second record would have been flushed by now
        usage = await rows(fault_url, "usage", generation_id)
        generations = await rows(fault_url, "generations", generation_id)
    assert len(usage) == 1
    record = json.loads(usage[0]["record"])
    assert record["outcome"] == "cancelled"
    assert record["delivered_bytes"] <= record["produced_bytes"]
    assert "could not be read back from the store" in (record["usage_note"] or "")
    assert [row["status"] for row in generations] == ["cancelled"]


async def test_a_cancel_reads_its_released_text_back_from_postgresql(
    cluster: Cluster, fault_url: str, tmp_path: Path
) -> None:
    """The same with the database up: the estimate reads the text the log let go back from
    PostgreSQL, and counts what the client received."""
    env = {"FAULTS_PG_URL": fault_url, "FAULTS_RUNS": str(tmp_path / "runs")}
    with serve(env, tmp_path / "a.log") as (base, _):
        cut = await request(
            f"{base}/chat?n=1000&interval=0.01",
            method="POST",
            headers=AUTH,
            disconnect_after_seconds=3.0,
        )
        generation_id = cut.headers["x-generation-id"]

        async def stored() -> bool:
            return bool(await rows(fault_url, "usage", generation_id))

        await eventually(stored, 20, "the usage record stored")
        usage = await rows(fault_url, "usage", generation_id)
    assert len(usage) == 1
    record = json.loads(usage[0]["record"])
    assert record["outcome"] == "cancelled"
    assert record["usage_source"] == "estimated"
    assert record["usage_note"] == "estimated at 4 characters per token"
    # All of its text was read: at least what the client received, at 4 characters a token
    # (the client's first bytes are long gone from the process's memory by then).
    received = analyze(cut.body).text
    assert len(received) > 1000
    assert record["output_tokens"] >= round(len(received) / 4)
    assert 0 < record["delivered_output_tokens"] <= record["output_tokens"]
