"""Promises that broke at the seams: a cut response, an odd JSON body, two callers alike."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import MemoryBackend, UsageRecord, default_principal, install, metered
from asgi_disconnect.testing import drive
from tests.apps import eventually, http_scope, request_then_disconnect

pytestmark = pytest.mark.anyio

AUTH = ("authorization", "Bearer alice")


class Runs:
    def __init__(self) -> None:
        self.count = 0


def streaming_app(runs: Runs, media_type: str, parts: list[bytes]) -> Starlette:
    async def produce(request: Request) -> StreamingResponse:
        runs.count += 1

        async def body() -> AsyncIterator[bytes]:
            for part in parts:
                yield part
                await asyncio.sleep(0.05)

        return StreamingResponse(body(), media_type=media_type)

    return Starlette(routes=[Route("/produce", produce, methods=["POST"])])


@pytest.mark.parametrize(
    ("media_type", "parts"),
    [
        ("text/event-stream", [b"data: %d\n\n" % i for i in range(20)]),
        (
            "application/json",  # an LLM API's JSON, streamed in parts: a generation
            [
                b'{"object":"chat.completion","choices":[',
                b'{"index":0,"message":{"content":"' + b"x" * 40 + b'"}}],',
                b'"usage":{"prompt_tokens":1,"completion_tokens":2}}',
            ],
        ),
    ],
)
async def test_a_response_cut_by_a_disconnect_is_not_replayed(
    media_type: str, parts: list[bytes]
) -> None:
    runs = Runs()
    app = streaming_app(runs, media_type, parts)
    install(app, backend=MemoryBackend(), idempotency=True)
    headers = [AUTH, ("idempotency-key", "cut-1")]
    cut = await drive(
        app, method="POST", path="/produce", headers=headers, disconnect_after_bytes=10
    )
    assert cut.disconnected
    retry = await drive(app, method="POST", path="/produce", headers=headers)
    assert retry.header("idempotent-replayed") is None
    assert retry.status == 200
    assert retry.body == b"".join(parts)
    assert runs.count == 2
    # The whole response is what gets stored, and replayed from then on.
    replay = await drive(app, method="POST", path="/produce", headers=headers)
    assert replay.header("idempotent-replayed") == "true"
    assert replay.body == b"".join(parts)
    assert runs.count == 2


@pytest.mark.parametrize(
    "payload",
    [
        {"usage": 5},
        {"choices": ["x"]},
        {"usage": {"prompt_tokens": "many"}},
        {"choices": [None], "usage": None},
        {"usageMetadata": 3},
        {"error": "boom"},
        [1, 2, 3],
    ],
)
async def test_any_json_body_gets_its_one_record_and_settles(payload: Any) -> None:
    records: list[UsageRecord] = []
    settled: list[UsageRecord] = []

    class Ledger:
        async def reserve(self, scope: Any) -> str:
            return "r1"

        async def settle(self, reservation: Any, record: UsageRecord) -> None:
            assert reservation == "r1"
            settled.append(record)

    async def odd(request: Request) -> JSONResponse:
        return JSONResponse(payload)

    app = Starlette(routes=[Route("/odd", odd)])
    install(app, backend=MemoryBackend(), sinks=[records.append], reservations=Ledger())
    result = await drive(app, path="/odd", headers=[AUTH])
    assert result.status == 200
    await eventually(lambda: records and settled)
    (record,) = records
    assert settled == [record]
    assert record.usage_source == "none"
    assert record.output_tokens is None
    assert record.principal


def test_the_same_secret_in_two_headers_is_two_callers() -> None:
    bearer = default_principal({"headers": [(b"authorization", b"Bearer A")]})
    api_key = default_principal({"headers": [(b"x-api-key", b"Bearer A")]})
    assert bearer != api_key
    assert bearer
    assert api_key


DATA = Path(__file__).resolve().parent.parent / "data"


def relay_app(runs: Runs, body: bytes) -> Starlette:
    """An app relaying a recorded upstream body in pieces, as a gateway does."""

    async def relay(request: Request) -> StreamingResponse:
        runs.count += 1

        async def pieces() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 97):
                yield body[start : start + 97]
                await asyncio.sleep(0)

        return StreamingResponse(pieces(), media_type="text/event-stream")

    return Starlette(routes=[Route("/relay", relay, methods=["POST"])])


@pytest.mark.parametrize("cut", [True, False])
async def test_a_stream_is_complete_only_with_its_terminal_marker(cut: bool) -> None:
    body = (DATA / "openai_chat_basic.sse").read_bytes()
    if cut:
        body = body[: body.index(b"data: [DONE]")]  # the upstream ended cleanly, too early
    runs = Runs()
    records: list[UsageRecord] = []
    app = relay_app(runs, body)
    backend = MemoryBackend()
    install(app, backend=backend, sinks=[records.append], idempotency=True)
    headers = [AUTH, ("idempotency-key", f"marker-{cut}")]
    result = await drive(app, method="POST", path="/relay", headers=headers)
    generation_id = result.header("x-generation-id")
    assert generation_id is not None
    info = await backend.get(generation_id)
    assert info is not None
    await eventually(lambda: records)
    retry = await drive(app, method="POST", path="/relay", headers=headers)
    if cut:
        assert info.status == "failed"
        assert info.error == "the stream ended without its protocol's terminal marker"
        assert result.body.startswith(body)
        assert b"event: error" in result.body[len(body) :]
        assert b'"truncated_stream"' in result.body[len(body) :]
        assert records[0].outcome == "truncated"
        assert retry.header("idempotent-replayed") is None  # not stored: it runs again
        assert runs.count == 2
    else:
        assert info.status == "complete"
        assert result.body == body
        assert records[0].outcome == "complete"
        assert retry.header("idempotent-replayed") == "true"
        assert runs.count == 1


async def test_a_client_that_reads_slowly_gets_everything_and_memory_stays_bounded() -> None:
    chunk = b"x" * (1 << 20)
    total = 50

    @metered()
    async def flood(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for _ in range(total):
                yield chunk  # as fast as the app can: no await between chunks

        return StreamingResponse(body(), media_type="application/octet-stream")

    records: list[UsageRecord] = []
    app = Starlette(routes=[Route("/flood", flood)])
    install(app, backend=MemoryBackend(), sinks=[records.append])
    mw = app.build_middleware_stack()
    received = 0
    lead = 0
    done = asyncio.Event()
    receive = request_then_disconnect(done)

    async def steady_send(message: dict[str, Any]) -> None:
        nonlocal received, lead
        if message["type"] == "http.response.body":
            await asyncio.sleep(0.002 * len(message.get("body", b"")) / (1 << 20))
            received += len(message.get("body", b""))
            state = scope["asgi_disconnect"]
            lead = max(lead, state.produced_bytes - state.delivered_bytes)
            if not message.get("more_body", False):
                done.set()

    scope = http_scope("/flood", headers=[AUTH_RAW])
    async with asyncio.timeout(30):
        await mw(scope, receive, steady_send)
    assert received == total * len(chunk)
    await eventually(lambda: records)
    assert records[0].outcome != "cancelled"
    assert records[0].delivered_bytes == total * len(chunk)
    # The log never ran more than the limit (and one chunk) ahead of the client.
    assert lead <= (4 << 20) + len(chunk)


AUTH_RAW = (b"authorization", b"Bearer alice")
