"""Metering holds a bounded window of a body, whatever the size of one event or one JSON
document, and still finds the provider's usage and the terminal marker: a 10 MB SSE event
and a 50 MB JSON body, measured with tracemalloc while they pass."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import MeteringMiddleware, UsageRecord
from asgi_disconnect.metering import StreamMeter

pytestmark = pytest.mark.anyio

CHUNK = 64 << 10


def big_event(size: int) -> Iterator[bytes]:
    """An OpenAI Responses-like stream whose second event carries ``size`` bytes of base64,
    made chunk by chunk (never held whole)."""
    yield (
        b"event: response.output_text.delta\n"
        b'data: {"type":"response.output_text.delta","delta":"hi"}\n\n'
    )
    yield b'event: response.image\ndata: {"type":"response.image","b64":"'
    for _ in range(size // CHUNK):
        yield b"A" * CHUNK
    yield b'"}\n\n'
    yield (
        b'event: response.completed\ndata: {"type":"response.completed","response":'
        b'{"status":"completed","usage":{"input_tokens":50,"output_tokens":1500}}}\n\n'
    )


def test_a_10_mb_event_is_skipped_in_a_bounded_window_and_the_usage_found() -> None:
    meter = StreamMeter()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for chunk in big_event(10 << 20):
            meter.feed(chunk)
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    report = meter.report()
    assert report.skipped_events == 1
    assert report.error is None
    assert report.terminal_marker_seen
    assert (report.input_tokens, report.output_tokens) == (50, 1500)
    assert peak < 3 << 20, f"metering held {peak:,} bytes of a 10 MB event"


def json_body(size: int) -> Iterator[bytes]:
    """An embeddings batch of about ``size`` bytes, usage last, made chunk by chunk."""
    yield b'{"object":"list","model":"text-embedding-3-small","data":['
    row = b'{"object":"embedding","index":0,"embedding":[' + b"0.0123," * 1500 + b"0.1]},"
    for _ in range(size // len(row) + 1):
        yield row
    yield b'{"object":"embedding","index":1,"embedding":[0.1]}],'
    yield b'"usage":{"prompt_tokens":4096,"total_tokens":4096}}'


async def call_discarding_the_body(app: Any, path: str) -> tuple[int, int]:
    """One POST through ``app``; the response's status and its body's size, the body itself
    counted and dropped (a test driver that kept it would hold the 50 MB)."""
    status = 0
    size = 0
    requested = False

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, size
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            size += len(message.get("body", b""))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
    }
    async with asyncio.timeout(60):
        await app(scope, receive, send)
    return status, size


async def test_a_50_mb_json_body_is_read_by_its_ends_in_a_bounded_window() -> None:
    records: list[UsageRecord] = []

    async def embeddings(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for chunk in json_body(50 << 20):
                yield chunk

        return StreamingResponse(body(), media_type="application/json")

    app = MeteringMiddleware(
        Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])]),
        sinks=[records.append],
    )

    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        status, size = await call_discarding_the_body(app, "/v1/embeddings")
        peak = tracemalloc.get_traced_memory()[1] - baseline
    finally:
        tracemalloc.stop()
    assert status == 200
    assert size > 50 << 20
    (record,) = records
    assert record.outcome == "complete"
    assert record.usage_source == "provider"
    assert record.input_tokens == 4096
    assert record.model == "text-embedding-3-small"
    assert record.produced_bytes > 50 << 20
    assert peak < 16 << 20, f"metering held {peak:,} bytes of a 50 MB body"


def image_completed(size: int, newline: bytes = b"\n") -> list[bytes]:
    """An OpenAI Responses stream with an image tool: its terminal ``response.completed``
    carries the whole output, the image's ``size`` bytes of base64, before the usage."""
    n = newline
    return [
        b"event: response.created" + n + b'data: {"type":"response.created","response":'
        b'{"id":"resp_1","object":"response","status":"in_progress","model":"gpt-image"}}'
        + n + n,
        # More events than metering reads as they are produced: the end is read from the log.
        *[
            b"event: response.output_text.delta" + n
            + b'data: {"type":"response.output_text.delta","delta":"' + word + b'"}' + n + n
            for word in b"Here it is, as you asked .".split()
        ],
        b"event: response.completed" + n + b'data: {"type":"response.completed",'
        b'"sequence_number":9,"response":{"id":"resp_1","object":"response",'
        b'"status":"completed","model":"gpt-image","output":[{"type":"image_generation_call",'
        b'"result":"' + b"QUJD" * (size // 4) + b'"}],"usage":{"input_tokens":12,'
        b'"output_tokens":1500,"output_tokens_details":{"reasoning_tokens":0}}}}' + n + n,
    ]  # fmt: skip


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
@pytest.mark.parametrize("piece", [None, 1 << 20, 65536, 4099])
def test_a_terminal_event_over_the_window_is_read_by_its_ends(
    piece: int | None, newline: bytes
) -> None:
    """1.5 MB of base64 in the terminal event: its type says the stream is complete, its
    tail has the provider's usage, whatever the chunks (the whole stream in one included)."""
    stream = b"".join(image_completed(1_500_000, newline))
    meter = StreamMeter()
    size = piece or len(stream)
    for start in range(0, len(stream), size):
        meter.feed(stream[start : start + size])
    report = meter.report()
    assert report.error is None
    assert report.skipped_events == 1
    assert report.terminal_marker_seen
    assert report.finish_reason == "completed"
    assert (report.input_tokens, report.output_tokens) == (12, 1500)
    assert report.usage_source == "provider"
    assert report.text == "Hereitis,asyouasked."


async def test_through_the_stack_a_terminal_event_over_the_window_completes_and_replays() -> None:
    """Through ``install()`` with idempotency: the stream is stored ``complete`` with the
    provider's usage, not ``truncated`` with an estimate, and a retry with the same key is a
    replay: the upstream runs once."""
    from asgi_disconnect import MemoryBackend, install
    from asgi_disconnect.testing import drive
    from asgi_disconnect.testing._driver import lifespan

    records: list[UsageRecord] = []
    runs = 0

    async def responses(request: Request) -> StreamingResponse:
        nonlocal runs
        runs += 1

        async def body() -> AsyncIterator[bytes]:
            stream = b"".join(image_completed(1_500_000))
            for start in range(0, len(stream), CHUNK):
                yield stream[start : start + CHUNK]

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/responses", responses, methods=["POST"])])
    install(app, backend=MemoryBackend(), sinks=[records.append], idempotency=True)
    headers = [
        ("idempotency-key", "image-1"),
        ("content-type", "application/json"),
        ("authorization", "Bearer alice"),
    ]
    async with lifespan(app):
        first = await drive(app, method="POST", path="/v1/responses", headers=headers, body=b"{}")
        again = await drive(app, method="POST", path="/v1/responses", headers=headers, body=b"{}")
    assert first.status == again.status == 200
    assert again.body == first.body
    assert runs == 1
    (record,) = records
    assert record.outcome == "complete"
    assert record.usage_source == "provider"
    assert (record.input_tokens, record.output_tokens) == (12, 1500)
