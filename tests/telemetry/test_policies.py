"""The counters tell a working disconnect policy from a broken one, on uvicorn and real
sockets against FakeProvider.

- Cancel that reaches the upstream keeps billed output tokens near the delivered ones; an
  app that shields its upstream loop from the cancellation (a bug made on purpose here)
  makes the provider generate, and bill, the whole answer: billed/delivered climbs.
- Detached work that completes counts in ``detach_completed``; detached work the shutdown
  interrupts does not, so ``detach_completed`` falls short of ``detached``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from asgi_disconnect import MemoryBackend, disconnect_policy, install
from asgi_disconnect.testing import FakeProvider, request, run_server
from asgi_disconnect.upstream import open_stream

from .conftest import Telemetry

pytestmark = [pytest.mark.anyio, pytest.mark.server]

BODY = {
    "model": "fake-model",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "hi"}],
}


def gateway(upstream_url: str, telemetry: Telemetry, **options: Any) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream_url, timeout=httpx.Timeout(None))

    def outgoing(request: Request) -> httpx.Request:
        tokens = request.query_params.get("tokens", "200")
        return client.build_request(
            "POST", "/v1/chat/completions", json=BODY, headers={"x-fake-tokens": tokens}
        )

    async def chat(request: Request) -> StreamingResponse:
        upstream = await open_stream(client, outgoing(request))
        return StreamingResponse(upstream, media_type="text/event-stream")

    @disconnect_policy("detach")
    async def report(request: Request) -> StreamingResponse:
        upstream = await open_stream(client, outgoing(request))
        return StreamingResponse(upstream, media_type="text/event-stream")

    class Shielded:  # an ASGI endpoint; the bug: "finish the upstream cleanly"
        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            task = asyncio.ensure_future(relay(send))
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                await task
                raise

    async def relay(send: Send) -> None:
        async with client.stream("POST", "/v1/chat/completions", json=BODY) as response:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(
        routes=[
            Route("/chat", chat, methods=["POST"]),
            Route("/report", report, methods=["POST"]),
            Route("/shielded", Shielded(), methods=["POST"]),
        ],
        lifespan=lifespan,
    )
    install(
        app,
        backend=MemoryBackend(),
        tracer_provider=telemetry.tracer_provider,
        meter_provider=telemetry.meter_provider,
        **options,
    )
    return app


def billed_over_delivered(telemetry: Telemetry) -> float:
    billed = telemetry.total("asgi_disconnect.output_tokens.billed")
    delivered = telemetry.total("asgi_disconnect.output_tokens.delivered")
    assert billed > 0
    assert delivered > 0
    return billed / delivered


async def cut_streams(path: str, telemetry: Telemetry, provider: FakeProvider) -> list[Any]:
    """Three clients that leave after a few events; the provider's view of each call."""
    with run_server(gateway(provider.url, telemetry)) as server:
        for _ in range(3):
            result = await request(
                f"{server.url}{path}", method="POST", disconnect_after_bytes=1500
            )
            assert not result.body.endswith(b"[DONE]\n\n")
        calls = await provider.await_requests(3)
        for call in calls:
            assert await call.await_closed(timeout=10)
        async with asyncio.timeout(10):
            while len(telemetry.finished()) < 3:
                await asyncio.sleep(0.02)
    return calls


async def test_working_cancel_keeps_billed_near_delivered(telemetry: Telemetry) -> None:
    with FakeProvider(tokens=200, tokens_per_second=400) as provider:
        calls = await cut_streams("/chat", telemetry, provider)
    assert all(call.tokens_generated < 100 for call in calls)  # the upstream stopped
    assert telemetry.total("asgi_disconnect.requests.cancelled") == 3
    assert billed_over_delivered(telemetry) < 1.5


async def test_broken_cancel_propagation_shows_as_billed_over_delivered(
    telemetry: Telemetry,
) -> None:
    with FakeProvider(tokens=200, tokens_per_second=400) as provider:
        calls = await cut_streams("/shielded", telemetry, provider)
    assert all(call.tokens_generated == 200 for call in calls)  # generated, and billed
    assert telemetry.total("asgi_disconnect.output_tokens.billed") == 600
    assert billed_over_delivered(telemetry) > 4


async def test_interrupted_detached_work_falls_short_of_detach_completed(
    telemetry: Telemetry,
) -> None:
    with FakeProvider(tokens_per_second=100) as provider:
        app = gateway(provider.url, telemetry, shutdown_timeout=0.5)
        with run_server(app) as server:
            # One short generation that completes, two that outlast the shutdown deadline.
            for tokens in (20, 2000, 2000):
                await request(
                    f"{server.url}/report?tokens={tokens}",
                    method="POST",
                    disconnect_after_bytes=300,
                )
            calls = await provider.await_requests(3)
            assert await calls[0].await_closed(timeout=10)
    assert telemetry.total("asgi_disconnect.generations.detached") == 3
    assert telemetry.total("asgi_disconnect.generations.detach_completed") == 1
    assert telemetry.total("asgi_disconnect.generations.interrupted") == 2
    continuations = [s for s in telemetry.finished() if s.name.startswith("detached ")]
    assert len(continuations) == 3
    interrupted = [s for s in continuations if (s.attributes or {}).get("error.type")]
    assert len(interrupted) == 2
    for span in interrupted:
        assert dict(span.attributes or {})["asgi_disconnect.generation.status"] == "interrupted"
        assert "asgi_disconnect.interrupted" in [event.name for event in span.events]
