"""Spans and metrics leave over real OTLP/HTTP: a receiver on loopback decodes the protobuf
payloads the SDK's exporters post, as a collector would, and checks what arrived."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from asgi_disconnect import MemoryBackend, install
from asgi_disconnect.testing import request, run_server

from .test_spans import TOKEN, stream_app

pytestmark = [pytest.mark.anyio, pytest.mark.server]


class Receiver:
    """An OTLP/HTTP endpoint: the decoded export requests, by signal."""

    def __init__(self) -> None:
        self.traces: list[ExportTraceServiceRequest] = []
        self.metrics: list[ExportMetricsServiceRequest] = []
        self.content_types: set[str] = set()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.content_types.add(self.headers["content-type"])
                if self.path == "/v1/traces":
                    receiver.traces.append(ExportTraceServiceRequest.FromString(body))
                elif self.path == "/v1/metrics":
                    receiver.metrics.append(ExportMetricsServiceRequest.FromString(body))
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def spans(self) -> list[Any]:
        return [
            span
            for export in self.traces
            for resource in export.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]

    def metric(self, name: str) -> list[Any]:
        return [
            metric
            for export in self.metrics
            for resource in export.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == name
        ]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


def attributes(item: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for pair in item.attributes:
        value = pair.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            found[pair.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            found[pair.key] = getattr(value, kind)
    return found


async def test_spans_and_metrics_arrive_over_otlp_http(receiver: Receiver) -> None:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces"))
    )
    meter_provider = MeterProvider(
        metric_readers=[
            PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=f"{receiver.url}/v1/metrics"),
                export_interval_millis=3_600_000,  # only the flush at shutdown exports
            )
        ]
    )
    app = stream_app(chunks=50, interval=0.002)
    install(
        app,
        backend=MemoryBackend(),
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
    )
    try:
        with run_server(app) as server:
            whole = await request(f"{server.url}/v1/chat/completions", method="POST")
            cut = await request(
                f"{server.url}/v1/chat/completions",
                method="POST",
                disconnect_after_bytes=5 * len(TOKEN),
            )
            assert whole.body.endswith(b"data: [DONE]\n\n")
            assert not cut.body.endswith(b"data: [DONE]\n\n")
            await asyncio.sleep(0.3)  # the cut request's teardown, server side
        # The server's shutdown flushed both providers: the receiver holds everything.
        assert receiver.content_types == {"application/x-protobuf"}
        spans = receiver.spans()
        assert len(spans) == 2
        by_id = {attributes(span)["asgi_disconnect.generation.id"]: span for span in spans}
        complete = by_id[whole.headers["x-generation-id"]]
        cancelled = by_id[cut.headers["x-generation-id"]]
        assert complete.name == "POST /v1/chat/completions"
        assert complete.kind == complete.SPAN_KIND_SERVER
        found = attributes(complete)
        assert found["gen_ai.operation.name"] == "chat"
        assert found["gen_ai.usage.output_tokens"] == 1000
        assert found["gen_ai.response.finish_reasons"] == ["stop"]
        assert found["asgi_disconnect.outcome"] == "complete"
        assert [event.name for event in complete.events] == ["asgi_disconnect.first_event"]
        assert attributes(cancelled)["asgi_disconnect.outcome"] == "cancelled"
        assert [event.name for event in cancelled.events] == [
            "asgi_disconnect.first_event",
            "asgi_disconnect.client_disconnect",
            "asgi_disconnect.cancelled",
        ]

        [usage] = receiver.metric("gen_ai.client.token.usage")
        points = {attributes(p)["gen_ai.token.type"]: p for p in usage.histogram.data_points}
        assert points["output"].sum == 1000
        assert points["output"].count == 1
        assert points["input"].sum == 12
        [duration] = receiver.metric("gen_ai.client.operation.duration")
        assert duration.unit == "s"
        assert sum(p.count for p in duration.histogram.data_points) == 2
        [cancelled_count] = receiver.metric("asgi_disconnect.requests.cancelled")
        assert cancelled_count.sum.is_monotonic
        assert sum(p.as_int for p in cancelled_count.sum.data_points) == 1
        [billed] = receiver.metric("asgi_disconnect.output_tokens.billed")
        [delivered] = receiver.metric("asgi_disconnect.output_tokens.delivered")
        billed_total = sum(p.as_int for p in billed.sum.data_points)
        delivered_total = sum(p.as_int for p in delivered.sum.data_points)
        assert billed_total > 1000
        assert 1000 < delivered_total <= billed_total
        [in_flight] = receiver.metric("asgi_disconnect.requests.in_flight")
        assert not in_flight.sum.is_monotonic
        assert [p.as_int for p in in_flight.sum.data_points] == [0]
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()
