"""The apps the benchmarks serve: the same Starlette routes, bare and wrapped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, disconnect_policy

SSE_EVENTS = 1000
_EVENT = b'data: {"choices":[{"delta":{"content":"token"}}]}\n\n'


async def small_json(request: object) -> JSONResponse:
    return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "ok": True})


async def app_json(request: object) -> JSONResponse:
    """The app's own JSON (a health check, say): no LLM exchange, so no generation."""
    return JSONResponse({"ok": True, "status": "healthy"})


# An OpenAI chat stream as a provider sends it when asked for usage: the model in every
# chunk, a finish chunk, the usage chunk and [DONE] (what open_stream(ask_for_usage=True)
# makes of every stream). /sse above is a stream without usage or terminal marker: its
# record is an estimate, for which metering reads the whole text.
_LLM_CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
    b'"model":"bench-model","choices":[{"index":0,"delta":{"content":"%s"},'
    b'"finish_reason":null}]}\n\n'
)
_LLM_FIRST = _LLM_CHUNK.replace(b'"content":"%s"', b'"role":"assistant","content":""')
_LLM_EVENT = _LLM_CHUNK % b"token"
_LLM_END = (
    _LLM_CHUNK.replace(
        b'"delta":{"content":"%s"},"finish_reason":null', b'"delta":{},"finish_reason":"stop"'
    )
    + b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,'
    b'"model":"bench-model","choices":[],"usage":{"prompt_tokens":12,'
    b'"completion_tokens":1000,"total_tokens":1012}}\n\n'
    b"data: [DONE]\n\n"
)


async def _llm_events():  # type: ignore[no-untyped-def]
    yield _LLM_FIRST
    for _ in range(SSE_EVENTS):
        yield _LLM_EVENT
    yield _LLM_END


async def sse_llm(request: object) -> StreamingResponse:
    return StreamingResponse(_llm_events(), media_type="text/event-stream")


async def _events():  # type: ignore[no-untyped-def]
    for _ in range(SSE_EVENTS):
        yield _EVENT


async def _paced_events():  # type: ignore[no-untyped-def]
    # As a relay does: every chunk comes after a trip through the event loop.
    for _ in range(SSE_EVENTS):
        yield _EVENT
        await asyncio.sleep(0)


async def sse(request: object) -> StreamingResponse:
    return StreamingResponse(_events(), media_type="text/event-stream")


async def sse_paced(request: object) -> StreamingResponse:
    return StreamingResponse(_paced_events(), media_type="text/event-stream")


@disconnect_policy("detach")
async def sse_paced_detach(request: object) -> StreamingResponse:
    """The same paced stream on a route that detaches: it always runs supervised (the app
    in a task of its own, so that it can outlive its request)."""
    return StreamingResponse(_paced_events(), media_type="text/event-stream")


def make_app() -> Starlette:
    return Starlette(
        routes=[
            Route("/json", small_json),
            Route("/app-json", app_json),
            Route("/sse", sse),
            Route("/sse-llm", sse_llm),
            Route("/sse-paced", sse_paced),
            Route("/sse-paced-detach", sse_paced_detach),
        ]
    )


bare_app = make_app()
logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
# A durable backend keeps no finished generation in memory once it is flushed; the memory
# backend here keeps the last thousand (each stream's log holds 1,000 chunks), evicting the
# oldest an eighth at a time as it would in production.
wrapped_app = DisconnectMiddleware(make_app(), backend=MemoryBackend(max_generations=1000))
# The same without the transport's watch (client_timeout=None): what judging the client by
# what its TCP acknowledged costs, the difference of the two rows.
untimed_app = DisconnectMiddleware(
    make_app(), backend=MemoryBackend(max_generations=1000), client_timeout=None
)


def installed_app() -> Starlette:
    """What users add: ``install()``, DisconnectMiddleware and MeteringMiddleware together."""
    from asgi_disconnect import install

    app = make_app()
    install(app, backend=MemoryBackend(max_generations=1000))
    return app


# Peers, for scale (``pip install -e '.[bench]'``); each is built when asked for.


def correlation_app() -> object:
    """asgi-correlation-id: one request-id header per request."""
    from asgi_correlation_id import CorrelationIdMiddleware

    return CorrelationIdMiddleware(make_app())


def _tracer_provider(sampler: Any = None) -> object:
    """An SDK tracer provider whose spans are batched and dropped, as an exporter's would be
    batched and sent: the spans are made and ended; nothing leaves the process."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Drop(SpanExporter):
        def export(self, spans: object) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider(sampler=sampler) if sampler is not None else TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    return provider


def _meter_provider() -> object:
    """An SDK meter provider with a periodic reader whose exports are dropped."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import (
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )

    class Drop(MetricExporter):
        def export(self, metrics_data: object, **kwargs: object) -> MetricExportResult:
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
            pass

    return MeterProvider(metric_readers=[PeriodicExportingMetricReader(Drop())])


def installed_telemetry_app(sampler: object = None) -> Starlette:
    """``install()`` with telemetry on: real SDK providers, spans through a batch processor."""
    from asgi_disconnect import install

    tracer_provider = _tracer_provider(sampler)
    app = make_app()
    install(
        app,
        backend=MemoryBackend(max_generations=1000),
        tracer_provider=tracer_provider,
        meter_provider=_meter_provider(),
    )
    return app


def installed_telemetry_sampled_app() -> Starlette:
    """The same, keeping one trace in a hundred (``ParentBased(TraceIdRatioBased(0.01))``),
    as a busy gateway would: unsampled requests make no span, metrics stay whole."""
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    return installed_telemetry_app(ParentBased(TraceIdRatioBased(0.01)))


def otel_app() -> object:
    """opentelemetry-instrumentation-asgi with its defaults (a span per send and receive)."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    return OpenTelemetryMiddleware(make_app(), tracer_provider=_tracer_provider())


def otel_request_only_app() -> object:
    """The same, ``exclude_spans=["receive", "send"]``: one span per request."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    return OpenTelemetryMiddleware(
        make_app(), tracer_provider=_tracer_provider(), exclude_spans=["receive", "send"]
    )


# name -> (uvicorn app spec, whether uvicorn calls it as a factory)
APPS: dict[str, tuple[str, bool]] = {
    "bare": ("benchmarks.apps:bare_app", False),
    "correlation-id": ("benchmarks.apps:correlation_app", True),
    "otel": ("benchmarks.apps:otel_app", True),
    "otel-request-span": ("benchmarks.apps:otel_request_only_app", True),
    "disconnect": ("benchmarks.apps:wrapped_app", False),
    "disconnect-untimed": ("benchmarks.apps:untimed_app", False),
    "install": ("benchmarks.apps:installed_app", True),
    "install-telemetry": ("benchmarks.apps:installed_telemetry_app", True),
    "install-telemetry-sampled": ("benchmarks.apps:installed_telemetry_sampled_app", True),
}
