"""Keep-alive comments toward the client while an event stream is silent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, UsageRecord, install
from asgi_disconnect.testing import drive, request, run_server
from asgi_disconnect.testing._driver import lifespan

pytestmark = pytest.mark.anyio

ALICE = [("authorization", "Bearer alice")]
KEEP_ALIVE = b": keep-alive\n\n"
EVENT = b'data: {"choices":[{"delta":{"content":"late"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def slow_app(silence: float, steady: int = 0) -> Starlette:
    async def body() -> AsyncIterator[bytes]:
        for _ in range(steady):
            yield EVENT
            await asyncio.sleep(0.02)
        await asyncio.sleep(silence)  # a slow first token, or a long pause
        yield EVENT
        yield DONE

    async def chat(request: Request) -> StreamingResponse:
        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/chat", chat)])


async def test_a_silent_stream_gets_comments_that_are_not_output() -> None:
    records: list[UsageRecord] = []
    app = slow_app(0.45)
    install(app, backend=MemoryBackend(), sinks=[records.append], keep_alive=0.1)
    async with lifespan(app):
        result = await drive(app, path="/chat", headers=ALICE)
        generation_id = result.header("x-generation-id")
        stored = await drive(app, path=f"/generations/{generation_id}/stream", headers=ALICE)
        for _ in range(100):
            if records:
                break
            await asyncio.sleep(0.01)
    assert result.complete
    before, _, after = result.body.partition(EVENT)
    assert 3 <= before.count(KEEP_ALIVE) <= 5, before
    assert before == KEEP_ALIVE * before.count(KEEP_ALIVE)
    assert after == DONE
    # The log, the resume stream and the record know nothing of them.
    assert stored.body == EVENT + DONE
    (record,) = records
    assert record.produced_bytes == record.delivered_bytes == len(EVENT + DONE)
    assert record.outcome == "complete"


async def test_a_steady_stream_gets_none_and_none_is_the_off_switch() -> None:
    steady = slow_app(0.0, steady=20)
    install(steady, backend=MemoryBackend(), keep_alive=0.1)
    quiet = slow_app(0.35)
    install(quiet, backend=MemoryBackend(), keep_alive=None)
    assert KEEP_ALIVE not in (await drive(steady, path="/chat")).body
    assert KEEP_ALIVE not in (await drive(quiet, path="/chat")).body


@pytest.mark.parametrize("value", [0, -1.0])
def test_a_bad_interval_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        DisconnectMiddleware(slow_app(0), backend=MemoryBackend(), keep_alive=value)


async def test_a_client_gone_during_the_silence_is_noticed_by_a_keep_alive() -> None:
    """Through uvicorn over a real socket: the client hangs up while the app waits for its
    first token; the comment the middleware writes meets the closed connection, so the
    cancel policy applies before the first token ever comes."""
    records: list[UsageRecord] = []
    finished = asyncio.Event()
    app = slow_app(3.0)

    def record(usage: UsageRecord) -> None:
        records.append(usage)

    install(app, backend=MemoryBackend(), sinks=[record], keep_alive=0.1)
    with run_server(app, server="uvicorn") as server:
        result = await request(
            f"{server.url}/chat", headers=dict(ALICE), disconnect_after_bytes=len(KEEP_ALIVE)
        )
        assert result.body.startswith(KEEP_ALIVE)
        for _ in range(200):
            if records:
                finished.set()
                break
            await asyncio.sleep(0.01)
    assert finished.is_set(), "the request never ended"
    (usage,) = records
    assert usage.outcome == "cancelled"
    assert usage.produced_bytes == 0
