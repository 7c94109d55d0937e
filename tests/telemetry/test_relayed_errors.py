"""A provider's refusal relayed as the quickstart does (its status, its JSON error body) is
one usage record, outcome ``error``, with the provider's error type and the HTTP status,
and its span carries ``error.type``: through ``install()`` with idempotency and drain, on
uvicorn, against FakeProvider."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from asgi_disconnect import UsageRecord
from asgi_disconnect.testing import FakeProvider, run_server
from tests.integration.silent_app import gateway

from .conftest import Telemetry

pytestmark = [pytest.mark.anyio, pytest.mark.server]

BODY = json.dumps(
    {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
).encode()
# What FakeProvider says for each status, as OpenAI does.
KINDS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    429: "requests",
    500: "server_error",
}


@pytest.mark.parametrize("status", sorted(KINDS))
async def test_a_relayed_refusal_is_one_error_record_and_an_error_span(
    status: int, tmp_path: Path, telemetry: Telemetry
) -> None:
    records: list[UsageRecord] = []
    with FakeProvider(tokens=5) as provider:
        app = gateway(
            provider.url,
            records,
            tmp_path / "g.db",
            tracer_provider=telemetry.tracer_provider,
            meter_provider=telemetry.meter_provider,
        )
        with run_server(app, server="uvicorn") as server:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                answer = await client.post(
                    "/v1/chat/completions",
                    content=BODY,
                    headers={
                        "authorization": "Bearer alice",
                        "content-type": "application/json",
                        "x-fake-fault": f"status={status}",
                    },
                )
                assert answer.status_code == status
                assert answer.json()["error"]["type"] == KINDS[status]
                async with asyncio.timeout(10):
                    while not records:
                        await asyncio.sleep(0.02)
    (record,) = records
    assert record.outcome == "error"
    assert record.status_code == status
    assert record.error_type == KINDS[status]
    assert record.generation_id == answer.headers["x-generation-id"]
    (span,) = [s for s in telemetry.finished() if s.attributes and "error.type" in s.attributes]
    assert span.attributes is not None
    assert span.attributes["error.type"] == KINDS[status]
