"""The request log line of a request its owner stopped, or a drain ended, and the option's
bad values."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DrainMiddleware, MemoryBackend, MeteringMiddleware, UsageRecord, install
from asgi_disconnect.testing import drive
from asgi_disconnect.testing._driver import lifespan
from tests.apps import eventually

pytestmark = pytest.mark.anyio

EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'
ALICE = [("authorization", "Bearer alice")]


def streaming(
    records: list[UsageRecord], backend: MemoryBackend
) -> tuple[Starlette, DrainMiddleware]:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(500):
            yield EVENT
            await asyncio.sleep(0.01)
        yield b"data: [DONE]\n\n"

    async def chat(request: Request) -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/chat", chat)])
    install(
        app,
        backend=backend,
        sinks=[records.append],
        drain={"signals": False, "deadline": 0.2},
        request_log="json",
    )
    app.middleware_stack = app.build_middleware_stack()
    layer: Any = app.middleware_stack
    while not isinstance(layer, DrainMiddleware):
        layer = layer.app
    return app, layer


def lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        json.loads(r.getMessage()) for r in caplog.records if r.name == "asgi_disconnect.requests"
    ]


async def test_a_stopped_generation_is_logged_cancelled_by_its_owner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_disconnect")
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    app, _ = streaming(records, backend)
    async with lifespan(app):
        stream = asyncio.create_task(drive(app, path="/chat", headers=ALICE))
        await eventually(lambda: backend.recent(1), what="the generation")
        (info,) = await backend.recent(1)
        generation_id = info.id
        stop = await drive(
            app, method="POST", path=f"/generations/{generation_id}/cancel", headers=ALICE
        )
        assert stop.status == 200
        await stream
        await eventually(lambda: records and lines(caplog), what="the record and its line")
    (record,) = records
    (line,) = lines(caplog)
    assert line["generation_id"] == record.generation_id == generation_id
    assert line["end"] == record.outcome == "cancelled"
    assert line["stopped_by"] == record.stopped_by == "owner"
    assert line["policy"] == "cancel"
    assert line["disconnect_reason"] is None
    assert line["output_tokens"] == record.output_tokens


async def test_a_stream_a_drain_ended_is_logged_interrupted_by_the_drain(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="asgi_disconnect")
    records: list[UsageRecord] = []
    app, drain = streaming(records, MemoryBackend())
    async with lifespan(app):
        stream = asyncio.create_task(drive(app, path="/chat"))
        await eventually(lambda: drain.in_flight == 1)
        await drain.drain()
        result = await stream
        await eventually(lambda: records and lines(caplog), what="the record and its line")
    (line,) = lines(caplog)
    assert line["generation_id"] == result.header("x-generation-id")
    assert line["end"] == records[0].outcome == "interrupted"
    assert line["stopped_by"] == records[0].stopped_by == "drain"


@pytest.mark.parametrize("value", ["yes", "JSON", True, 1])
def test_a_request_log_that_is_no_format_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="request_log must be 'text', 'json' or None"):
        MeteringMiddleware(Starlette(), request_log=value)


def record_of(**fields: Any) -> UsageRecord:
    values: dict[str, Any] = {
        "generation_id": "gen_" + "h" * 24,
        "principal": "alice",
        "method": "POST",
        "route": "/report",
        "status_code": 200,
        "provider": None,
        "model": None,
        "outcome": "complete",
        "input_tokens": None,
        "output_tokens": None,
        "usage_source": "none",
        "produced_bytes": 10,
        "delivered_bytes": 0,
        "produced_output_tokens": None,
        "delivered_output_tokens": None,
        "time_to_first_event": None,
        "duration": 1.0,
        "finish_reason": None,
        "error_type": None,
        "started_at": 0.0,
    }
    values.update(fields)
    return UsageRecord(**values)


def text_line(record: UsageRecord, caplog: pytest.LogCaptureFixture) -> str:
    from asgi_disconnect._request_log import log_request

    with caplog.at_level(logging.INFO, logger="asgi_disconnect.requests"):
        log_request("text", record, None)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "asgi_disconnect.requests"]
    return line


def test_detached_work_handed_over_to_another_replica_is_logged_so() -> None:
    """``interrupted``, as its status and record say; ``stopped_by`` says another replica
    finishes it."""
    from asgi_disconnect._contract import Ending, Outcome
    from asgi_disconnect._policy import Policy
    from asgi_disconnect._request_log import fields

    record = record_of(outcome="interrupted", policy="detach", detached=True, stopped_by="handover")
    handed = Outcome(
        ending=Ending.INTERRUPTED,
        policy=Policy.DETACH,
        detached=True,
        delivered_bytes=0,
        delivery="sent",
        produced_bytes=10,
        disconnect_reason="client",
        status=200,
        idempotency=None,
        stopped_by="handover",
    )
    values = fields(record, handed)
    assert (values["end"], values["stopped_by"]) == ("interrupted", "handover")
    assert (values["policy"], values["detached"]) == ("detach", True)


def test_an_estimated_count_is_marked_in_the_text_line(caplog: pytest.LogCaptureFixture) -> None:
    """``billed=~72``: an operator reading or grepping the line sees the figure is the
    package's estimate, not the provider's count."""
    estimated = record_of(
        input_tokens=12, output_tokens=72, delivered_output_tokens=50, usage_source="estimated"
    )
    line = text_line(estimated, caplog)
    assert " tokens in=~12 billed=~72 delivered=~50 usage=estimated " in line
    caplog.clear()
    counted = record_of(
        input_tokens=12, output_tokens=72, delivered_output_tokens=50, usage_source="provider"
    )
    assert " tokens in=12 billed=72 delivered=50 usage=provider " in text_line(counted, caplog)
