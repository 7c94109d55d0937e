"""``open_stream(..., ask_for_usage=True)``: a client that did not ask for usage gets
exactly the bytes it would have got, while its record carries the provider's counts; one
that asked gets the usage it asked for. Through ``install()`` (idempotency, drain) on
uvicorn, against FakeProvider; and the filter on a recorded OpenAI stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import UsageRecord, connect, install
from asgi_disconnect.sse import SSEDecoder
from asgi_disconnect.testing import FakeProvider, run_server
from asgi_disconnect.upstream import UpstreamStatusError, _without_usage, open_stream
from tests.apps import as_tester

pytestmark = [pytest.mark.anyio, pytest.mark.server]

DATA = Path(__file__).resolve().parents[1] / "data"


def gateway(upstream: str, records: list[UsageRecord], db: Path) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None)) as client:
            app.state.client = client
            yield

    async def chat(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        outgoing = client.build_request(
            "POST", "/v1/chat/completions", content=await request.body(),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        try:
            stream = await open_stream(client, outgoing, ask_for_usage=True)
        except UpstreamStatusError as exc:
            return JSONResponse(exc.error, status_code=exc.status_code)
        return StreamingResponse(stream, media_type="text/event-stream")

    app = Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan
    )
    install(
        app,
        backend=connect(f"sqlite:///{db}"),
        sinks=[records.append],
        idempotency=True,
        drain={"signals": False, "drain_token": "op"},
        principal=as_tester,
    )
    return app


@contextlib.contextmanager
def serving(tmp_path: Path) -> Iterator[tuple[str, FakeProvider, list[UsageRecord]]]:
    records: list[UsageRecord] = []
    provider = FakeProvider(tokens=30, tokens_per_second=1000).start()
    try:
        with run_server(gateway(provider.url, records, tmp_path / "g.db")) as server:
            yield server.url, provider, records
    finally:
        provider.stop()


def events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(e.data) for e in SSEDecoder().feed(body) if e.data.startswith("{")]


async def settled(records: list[UsageRecord]) -> UsageRecord:
    async with asyncio.timeout(10):
        while not records:
            await asyncio.sleep(0.02)
    (record,) = records
    return record


async def test_a_client_that_did_not_ask_gets_its_bytes_and_the_record_the_usage(
    tmp_path: Path,
) -> None:
    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with serving(tmp_path) as (url, provider, records):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            answer = await client.post("/v1/chat/completions", json=body)
        record = await settled(records)
        (call,) = provider.requests
    assert call.body["stream_options"] == {"include_usage": True}  # asked of the provider
    received = events(answer.content)
    assert all("usage" not in chunk for chunk in received)  # and kept from the client
    assert received[-1]["choices"][0]["finish_reason"] == "stop"
    assert answer.content.endswith(b"data: [DONE]\n\n")
    assert record.outcome == "complete"
    assert record.usage_source == "provider"
    assert (record.input_tokens, record.output_tokens) == (12, 30)
    assert record.delivered_output_tokens == 30


async def test_a_client_that_asked_gets_the_usage_as_it_asked(tmp_path: Path) -> None:
    body = {
        "model": "fake-model",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    with serving(tmp_path) as (url, _, records):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            answer = await client.post("/v1/chat/completions", json=body)
        record = await settled(records)
    received = events(answer.content)
    assert received[-1]["choices"] == []
    assert received[-1]["usage"]["completion_tokens"] == 30
    assert (record.input_tokens, record.output_tokens) == (12, 30)


def test_the_filter_gives_a_recorded_stream_back_as_it_was_without_usage() -> None:
    """A real OpenAI stream with include_usage (its last chunk the usage, choices []), and
    the same with "usage":null added to every other chunk as the API documents: both come
    out as the stream without usage."""
    recorded = (DATA / "openai_chat_basic.sse").read_bytes()
    blocks = [block + b"\n\n" for block in recorded.split(b"\n\n") if block]
    without = b"".join(block for block in blocks if b'"usage":{' not in block)
    nulls = [
        block.replace(b"]}\n\n", b'],"usage":null}\n\n') if b'"usage":{' not in block else block
        for block in blocks
    ]
    for variant in (blocks, nulls):
        shown = b"".join(s for block in variant if (s := _without_usage(block)) is not None)
        assert shown == without


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2]",
        b'{"stream": false, "messages": []}',
        b'{"stream": true, "prompt": "no messages"}',
        b'{"stream": true, "messages": [], "stream_options": "yes"}',
        b'{"stream": true, "messages": [], "stream_options": {"include_usage": true}}',
    ],
)
def test_a_request_that_is_no_chat_stream_or_asks_already_is_sent_as_it_is(
    content: bytes,
) -> None:
    from asgi_disconnect.upstream import _asking_for_usage

    client = httpx.AsyncClient(base_url="http://provider.invalid")
    request = client.build_request("POST", "/v1/chat/completions", content=content)
    assert _asking_for_usage(client, request) is None
