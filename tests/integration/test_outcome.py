"""How an exchange went, as the other middlewares read it: one frozen ``Outcome`` per
request, published once when the exchange ends (``RequestState.on_end``), on uvicorn with
``install()`` (idempotency, drain, a SQLite store) under real disconnects. It agrees with the
usage record metering emits for the same request."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from asgi_disconnect import Ending, Outcome, Policy, RequestState, UsageRecord, connect, install
from asgi_disconnect.testing import request, run_server
from tests.apps import Probe, as_tester, eventually, sse_app

pytestmark = [pytest.mark.anyio, pytest.mark.server]


class Outcomes:
    """Outermost: each request's outcome by generation id, through on_end."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: dict[str, list[Outcome]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            state = scope["asgi_disconnect"] = RequestState(f"gen_o{len(self.seen)}", "tester")
            self.seen[state.generation_id] = []
            state.on_end(self.seen[state.generation_id].append)
        await self.app(scope, receive, send)


async def test_each_request_ends_in_one_outcome_that_agrees_with_its_usage_record(
    tmp_path: Path,
) -> None:
    probe = Probe()
    app = sse_app(probe, chunks=40, delay=0.02)
    records: list[UsageRecord] = []
    install(
        app,
        backend=connect(f"sqlite:///{tmp_path / 'o.db'}"),
        idempotency=True,
        drain={"signals": False, "drain_token": "op"},
        principal=as_tester,
        sinks=[records.append],
    )
    outcomes = Outcomes(app)
    with run_server(outcomes, server="uvicorn") as server:
        whole = await request(f"{server.url}/cancel")
        cut = await request(f"{server.url}/cancel", disconnect_after_bytes=60)
        left = await request(f"{server.url}/detach", disconnect_after_bytes=60)
        await eventually(
            lambda: len(records) == 3 and all(outcomes.seen.values()),
            timeout=10,
            what="three records and three outcomes",
        )
        await asyncio.sleep(0.2)  # nothing more may arrive
    assert whole.complete
    assert cut.stopped_by == left.stopped_by == "disconnect_after_bytes"
    by_id = {record.generation_id: record for record in records}
    ended = {}
    for generation_id, seen in outcomes.seen.items():
        (outcome,) = seen  # once
        ended[generation_id] = outcome
        record = by_id[generation_id]
        assert outcome.delivered_bytes == record.delivered_bytes
        assert outcome.delivery == record.delivery
        assert outcome.detached is record.detached
        assert (outcome.policy.value if outcome.policy else None) == record.policy
        assert outcome.status == record.status_code == 200
    first, second, third = (ended[f"gen_o{i}"] for i in range(3))
    assert first.ending is Ending.DELIVERED
    assert first.policy is Policy.CANCEL  # the route's, though nobody left
    assert first.disconnect_reason is None
    assert first.delivered_bytes == first.produced_bytes == len(whole.body)
    assert second.ending is Ending.CANCELLED
    assert second.policy is Policy.CANCEL
    assert second.disconnect_reason == "client"
    assert second.delivered_bytes < first.produced_bytes
    assert third.policy is Policy.DETACH
    assert third.detached is True
    assert third.disconnect_reason == "client"
    assert third.produced_bytes == first.produced_bytes  # the work went on to its end
    assert third.delivered_bytes < third.produced_bytes
