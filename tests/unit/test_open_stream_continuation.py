"""``open_stream(..., continuation=...)``: what a relay that another replica may finish sends
and yields, against a real FakeProvider, and the bad input it refuses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from asgi_disconnect.testing import FakeProvider
from asgi_disconnect.upstream import IdleTimeout, open_stream

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "fake-model", "input": "hi", "stream": True}


@pytest.fixture
async def provider() -> AsyncIterator[FakeProvider]:
    async with FakeProvider(tokens=40, tokens_per_second=0) as fake:
        yield fake


async def test_a_relay_that_can_be_continued_yields_whole_events_only(
    provider: FakeProvider,
) -> None:
    async with httpx.AsyncClient(base_url=provider.url) as client:
        request = client.build_request("POST", "/v1/chat/completions", json=CHAT)
        stream = await open_stream(
            client, request, upstream="vllm", continuation="continue_final_message"
        )
        chunks = [chunk async for chunk in stream]
    assert chunks
    assert all(chunk.endswith(b"\n\n") for chunk in chunks)
    assert b"".join(chunks).endswith(b"data: [DONE]\n\n")


async def test_a_responses_relay_runs_in_background_mode(provider: FakeProvider) -> None:
    async with httpx.AsyncClient(base_url=provider.url) as client:
        request = client.build_request("POST", "/v1/responses", json=RESPONSES)
        stream = await open_stream(client, request, upstream="openai", continuation="responses")
        body = b"".join([chunk async for chunk in stream])
    (call,) = provider.requests
    assert call.body["background"] is True
    assert call.body["store"] is True
    assert b"response.completed" in body
    assert stream.response_id == call.response_id


async def test_a_background_response_that_stays_queued_is_cancelled_at_the_provider(
    provider: FakeProvider,
) -> None:
    """The known provider fault: the response never leaves ``queued``. The relay gives up at
    its idle timeout, and the provider is asked to cancel it, so it never runs and bills."""
    async with httpx.AsyncClient(base_url=provider.url) as client:
        request = client.build_request(
            "POST", "/v1/responses", json=RESPONSES, headers={"x-fake-queued": "1"}
        )
        stream = await open_stream(
            client, request, upstream="openai", continuation="responses", idle_timeout=0.3
        )
        with pytest.raises(IdleTimeout):
            async for _ in stream:
                pass
        assert stream.response_id is not None
        state = await client.get(f"/v1/responses/{stream.response_id}")
    assert state.json()["status"] == "cancelled"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"continuation": "continue_final_message"}, "needs upstream="),
        ({"continuation": "resume", "upstream": "vllm"}, "continuation must be one of"),
        (
            {"continuation": "prefill", "upstream": "a", "fallback": "later"},
            "fallback must be one of",
        ),
    ],
)
async def test_bad_continuation_options_are_refused_before_any_call(
    provider: FakeProvider, options: dict[str, str], message: str
) -> None:
    async with httpx.AsyncClient(base_url=provider.url) as client:
        request = client.build_request("POST", "/v1/chat/completions", json=CHAT)
        with pytest.raises(ValueError, match=message):
            await open_stream(client, request, **options)  # type: ignore[arg-type]
    assert provider.requests == []


async def test_a_streamed_or_non_json_body_cannot_be_continued(provider: FakeProvider) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield json.dumps(CHAT).encode()

    async with httpx.AsyncClient(base_url=provider.url) as client:
        streamed = client.build_request("POST", "/v1/chat/completions", content=chunks())
        with pytest.raises(ValueError, match="body is in memory"):
            await open_stream(client, streamed, upstream="v", continuation="restart")
        text = client.build_request("POST", "/v1/chat/completions", content=b"not json")
        with pytest.raises(ValueError, match="must be JSON"):
            await open_stream(client, text, upstream="v", continuation="restart")
    assert provider.requests == []


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses?api-version=2025-04-01"])
async def test_a_cancelled_background_relay_is_cancelled_at_the_provider(
    provider: FakeProvider, path: str
) -> None:
    """Through the stack, on a cancelling route: the client leaves, the policy cancels, and
    the provider's background response is cancelled too (closing the socket would leave it
    running and billing); a query on the URL (Azure's ``api-version``) stays a query."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from asgi_disconnect import MemoryBackend, install
    from asgi_disconnect.testing import drive
    from asgi_disconnect.testing._driver import lifespan

    async with httpx.AsyncClient(base_url=provider.url) as client:

        async def relay(request: Request) -> StreamingResponse:
            call = client.build_request("POST", path, json=RESPONSES, headers={"x-fake-rate": "20"})
            stream = await open_stream(client, call, upstream="openai", continuation="responses")
            return StreamingResponse(stream, media_type="text/event-stream")

        app = Starlette(routes=[Route("/relay", relay, methods=["POST"])])
        install(app, backend=MemoryBackend())
        async with lifespan(app):
            result = await drive(app, method="POST", path="/relay", disconnect_after_bytes=400)
            assert result.status == 200
            call = provider.requests[0]
            assert [r.path for r in provider.requests[1:]] == [
                f"/v1/responses/{call.response_id}/cancel"
            ]
            state = await client.get(f"/v1/responses/{call.response_id}")
    assert state.json()["status"] == "cancelled"
    assert provider.output_tokens(call.response_id) < 40
