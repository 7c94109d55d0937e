"""Telemetry through the whole stack on PostgreSQL: idempotency outcomes, a client that
leaves, and the store going down, each visible on the request's span and in the counters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import connect, install
from asgi_disconnect.testing import request, run_server
from tests.faults.cluster import Cluster

pytestmark = [pytest.mark.anyio, pytest.mark.server]

EVENT = b'data: {"object":"chat.completion.chunk","choices":[{"delta":{"content":"tok"}}]}\n\n'


def app_with_telemetry(url: str) -> tuple[Starlette, InMemorySpanExporter, InMemoryMetricReader]:
    async def body(events: int) -> AsyncIterator[bytes]:
        for _ in range(events):
            yield EVENT
            await asyncio.sleep(0.005)
        yield b"data: [DONE]\n\n"

    async def chat(request: Request) -> StreamingResponse:
        events = int(request.query_params.get("events", "5"))
        return StreamingResponse(body(events), media_type="text/event-stream")

    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    app = Starlette(routes=[Route("/chat", chat, methods=["POST"])])
    install(
        app,
        backend=connect(url),
        idempotency=True,
        tracer_provider=tracer_provider,
        meter_provider=MeterProvider(metric_readers=[reader]),
    )
    return app, spans, reader


def outcomes(reader: InMemoryMetricReader) -> dict[str, int]:
    found: dict[str, int] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "asgi_disconnect.idempotency.requests":
                    for point in metric.data.data_points:
                        outcome = str(point.attributes["asgi_disconnect.idempotency.outcome"])
                        found[outcome] = found.get(outcome, 0) + int(point.value)
    return found


async def test_idempotency_outcomes_a_disconnect_and_a_store_outage_are_told_apart(
    cluster: Cluster, fault_url: str
) -> None:
    app, spans, reader = app_with_telemetry(fault_url)
    auth = {"authorization": "Bearer alice", "content-type": "application/json"}
    with run_server(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            first = await client.post(
                "/chat", content=b"{}", headers={**auth, "idempotency-key": "k1"}
            )
            again = await client.post(
                "/chat", content=b"{}", headers={**auth, "idempotency-key": "k1"}
            )
            other = await client.post(
                "/chat",
                content=b"{}",
                headers={**auth, "idempotency-key": "k1"} | {"x": "1"},
                params={"n": "2"},
            )
            assert first.status_code == again.status_code == 200
            assert again.headers["idempotent-replayed"] == "true"
            assert again.content == first.content
            assert other.status_code == 422
            cut = await request(
                f"{server.url}/chat?events=400",
                method="POST",
                headers={**auth, "idempotency-key": "k2"},
                body=b"{}",
                disconnect_after_bytes=10 * len(EVENT),
            )
            assert cut.status == 200
            cluster.stop()
            try:
                down = await client.post(
                    "/chat", content=b"{}", headers={**auth, "idempotency-key": "k3"}
                )
            finally:
                cluster.start()
            assert down.status_code == 503
            assert down.headers["content-type"] == "application/problem+json"
            async with asyncio.timeout(10):
                while len(spans.get_finished_spans()) < 5:
                    await asyncio.sleep(0.02)
    assert outcomes(reader) == {"fresh": 2, "replayed": 1, "mismatch": 1, "unavailable": 1}
    by_outcome = {}
    for span in spans.get_finished_spans():
        attributes = dict(span.attributes or {})
        by_outcome.setdefault(attributes["asgi_disconnect.idempotency.outcome"], []).append(span)
    [unavailable] = by_outcome["unavailable"]
    assert dict(unavailable.attributes or {})["http.response.status_code"] == 503
    assert unavailable.status.status_code is StatusCode.ERROR
    [mismatch] = by_outcome["mismatch"]
    assert dict(mismatch.attributes or {})["http.response.status_code"] == 422
    cancelled = [
        span for span in by_outcome["fresh"]
        if "asgi_disconnect.client_disconnect" in [event.name for event in span.events]
    ]  # fmt: skip
    assert len(cancelled) == 1
    assert dict(cancelled[0].attributes or {})["asgi_disconnect.outcome"] == "cancelled"
