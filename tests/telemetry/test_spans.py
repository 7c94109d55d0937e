"""Spans: one per request, one per detached continuation, with the GenAI names."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.trace import SpanKind, StatusCode
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import MemoryBackend, disconnect_policy, install
from asgi_disconnect.testing import drive
from asgi_disconnect.testing._driver import lifespan
from tests.apps import eventually

from .conftest import Telemetry

pytestmark = pytest.mark.anyio

DATA = Path(__file__).parent.parent / "data"
TOKEN = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o-2024-08-06",'
    b'"choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}\n\n'
)
FINISH = (
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o-2024-08-06",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b'data: {"id":"c","object":"chat.completion.chunk","model":"gpt-4o-2024-08-06",'
    b'"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":1000,"total_tokens":1012}}\n\n'
    b"data: [DONE]\n\n"
)


def stream_app(chunks: int = 1000, interval: float = 0.0) -> Starlette:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(chunks):
            yield TOKEN
            if interval:
                await asyncio.sleep(interval)
        yield FINISH

    async def chat(request: Request) -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    @disconnect_policy("detach")
    async def report(request: Request) -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    async def completion(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "object": "chat.completion",
                "model": "gpt-4o-2024-08-06",
                "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            }
        )

    async def boom(request: Request) -> JSONResponse:
        raise RuntimeError("the handler failed")

    async def recorded(request: Request) -> StreamingResponse:
        body = (DATA / "anthropic_messages_basic.sse").read_bytes()
        return StreamingResponse(iter([body]), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/reports", report, methods=["POST"]),
            Route("/v1/messages", recorded, methods=["POST"]),
            Route("/v1/completion", completion),
            Route("/boom", boom),
        ]
    )


def installed(telemetry: Telemetry, app: Starlette | None = None, **options: Any) -> Starlette:
    app = app or stream_app()
    install(
        app,
        backend=MemoryBackend(),
        tracer_provider=telemetry.tracer_provider,
        meter_provider=telemetry.meter_provider,
        **options,
    )
    return app


async def test_a_stream_of_1000_chunks_is_one_span_with_the_genai_attributes(
    telemetry: Telemetry,
) -> None:
    app = installed(telemetry)
    result = await drive(app, method="POST", path="/v1/chat/completions")
    assert result.body.endswith(b"data: [DONE]\n\n")
    assert result.body.count(b"data: ") == 1003

    [span] = telemetry.finished()
    assert span.kind is SpanKind.SERVER
    assert span.name == "POST /v1/chat/completions"
    assert span.parent is None
    attributes = dict(span.attributes or {})
    generation_id = result.header("x-generation-id")
    assert attributes["asgi_disconnect.generation.id"] == generation_id
    assert attributes["http.route"] == "/v1/chat/completions"
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.system"] == "openai"  # v1.36.0 names unless opted in
    assert "gen_ai.provider.name" not in attributes
    assert attributes["gen_ai.response.model"] == "gpt-4o-2024-08-06"
    assert attributes["gen_ai.usage.input_tokens"] == 12
    assert attributes["gen_ai.usage.output_tokens"] == 1000
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert attributes["asgi_disconnect.outcome"] == "complete"
    assert attributes["asgi_disconnect.usage.source"] == "provider"
    assert attributes["asgi_disconnect.produced.bytes"] == len(result.body)
    assert attributes["asgi_disconnect.delivered.bytes"] == len(result.body)
    assert attributes["asgi_disconnect.detached"] is False
    assert "error.type" not in attributes
    assert [event.name for event in span.events] == ["asgi_disconnect.first_event"]
    assert span.status.status_code is StatusCode.UNSET
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.schema_url == "https://opentelemetry.io/schemas/1.36.0"

    genai = {"gen_ai.operation.name": "chat", "gen_ai.system": "openai"}
    assert (
        telemetry.total("gen_ai.client.token.usage", **genai, **{"gen_ai.token.type": "input"})
        == 12
    )
    assert (
        telemetry.total("gen_ai.client.token.usage", **genai, **{"gen_ai.token.type": "output"})
        == 1000
    )
    assert telemetry.count("gen_ai.client.operation.duration", **genai) == 1
    assert telemetry.count("gen_ai.client.operation.time_to_first_chunk", **genai) == 1
    assert telemetry.total("asgi_disconnect.output_tokens.billed") == 1000
    assert telemetry.total("asgi_disconnect.output_tokens.delivered") == 1000
    assert telemetry.total("asgi_disconnect.requests.in_flight") == 0


async def test_the_latest_conventions_are_emitted_when_opted_in(
    telemetry: Telemetry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "http, gen_ai_latest_experimental")
    app = installed(telemetry)
    await drive(app, method="POST", path="/v1/messages")
    [span] = telemetry.finished()
    attributes = dict(span.attributes or {})
    assert attributes["gen_ai.provider.name"] == "anthropic"
    assert "gen_ai.system" not in attributes
    assert attributes["gen_ai.response.model"] == "claude-sonnet-4-5-20250929"
    assert attributes["gen_ai.usage.input_tokens"] == 20
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["gen_ai.response.finish_reasons"] == ("end_turn",)
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.schema_url == "https://opentelemetry.io/schemas/1.44.0"
    assert (
        telemetry.total("gen_ai.client.token.usage", **{"gen_ai.provider.name": "anthropic"}) == 25
    )


async def test_a_cut_stream_under_cancel_tells_billed_from_delivered(
    telemetry: Telemetry,
) -> None:
    app = installed(telemetry, stream_app(chunks=400, interval=0.002))
    result = await drive(
        app, method="POST", path="/v1/chat/completions", disconnect_after_bytes=20 * len(TOKEN)
    )
    assert not result.body.endswith(b"[DONE]\n\n")
    await eventually(telemetry.finished)
    [span] = telemetry.finished()
    attributes = dict(span.attributes or {})
    assert attributes["asgi_disconnect.policy"] == "cancel"
    assert attributes["asgi_disconnect.outcome"] == "cancelled"
    assert attributes["asgi_disconnect.ending"] == "cancelled"
    assert attributes["asgi_disconnect.usage.source"] == "estimated"
    assert "gen_ai.usage.output_tokens" not in attributes  # estimates are not usage
    # Cancel stopped the work where the client left: hardly more produced than delivered.
    produced = attributes["asgi_disconnect.produced.bytes"]
    assert 0 < attributes["asgi_disconnect.delivered.bytes"] <= produced < 100 * len(TOKEN)
    names = [event.name for event in span.events]
    assert names == [
        "asgi_disconnect.first_event",
        "asgi_disconnect.client_disconnect",
        "asgi_disconnect.cancelled",
    ]
    assert span.status.status_code is StatusCode.UNSET  # the client left: not a failure
    assert (
        telemetry.total(
            "asgi_disconnect.requests.cancelled", **{"asgi_disconnect.policy": "cancel"}
        )
        == 1
    )
    assert telemetry.total("asgi_disconnect.requests.disconnected") == 1
    billed = telemetry.total("asgi_disconnect.output_tokens.billed")
    delivered = telemetry.total("asgi_disconnect.output_tokens.delivered")
    assert 0 < delivered <= billed


async def test_detached_work_gets_a_continuation_span_linked_to_its_request(
    telemetry: Telemetry,
) -> None:
    app = installed(telemetry, stream_app(chunks=200, interval=0.002))
    async with lifespan(app):
        result = await drive(
            app, method="POST", path="/v1/reports", disconnect_after_bytes=10 * len(TOKEN)
        )
        await eventually(lambda: len(telemetry.finished()) == 2)
    request, continuation = telemetry.finished()
    assert request.name == "POST /v1/reports"
    assert [event.name for event in request.events] == [
        "asgi_disconnect.first_event",
        "asgi_disconnect.client_disconnect",
        "asgi_disconnect.detached",
    ]
    assert dict(request.attributes or {})["asgi_disconnect.detached"] is True
    assert "gen_ai.usage.output_tokens" not in dict(request.attributes or {})

    assert continuation.name == "detached POST /v1/reports"
    assert continuation.kind is SpanKind.INTERNAL
    assert continuation.parent is not None
    assert continuation.parent.span_id == request.context.span_id
    assert [link.context.span_id for link in continuation.links] == [request.context.span_id]
    assert continuation.start_time is not None
    assert request.end_time is not None
    assert continuation.start_time <= request.end_time < continuation.end_time  # type: ignore[operator]
    attributes = dict(continuation.attributes or {})
    assert attributes["asgi_disconnect.generation.id"] == result.header("x-generation-id")
    assert attributes["asgi_disconnect.generation.status"] == "complete"
    assert attributes["asgi_disconnect.outcome"] == "complete"
    assert attributes["gen_ai.usage.output_tokens"] == 1000
    assert telemetry.total("asgi_disconnect.generations.detached") == 1
    assert telemetry.total("asgi_disconnect.generations.detach_completed") == 1


async def test_an_app_that_raises_makes_an_error_span(telemetry: Telemetry) -> None:
    app = installed(telemetry)
    with pytest.raises(RuntimeError):
        await drive(app, path="/boom")
    [span] = telemetry.finished()
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "RuntimeError"
    assert "exception" in [event.name for event in span.events]


async def test_the_callers_traceparent_is_the_parent_and_a_bad_one_is_ignored(
    telemetry: Telemetry,
) -> None:
    app = installed(telemetry)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    await drive(app, method="POST", path="/v1/messages", headers=[("traceparent", parent)])
    for bad in ("00-zz-b7ad6b7169203331-01", "00-" + "0" * 32 + "-b7ad6b7169203331-01", "x" * 600):
        result = await drive(
            app, method="POST", path="/v1/messages", headers=[("traceparent", bad)]
        )
        assert result.status == 200
    first, *others = telemetry.finished()
    assert first.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert first.parent is not None
    assert first.parent.span_id == 0xB7AD6B7169203331
    assert first.parent.is_remote
    for span in others:
        assert span.parent is None  # a new trace, the request served as usual
        assert span.context.trace_id != first.context.trace_id


async def test_under_the_asgi_instrumentation_the_span_nests_in_its_span(
    telemetry: Telemetry,
) -> None:
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    app = OpenTelemetryMiddleware(
        installed(telemetry),
        tracer_provider=telemetry.tracer_provider,
        meter_provider=telemetry.meter_provider,
        exclude_spans=["receive", "send"],
    )
    result = await drive(app, method="POST", path="/v1/chat/completions")
    assert result.status == 200
    await eventually(lambda: len(telemetry.finished()) == 2)
    [outer] = [
        span
        for span in telemetry.finished()
        if span.instrumentation_scope.name != "asgi_disconnect"
    ]  # type: ignore[union-attr]
    [ours] = [span for span in telemetry.finished() if span is not outer]
    assert outer.kind is SpanKind.SERVER
    assert ours.kind is SpanKind.INTERNAL
    assert ours.parent is not None
    assert ours.parent.span_id == outer.context.span_id
    assert ours.context.trace_id == outer.context.trace_id
    assert dict(ours.attributes or {})["gen_ai.usage.output_tokens"] == 1000


async def test_a_drain_shows_on_the_span_of_the_stream_it_ended(telemetry: Telemetry) -> None:
    from asgi_disconnect import DrainMiddleware

    app = installed(telemetry, stream_app(chunks=500, interval=0.01), drain={"signals": False})
    app.middleware_stack = app.build_middleware_stack()
    drain: Any = app.middleware_stack
    while not isinstance(drain, DrainMiddleware):
        drain = drain.app
    async with lifespan(app):
        stream = asyncio.create_task(drive(app, method="POST", path="/v1/chat/completions"))
        await eventually(lambda: drain.in_flight == 1)
        await drain.drain(0.2)
        result = await stream
        refused = await drive(app, method="POST", path="/v1/chat/completions")
    assert b'"type":"interrupted","message":"The server is draining' in result.body
    assert b'"stopped_by":"drain"' in result.body
    assert refused.status == 503
    ended, refusal = telemetry.finished()
    assert "asgi_disconnect.drained" in [event.name for event in ended.events]
    attributes = dict(ended.attributes or {})
    assert attributes["asgi_disconnect.generation.status"] == "interrupted"
    assert attributes["error.type"] == "interrupted"
    assert ended.status.status_code is StatusCode.ERROR
    assert dict(refusal.attributes or {})["http.response.status_code"] == 503
    assert telemetry.total("asgi_disconnect.generations.interrupted") == 1


async def test_a_failing_span_processor_fails_no_request(
    telemetry: Telemetry, caplog: pytest.LogCaptureFixture
) -> None:
    from opentelemetry.sdk.trace import SpanProcessor

    class Broken(SpanProcessor):
        def on_end(self, span: Any) -> None:
            raise RuntimeError("the exporter's bug")

    telemetry.tracer_provider.add_span_processor(Broken())
    app = installed(telemetry)
    result = await drive(app, method="POST", path="/v1/messages")
    assert result.status == 200
    assert b"event: message_stop" in result.body  # the answer, whole
    assert "recording the request's telemetry failed" in caplog.text
