"""Clients that leave at random points, under both policies: one usage record each."""

from __future__ import annotations

import asyncio
import random
import re
import statistics
from typing import Any

import pytest

from asgi_disconnect import UsageRecord
from asgi_disconnect.testing import FakeProvider, request, run_server, stalled_request
from tests.integration.gateway import make_gateway

pytestmark = [pytest.mark.anyio, pytest.mark.server]


class Ledger:
    def __init__(self) -> None:
        self.reserved = 0
        self.settled: list[UsageRecord] = []

    async def reserve(self, scope: Any) -> int:
        self.reserved += 1
        return self.reserved

    async def settle(self, reservation: Any, record: UsageRecord) -> None:
        self.settled.append(record)


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
async def test_random_disconnects_give_exactly_one_record_each(server: str) -> None:
    rng = random.Random(20261129)
    records: list[UsageRecord] = []
    ledger = Ledger()
    with FakeProvider(tokens=120, tokens_per_second=300) as provider:
        # FakeProvider's tokens are words ("tok0 "): count them as its tokenizer would.
        app, _ = make_gateway(
            provider.url,
            sinks=[records.append],
            reservations=ledger,
            tokenizer=lambda text: len(re.findall(r"tok\d+ ", text)),
        )
        with run_server(app, server=server) as srv:

            async def one(i: int) -> str:
                path = rng.choice(["/in-generator", "/detach"])
                how = rng.choice(["bytes", "seconds", "whole", "stall"])
                url = srv.url + path
                if how == "bytes":
                    result = await request(
                        url, method="POST", disconnect_after_bytes=rng.randint(1, 15_000)
                    )
                elif how == "seconds":
                    result = await request(
                        url, method="POST", disconnect_after_seconds=rng.uniform(0.01, 0.5)
                    )
                elif how == "whole":
                    result = await request(url, method="POST")
                else:
                    stalled = await stalled_request(url, method="POST", read_bytes=200)
                    await asyncio.sleep(rng.uniform(0.05, 0.3))
                    await stalled.close()
                    return f"{path} {how} {stalled.headers.get('x-generation-id')}"
                return f"{path} {how} {result.headers.get('x-generation-id')}"

            cases = []
            for batch in range(6):
                cases += await asyncio.gather(*(one(batch * 4 + i) for i in range(4)))
            async with asyncio.timeout(30):
                while len(records) < len(cases) or len(ledger.settled) < len(cases):
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # nothing more may arrive
        upstream = {r.body.get("user"): r for r in provider.requests}
    ids = [r.generation_id for r in records]
    assert len(records) == len(cases) == 24
    assert len(set(ids)) == 24, "one record per request, never two"
    assert ledger.reserved == len(ledger.settled) == 24
    outcomes = sorted({r.outcome for r in records})
    ratios = []
    for record in records:
        assert record.outcome in ("complete", "cancelled"), record
        if record.policy == "cancel" and record.outcome == "cancelled":
            delivered = record.delivered_output_tokens or 0
            if record.generation_id not in upstream:
                # The client left before the gateway's request reached the provider: nothing
                # was generated, so nothing may have been delivered or billed as output.
                assert delivered == 0, record
                assert not record.output_tokens, record
                continue
            billed = upstream[record.generation_id].tokens_sent
            if delivered >= 5:
                ratios.append(billed / delivered)
    print(
        f"{server}: outcomes {outcomes}; under cancel, billed/delivered output tokens over "
        f"{len(ratios)} requests: min {min(ratios):.2f} median {statistics.median(ratios):.2f} "
        f"max {max(ratios):.2f}"
    )
    assert 0.9 <= statistics.median(ratios) < 1.5
