"""Lazy metering: under DisconnectMiddleware an event stream is read for its first events,
then its end from the generation log, and whole only when the record needs its text. Its
records are the records an eager read of every byte gives."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import (
    DisconnectMiddleware,
    MemoryBackend,
    MeteringMiddleware,
    RequestState,
    Status,
    UsageRecord,
    _adapters,
    connect,
    disconnect_policy,
)
from asgi_disconnect._log import TAIL_EVENTS, Generation
from asgi_disconnect.metering import analyze
from asgi_disconnect.testing import drive, lifespan

pytestmark = pytest.mark.anyio

DATA = Path(__file__).resolve().parents[1] / "data"
VECTORS = {path.stem: path.read_bytes() for path in sorted(DATA.glob("*.sse"))}
OPENAI = VECTORS["openai_chat_basic"]
# What a record says of the stream itself; timings, ids and byte counts aside.
COMPARED = (
    "provider",
    "model",
    "outcome",
    "input_tokens",
    "output_tokens",
    "usage_source",
    "cache_read_tokens",
    "reasoning_tokens",
    "produced_output_tokens",
    "delivered_output_tokens",
    "finish_reason",
    "error_type",
    "usage_note",
    "produced_bytes",
)


def lengthened(body: bytes, copies: int = 60) -> bytes:
    """The stream with its second event repeated ``copies`` times: long enough that
    metering leaves its middle to the log."""
    events = re.split(rb"(?<=\n\n)", body)
    events = [event for event in events if event]
    if len(events) < 3:
        return body
    return b"".join([events[0], *([events[1]] * copies), *events[1:]])


def chunked(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)]


def app_of(body: bytes, size: int, *, delay: float = 0.0) -> Starlette:
    async def events() -> AsyncIterator[bytes]:
        for part in chunked(body, size):
            yield part
            if delay:
                await asyncio.sleep(delay)

    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    @disconnect_policy("detach")
    async def detached(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/stream", stream), Route("/detached", detached)])


async def record_of(app: Any, records: list[UsageRecord], **options: Any) -> UsageRecord:
    before = len(records)
    await drive(app, path=options.pop("path", "/stream"), **options)
    async with asyncio.timeout(10):
        while len(records) == before:
            await asyncio.sleep(0.005)
    return records[-1]


def compared(record: UsageRecord) -> dict[str, object]:
    return {name: getattr(record, name) for name in COMPARED}


@pytest.mark.parametrize("vector", list(VECTORS))
@pytest.mark.parametrize("size", [13, 97, 4096])
async def test_a_lazy_record_is_the_record_of_an_eager_read(vector: str, size: int) -> None:
    body = lengthened(VECTORS[vector])
    eager: list[UsageRecord] = []
    lazy: list[UsageRecord] = []
    # Alone, metering reads every byte as it is produced: it has no log to read later.
    alone = MeteringMiddleware(app_of(body, size), sinks=[eager.append])
    stacked = DisconnectMiddleware(
        MeteringMiddleware(app_of(body, size), sinks=[lazy.append]), backend=MemoryBackend()
    )
    expected = compared(await record_of(alone, eager))
    got = compared(await record_of(stacked, lazy))
    if got["outcome"] == "truncated" or expected["outcome"] == "truncated":
        # Through DisconnectMiddleware a stream cut short is also a failed generation.
        assert got["outcome"] == expected["outcome"], (got, expected)
    assert got == expected


async def test_a_complete_stream_is_read_by_its_first_events_and_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read: list[int] = []
    adapter = _adapters.ADAPTERS["openai_chat"]

    def counted(state: Any, event: Any) -> None:
        read.append(1)
        adapter(state, event)

    monkeypatch.setitem(_adapters.ADAPTERS, "openai_chat", counted)
    body = lengthened(OPENAI, copies=1000)
    events = body.count(b"\n\n")
    records: list[UsageRecord] = []
    # A model already known: no calibration sample asks for its text.
    metering = MeteringMiddleware(app_of(body, 200), sinks=[records.append])
    model = re.search(rb'"model":"([^"]+)"', body)
    assert model is not None
    for _ in range(8):  # its first answers are read whole, to learn from
        metering.calibration.learn(model.group(1).decode(), 4000, 1000)
    mw = DisconnectMiddleware(metering, backend=MemoryBackend())
    record = await record_of(mw, records)
    assert record.outcome == "complete"
    assert record.usage_source == "provider"
    assert events > 1000
    # The first events (format, model), then the last few from the log.
    assert len(read) <= 8 + TAIL_EVENTS + 8, len(read)

    # Cancelled: no usage came, so the text is read whole, once, for the estimate.
    read.clear()
    paced = app_of(body, 2000, delay=0.001)
    metering.app = paced
    cancelled = await record_of(mw, records, disconnect_after_bytes=len(body) // 2)
    assert cancelled.outcome == "cancelled"
    assert cancelled.usage_source == "estimated"
    # Its text is found by a byte scan: still no event decoded past the first and last.
    assert len(read) <= 8 + TAIL_EVENTS + 8, len(read)
    assert cancelled.output_tokens is not None
    assert cancelled.delivered_output_tokens is not None
    assert cancelled.delivered_output_tokens <= cancelled.output_tokens
    # The estimate of an eager read of the same bytes (4.00 characters per token here).
    text = analyze(body[: cancelled.produced_bytes]).text
    assert cancelled.output_tokens == round(len(text) / 4)


def sse(*payloads: bytes) -> list[bytes]:
    return [b"data: " + payload + b"\n\n" for payload in payloads]


def test_a_running_event_stream_keeps_its_last_events() -> None:
    log = Generation("gen_" + "A" * 24, principal="p", content_type="text/event-stream")
    events = sse(*(b'{"n":%d}' % n for n in range(50)))
    # Blank lines inside chunks, across chunks ("\n" | "\n"), and a CRLF one.
    body = b"".join(events[:-1]) + events[-1].replace(b"\n\n", b"\r\n\r\n")
    for part in chunked(body, 7):
        log.append(part)
    log.release(log.size)
    # The last TAIL_EVENTS events whole, from right after a blank line; whole chunks are
    # released, so the one that holds that start stays.
    tail = body[log.tail_start() :]
    assert tail.startswith(b"data: ")
    assert tail.endswith(b"".join(events[-TAIL_EVENTS:-1]) + events[-1].replace(b"\n", b"\r\n"))
    # A blank line split between chunks may go unseen: one event more, never one less.
    assert tail.count(b"data: ") <= TAIL_EVENTS + 1
    assert log.tail_start() - 7 < log.base <= log.tail_start()
    # An event under way stays too.
    log.append(b'data: {"partial"')
    log.release(log.size)
    assert log.read(log.base).endswith(b'data: {"partial"')
    # Finished, the log keeps nothing a store has.
    log.finish(Status.COMPLETE)
    log.release(log.size)
    assert log.base == log.size


def test_a_log_that_is_not_an_event_stream_keeps_nothing_it_released() -> None:
    log = Generation("gen_" + "B" * 24, principal="p", content_type="application/json")
    for part in chunked(b'{"a":' + b"1" * 5000 + b"}", 100):
        log.append(part)
    log.release(log.size)
    assert log.base == log.size


async def test_a_cancel_on_sqlite_reads_its_released_text_back(tmp_path: Path) -> None:
    """The log let the delivered bytes go (durable and delivered): the estimate reads them
    back from the store, and is the estimate of a log that kept them."""
    body = lengthened(OPENAI, copies=400)
    cut = len(body) * 3 // 4
    records: list[UsageRecord] = []
    backend = connect(f"sqlite:///{tmp_path}/g.db", flush_interval=0.005)
    app = app_of(body, 120, delay=0.002)
    states: list[RequestState] = []

    async def noting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            states.append(scope["asgi_disconnect"])  # the request's state, as documented
        await app(scope, receive, send)

    mw = DisconnectMiddleware(MeteringMiddleware(noting, sinks=[records.append]), backend=backend)
    async with lifespan(mw):
        released: list[int] = []

        async def watch() -> None:
            while True:
                for state in states:
                    if state.generation is not None:
                        released.append(state.generation.base)  # what the log let go
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            record = await record_of(mw, records, disconnect_after_bytes=cut)
        finally:
            watcher.cancel()
    assert max(released, default=0) > 0, "the log released nothing: the test proves nothing"
    memory: list[UsageRecord] = []
    kept = DisconnectMiddleware(
        MeteringMiddleware(app_of(body, 120, delay=0.002), sinks=[memory.append]),
        backend=MemoryBackend(),
    )
    reference = await record_of(kept, memory, disconnect_after_bytes=cut)
    assert record.outcome == reference.outcome == "cancelled"
    assert record.usage_source == "estimated"
    assert record.usage_note == "estimated at 4 characters per token"
    assert record.output_tokens is not None
    assert reference.output_tokens is not None
    # Both cut within the same few events of one another.
    assert abs(record.output_tokens - reference.output_tokens) <= 10


async def test_a_stream_cut_within_its_first_events_is_metered_from_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client leaves while metering still reads the events as produced (before the log
    takes over): the share it received comes from those events' marks, and the record is
    the cancel's, not an error of the analysis."""
    records: list[UsageRecord] = []
    stacked = DisconnectMiddleware(
        MeteringMiddleware(app_of(OPENAI, 256, delay=0.1), sinks=[records.append]),
        backend=MemoryBackend(),
        max_lag_seconds=0.3,
    )
    # It reads the first events, then stops: the app goes on producing until the client
    # counts as gone, so less was delivered than produced.
    record = await record_of(stacked, records, stop_reading_after_bytes=500)
    await asyncio.sleep(0.1)  # a second record would have come by now
    assert records == [record], "exactly one usage record"
    assert record.delivered_bytes < record.produced_bytes, record
    assert "analysing the response failed" not in caplog.text
    assert record.outcome == "cancelled"
    assert record.usage_source == "estimated"
    assert record.delivered_output_tokens is not None
    assert record.output_tokens is not None
    assert record.delivered_output_tokens < record.output_tokens
