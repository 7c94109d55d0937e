"""open_stream through install() on uvicorn, against FakeProvider and a silent upstream.

A refused request reaches the client as that status, before any byte; a first event that
does not come, a silence between events, a body cut short and a provider's error event
each end the client's stream with one error frame of a stable type, never a `complete`
generation, and exactly one usage record saying so; slow but steady events are never cut;
the upstream connection is closed every time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import MemoryBackend, UsageRecord, install, metered
from asgi_disconnect.testing import FakeProvider, request, run_server
from asgi_disconnect.upstream import UpstreamStatusError, open_stream

pytestmark = [pytest.mark.anyio, pytest.mark.server]

BODY = {
    "model": "fake-model",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "hi"}],
}


def gateway(
    upstream_url: str,
    records: list[UsageRecord],
    backend: MemoryBackend,
    library: Any = httpx,
    **timeouts: float,
) -> Starlette:
    client = library.AsyncClient(base_url=upstream_url, timeout=library.Timeout(None))

    @metered()
    async def chat(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.startswith("x-fake-")}
        outgoing = client.build_request("POST", "/v1/chat/completions", json=BODY, headers=headers)
        try:
            upstream = await open_stream(client, outgoing, **timeouts)
        except UpstreamStatusError as exc:
            return JSONResponse(exc.error, status_code=exc.status_code)
        return StreamingResponse(upstream, media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(routes=[Route("/chat", chat, methods=["POST"])], lifespan=lifespan)
    install(app, backend=backend, sinks=[records.append])
    return app


async def settled(records: list[UsageRecord]) -> UsageRecord:
    async with asyncio.timeout(10):
        while not records:
            await asyncio.sleep(0.02)
    await asyncio.sleep(0.2)
    (record,) = records
    return record


def frames(body: bytes) -> list[dict[str, Any]]:
    found = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"event: error\ndata: "):
            data = block.split(b"data: ", 1)[1]
            found.append(msgspec.json.decode(data))
    return found


async def relay(
    fault: str | None, **timeouts: float
) -> tuple[Any, UsageRecord, Any, MemoryBackend, Callable[[], Any]]:
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    with FakeProvider(tokens=10, tokens_per_second=100) as provider:
        app = gateway(provider.url, records, backend, **timeouts)
        with run_server(app) as server:
            headers = {"x-fake-fault": fault} if fault else {}
            result = await request(f"{server.url}/chat", method="POST", headers=headers)
            (upstream,) = await provider.await_requests(1)
            assert await upstream.await_closed(timeout=5), "the upstream was left open"
            record = await settled(records)
    info = None
    generation_id = result.headers.get("x-generation-id")
    if generation_id is not None:
        info = await backend.get(generation_id)
    return result, record, info, backend, lambda: upstream


async def test_a_whole_stream_is_relayed_as_it_is() -> None:
    result, record, info, _, _ = await relay(None, first_token_timeout=5, idle_timeout=5)
    assert result.status == 200
    assert result.body.endswith(b"data: [DONE]\n\n")
    assert frames(result.body) == []
    assert info.status == "complete"
    assert record.outcome == "complete"
    assert record.usage_source == "provider"


@pytest.mark.parametrize("fault", [None, "truncate-after=3", "status=429"])
async def test_httpx2_clients_are_watched_alike(fault: str | None) -> None:
    httpx2 = pytest.importorskip("httpx2")
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    with FakeProvider(tokens=10, tokens_per_second=100) as provider:
        app = gateway(provider.url, records, backend, library=httpx2, idle_timeout=5)
        with run_server(app) as server:
            headers = {"x-fake-fault": fault} if fault else {}
            result = await request(f"{server.url}/chat", method="POST", headers=headers)
            (upstream,) = await provider.await_requests(1)
            assert await upstream.await_closed(timeout=5)
            record = await settled(records)
    if fault is None:
        assert record.outcome == "complete"
        assert result.body.endswith(b"data: [DONE]\n\n")
    elif fault.startswith("status"):
        assert result.status == 429
        assert record.outcome == "error"
    else:
        (frame,) = frames(result.body)
        assert frame["error"]["type"] == "truncated_stream"
        assert record.outcome == "truncated"


@pytest.mark.parametrize("status", [400, 429, 500])
async def test_a_refused_request_reaches_the_client_as_its_status(status: int) -> None:
    result, record, info, _, _ = await relay(f"status={status}")
    assert result.status == status
    assert result.headers["content-type"] == "application/json"
    assert msgspec.json.decode(result.body)["error"]  # the provider's own error body
    assert info.status != "complete"
    assert record.outcome == "error"


@pytest.mark.parametrize(
    ("fault", "timeouts", "error_type", "outcome"),
    [
        ("stall-after=3;seconds=5", {"idle_timeout": 0.3}, "idle_timeout", "error"),
        ("truncate-after=3", {}, "truncated_stream", "truncated"),
        ("reset-after=3", {}, "truncated_stream", "truncated"),  # killed mid-stream
        ("error-after=3", {}, None, "error"),  # the provider's own frame, passed on
    ],
)
async def test_a_stream_that_fails_ends_with_one_error_frame(
    fault: str, timeouts: dict[str, float], error_type: str | None, outcome: str
) -> None:
    result, record, info, _, _ = await relay(fault, **timeouts)
    assert result.status == 200
    if error_type is not None:
        (frame,) = frames(result.body)
        assert frame["error"]["type"] == error_type
        assert record.error_type == error_type
    else:
        # The provider's own error event reached the client; none of ours was added.
        assert frames(result.body) == []
        assert result.body.count(b'"error"') == 1
    assert b"data: [DONE]" not in result.body
    assert info.status == "failed"
    assert record.outcome == outcome


async def test_slow_but_steady_events_are_never_cut() -> None:
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    with FakeProvider(tokens=8, tokens_per_second=8) as provider:  # an event every 125 ms
        app = gateway(provider.url, records, backend, first_token_timeout=0.5, idle_timeout=0.4)
        with run_server(app) as server:
            result = await request(f"{server.url}/chat", method="POST")
            record = await settled(records)
    assert result.body.endswith(b"data: [DONE]\n\n")
    assert record.outcome == "complete"


async def test_headers_then_silence_fires_the_first_token_timeout() -> None:
    closed = asyncio.Event()

    async def silent(request: Request) -> StreamingResponse:
        async def nothing():  # type: ignore[no-untyped-def]
            try:
                await asyncio.sleep(30)
                yield b""
            finally:
                closed.set()

        return StreamingResponse(nothing(), media_type="text/event-stream")

    upstream_app = Starlette(routes=[Route("/v1/chat/completions", silent, methods=["POST"])])
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    with run_server(upstream_app) as upstream:
        app = gateway(upstream.url, records, backend, first_token_timeout=0.3)
        with run_server(app) as server:
            result = await request(f"{server.url}/chat", method="POST", timeout=10)
            record = await settled(records)
    (frame,) = frames(result.body)
    assert frame["error"]["type"] == "first_token_timeout"
    assert record.outcome == "error"
    assert record.error_type == "first_token_timeout"


async def test_a_client_that_leaves_closes_the_upstream_and_is_recorded_once() -> None:
    records: list[UsageRecord] = []
    backend = MemoryBackend()
    with FakeProvider(tokens=200, tokens_per_second=100) as provider:
        app = gateway(provider.url, records, backend, idle_timeout=5)
        with run_server(app) as server:
            result = await request(f"{server.url}/chat", method="POST", disconnect_after_bytes=400)
            (upstream,) = await provider.await_requests(1)
            assert await upstream.await_closed(timeout=5), "the upstream was left open"
            record = await settled(records)
    assert result.body
    assert upstream.tokens_sent < 200
    assert record.outcome == "cancelled"
    info = await backend.get(result.headers["x-generation-id"])
    assert info is not None
    assert info.status == "cancelled"
