"""Which requests get a usage record, and what metering costs a request, counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import MemoryBackend, UsageRecord, install, metered
from asgi_disconnect.testing import drive
from asgi_disconnect.testing._driver import lifespan
from tests.apps import eventually

pytestmark = pytest.mark.anyio

CHAT = {
    "object": "chat.completion",
    "model": "m",
    "choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1},
}
EVENTS = [b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'] * 20 + [b"data: [DONE]\n\n"]


async def events() -> AsyncIterator[bytes]:
    for event in EVENTS:
        yield event
        await asyncio.sleep(0.002)


async def health(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def listing(request: Request) -> Response:
    return JSONResponse([{"route": "/chat", "outcome": "complete"}])  # the app's own JSON


async def page(request: Request) -> Response:
    return HTMLResponse("<p>hello</p>")


async def chat_json(request: Request) -> Response:
    return JSONResponse(CHAT)


async def stream(request: Request) -> Response:
    return StreamingResponse(events(), media_type="text/event-stream")


@metered(False)
async def quiet_stream(request: Request) -> Response:
    return StreamingResponse(events(), media_type="text/event-stream")


@metered()
async def odd_json(request: Request) -> Response:
    return JSONResponse([1, 2, 3])


@metered("anthropic_messages")
async def named(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def fails(request: Request) -> Response:
    raise RuntimeError("boom")


def app_with(records: list[UsageRecord], *sinks: Callable[[UsageRecord], object]) -> Starlette:
    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/list", listing),
            Route("/page", page),
            Route("/chat", chat_json),
            Route("/stream", stream),
            Route("/quiet", quiet_stream),
            Route("/odd", odd_json),
            Route("/named", named),
            Route("/fails", fails),
        ]
    )
    install(app, backend=MemoryBackend(), sinks=[records.append, *sinks])
    return app


async def settle() -> None:
    await asyncio.sleep(0.05)  # anything queued would have been emitted by now


async def test_only_llm_responses_and_marked_routes_get_a_record() -> None:
    records: list[UsageRecord] = []
    app = app_with(records)
    async with lifespan(app):
        for path in ("/health", "/list", "/page", "/quiet"):
            result = await drive(app, path=path)
            assert result.status == 200
        await settle()
        assert records == [], "a health check, a list, a page, a route @metered(False)"
        for path in ("/chat", "/stream", "/odd", "/named"):
            await drive(app, path=path)
        await eventually(lambda: len(records) == 4)
        with pytest.raises(RuntimeError, match="boom"):
            await drive(app, path="/fails")
        await eventually(lambda: len(records) == 5)
        await settle()
    by_route = {record.route: record for record in records}
    assert len(by_route) == len(records) == 5
    assert by_route["/chat"].provider == "openai_chat"
    assert by_route["/chat"].output_tokens == 1
    assert by_route["/stream"].outcome == "complete"
    assert by_route["/odd"].usage_source == "none"  # marked: recorded, usage unknown
    assert by_route["/named"].provider == "anthropic_messages"
    assert by_route["/fails"].outcome == "error"  # failed before its response started


async def test_under_a_disconnect_a_metered_stream_gets_one_record_an_unmetered_none() -> None:
    records: list[UsageRecord] = []
    app = app_with(records)
    async with lifespan(app):
        cut = await drive(app, path="/quiet", disconnect_after_bytes=60)
        assert cut.disconnected
        await settle()
        assert records == []
        cut = await drive(app, path="/stream", disconnect_after_bytes=60)
        assert cut.disconnected
        await eventually(lambda: records)
        await settle()
    (record,) = records
    assert record.outcome == "cancelled"
    assert record.delivered_bytes <= record.produced_bytes < len(b"".join(EVENTS))


def test_a_bad_provider_name_is_refused() -> None:
    with pytest.raises(ValueError, match="provider must be one of"):
        metered("openai")


async def test_an_async_sink_is_awaited_in_order_by_one_emitter() -> None:
    seen: list[str | None] = []

    async def slow_sink(record: UsageRecord) -> None:
        await asyncio.sleep(0.01)
        seen.append(record.generation_id)

    records: list[UsageRecord] = []
    app = app_with(records, slow_sink)
    async with lifespan(app):
        for _ in range(5):
            await drive(app, path="/chat")
        assert len(records) == 5  # the synchronous sink, at once
        # Shutdown drains the emitter: every awaited sink finished, in order.
    assert seen == [record.generation_id for record in records]


class TaskCounter:
    def __init__(self) -> None:
        self.count = 0

    def __call__(
        self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any
    ) -> asyncio.Task[Any]:
        self.count += 1
        return asyncio.Task(coro, loop=loop, **kwargs)


async def tasks_for(app: Starlette, path: str, requests: int) -> float:
    loop = asyncio.get_running_loop()
    counter = TaskCounter()
    loop.set_task_factory(counter)  # type: ignore[arg-type]
    try:
        for _ in range(requests):
            result = await drive(app, path=path)
            assert result.complete
    finally:
        loop.set_task_factory(None)
    return counter.count / requests


async def test_what_a_request_creates_is_counted() -> None:
    """The budget, enforced: tasks per request through install(), beyond what the test
    driver itself starts, and none per chunk."""
    bare = Starlette(routes=[Route("/chat", chat_json), Route("/stream", stream)])
    records: list[UsageRecord] = []
    app = app_with(records)
    async with lifespan(app):
        json_bare = await tasks_for(bare, "/chat", 20)
        json_installed = await tasks_for(app, "/chat", 20)
        stream_bare = await tasks_for(bare, "/stream", 5)
        stream_installed = await tasks_for(app, "/stream", 5)
        await settle()
    assert len(records) == 25
    # A route that can only cancel runs inline once learned (its first request runs
    # supervised: a task for the app, one watching receive, the client writer), and no
    # task emits its record. A stream inline: the watcher and the client writer, nothing
    # per chunk (21 chunks each here): 3 + 2 + 2 + 2 + 2 over five streams.
    assert json_installed - json_bare <= 0.5, (json_bare, json_installed)
    assert stream_installed - stream_bare <= (3 + 2 * 4) / 5, (stream_bare, stream_installed)


async def garbage_per_request(app: Starlette, path: str, requests: int) -> float:
    """Objects the cyclic garbage collector has to find per request: what reference
    counting could not free (each costs the collector's time, on every request).

    The collector sees the whole process: a thread an earlier test left winding down can
    leave a cycle of its own in a window. A cycle per request is in every window, so the
    fewest of three windows is the request's."""
    import gc

    for _ in range(5):
        await drive(app, path=path)
    windows = []
    for _ in range(3):
        gc.collect()
        gc.disable()
        try:
            for _ in range(requests):
                await drive(app, path=path)
            await settle()
            windows.append(gc.collect())
        finally:
            gc.enable()
        if windows[-1] == 0:
            break
    return min(windows) / requests


async def test_a_request_leaves_no_cycles_for_the_collector() -> None:
    records: list[UsageRecord] = []
    app = app_with(records)
    bare = Starlette(routes=[Route("/chat", chat_json)])
    async with lifespan(app):
        assert await garbage_per_request(bare, "/chat", 50) == 0
        # The request state, the exchange, metering's tee and the generation refer to each
        # other while the request runs; the end of the exchange breaks every link.
        assert await garbage_per_request(app, "/chat", 50) == 0
