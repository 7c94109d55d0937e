"""MeteringMiddleware: one usage record per request, whatever the client did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import (
    DisconnectMiddleware,
    MemoryBackend,
    MeteringMiddleware,
    UsageRecord,
    disconnect_policy,
)
from asgi_disconnect.testing import drive, lifespan

pytestmark = pytest.mark.anyio

DATA = Path(__file__).resolve().parents[1] / "data"
OPENAI = (DATA / "openai_chat_basic.sse").read_bytes()
NO_USAGE = (DATA / "openai_compat_chat_no_usage.sse").read_bytes()


def chunked(body: bytes, size: int = 97) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


class Ledger:
    """A reservation store that records every call."""

    def __init__(self) -> None:
        self.reserved: list[str] = []
        self.settled: list[tuple[Any, UsageRecord]] = []

    async def reserve(self, scope: Any) -> str:
        token = f"r{len(self.reserved)}"
        self.reserved.append(token)
        return token

    async def settle(self, reservation: Any, record: UsageRecord) -> None:
        self.settled.append((reservation, record))


def gateway(body: bytes, *, delay: float = 0.0) -> Starlette:
    async def events() -> AsyncIterator[bytes]:
        for part in chunked(body):
            yield part
            await asyncio.sleep(delay)

    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    @disconnect_policy("detach")
    async def detached(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    async def failing(request: Request) -> StreamingResponse:
        async def broken() -> AsyncIterator[bytes]:
            yield body[:200]
            raise RuntimeError("upstream reset")

        return StreamingResponse(broken(), media_type="text/event-stream")

    async def completion(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": "gpt-test",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
            }
        )

    async def refused(request: Request) -> Response:
        raise ValueError("before any header")

    return Starlette(
        routes=[
            Route("/stream", stream),
            Route("/detached", detached),
            Route("/failing", failing),
            Route("/completion", completion),
            Route("/refused", refused),
        ]
    )


def stack(
    app: Starlette, *, tokenizer: Any = None, **options: Any
) -> tuple[DisconnectMiddleware, list[UsageRecord], Ledger]:
    records: list[UsageRecord] = []
    ledger = Ledger()
    extra = {} if tokenizer is None else {"tokenizer": tokenizer}
    metered = MeteringMiddleware(app, sinks=[records.append], reservations=ledger, **extra)
    return DisconnectMiddleware(metered, backend=MemoryBackend(), **options), records, ledger


async def settled(records: list[UsageRecord], count: int = 1) -> list[UsageRecord]:
    async with asyncio.timeout(5):
        while len(records) < count:
            await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # a second record would have arrived by now
    return records


async def test_complete_stream_uses_the_provider_usage() -> None:
    mw, records, ledger = stack(gateway(OPENAI))
    result = await drive(mw, path="/stream")
    (record,) = await settled(records)
    assert record.outcome == "complete"
    assert record.usage_source == "provider"
    assert record.provider == "openai_chat"
    assert record.input_tokens is not None
    assert record.output_tokens is not None
    assert record.produced_bytes == record.delivered_bytes == len(OPENAI) == len(result.body)
    assert record.delivered_output_tokens == record.output_tokens
    assert record.generation_id == result.header("x-generation-id")
    assert record.route == "/stream"
    assert record.time_to_first_event is not None
    assert [r for r, _ in ledger.settled] == ledger.reserved == ["r0"]


async def test_cancelled_stream_is_recorded_once_with_an_estimate() -> None:
    mw, records, ledger = stack(gateway(OPENAI, delay=0.01))
    await drive(mw, path="/stream", disconnect_after_bytes=len(OPENAI) // 3)
    (record,) = await settled(records)
    assert record.outcome == "cancelled"
    assert record.policy == "cancel"
    # The usage chunk never arrived: the output is estimated from the text produced.
    assert record.usage_source == "estimated"
    assert record.delivered_bytes <= record.produced_bytes < len(OPENAI)
    assert record.delivered_output_tokens is not None
    assert record.produced_output_tokens is not None
    assert record.delivered_output_tokens <= record.produced_output_tokens
    assert len(ledger.settled) == 1


async def test_detached_stream_is_recorded_when_it_finishes() -> None:
    mw, records, ledger = stack(gateway(OPENAI, delay=0.005))
    async with lifespan(mw):
        await drive(mw, path="/detached", disconnect_after_bytes=300)
        (record,) = await settled(records)
    assert record.outcome == "complete"
    assert record.detached is True
    assert record.usage_source == "provider"
    assert record.produced_bytes == len(OPENAI)
    assert record.delivered_bytes < record.produced_bytes
    assert record.delivered_output_tokens is not None
    assert record.output_tokens is not None
    assert record.delivered_output_tokens < record.output_tokens
    assert len(ledger.settled) == 1


async def test_stalled_client_still_gets_exactly_one_record() -> None:
    mw, records, _ = stack(gateway(OPENAI * 50), max_lag_bytes=4096, max_lag_seconds=0.3)
    await drive(mw, path="/stream", stop_reading_after_bytes=100)
    (record,) = await settled(records)
    assert record.outcome == "cancelled"


async def test_error_after_headers_is_an_error_record() -> None:
    mw, records, ledger = stack(gateway(OPENAI))
    with pytest.raises(RuntimeError):
        await drive(mw, path="/failing")
    (record,) = await settled(records)
    assert record.outcome == "error"
    assert record.error_type == "RuntimeError"
    assert len(ledger.settled) == 1


async def test_error_before_headers_settles_the_reservation() -> None:
    mw, records, ledger = stack(gateway(OPENAI))
    with pytest.raises(ValueError, match="before any header"):
        await drive(mw, path="/refused")
    (record,) = await settled(records)
    assert record.outcome == "error"
    assert record.status_code == 500
    assert len(ledger.settled) == 1


async def test_json_completion_usage() -> None:
    mw, records, _ = stack(gateway(OPENAI))
    await drive(mw, path="/completion")
    (record,) = await settled(records)
    assert record.outcome == "complete"
    assert (record.input_tokens, record.output_tokens) == (11, 7)
    assert record.provider == "openai_chat"
    assert record.model == "gpt-test"
    assert record.finish_reason == "stop"


async def test_no_usage_in_the_stream_is_estimated() -> None:
    mw, records, _ = stack(gateway(NO_USAGE))
    await drive(mw, path="/stream")
    (record,) = await settled(records)
    assert record.usage_source == "estimated"
    assert record.output_tokens is not None
    assert record.output_tokens > 0


async def test_custom_tokenizer_is_used_for_estimates() -> None:
    mw, records, _ = stack(gateway(NO_USAGE), tokenizer=lambda text: 1000)
    await drive(mw, path="/stream")
    (record,) = await settled(records)
    assert record.output_tokens == 1000


async def test_failing_hooks_are_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[UsageRecord] = []

    def broken_sink(record: UsageRecord) -> None:
        raise RuntimeError("sink down")

    class BrokenReservations:
        async def reserve(self, scope: Any) -> None:
            raise RuntimeError("ledger down")

        async def settle(self, reservation: Any, record: UsageRecord) -> None:
            raise RuntimeError("ledger down")

    metered = MeteringMiddleware(
        gateway(OPENAI), sinks=[broken_sink, seen.append], reservations=BrokenReservations()
    )
    mw = DisconnectMiddleware(metered, backend=MemoryBackend())
    result = await drive(mw, path="/stream")
    assert result.complete
    await settled(seen)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "reserve() failed" in messages
    assert "settle() failed" in messages
    assert "a usage sink failed" in messages


async def test_standalone_without_disconnect_middleware() -> None:
    records: list[UsageRecord] = []
    mw = MeteringMiddleware(gateway(OPENAI), sinks=[records.append])
    await drive(mw, path="/stream")
    (record,) = records
    assert record.outcome == "complete"
    assert record.generation_id is None
    assert record.delivered_bytes == record.produced_bytes == len(OPENAI)


async def test_install_stores_one_record_per_request_in_the_backend(tmp_path: Path) -> None:
    from asgi_disconnect import connect, install

    app = gateway(OPENAI, delay=0.001)
    backend = connect(f"sqlite:///{tmp_path / 'usage.db'}", flush_interval=0.02)
    install(app, backend=backend)
    async with lifespan(app):
        done = await drive(app, path="/stream")
        cut = await drive(app, path="/stream", disconnect_after_bytes=500)
        await asyncio.sleep(0.2)
        (whole,) = await backend.usage_of(done.header("x-generation-id"))  # type: ignore[arg-type]
        (partial,) = await backend.usage_of(cut.header("x-generation-id"))  # type: ignore[arg-type]
    assert whole.outcome == "complete"
    assert partial.outcome == "cancelled"
