"""The gateway `benchmarks.load` serves: a Starlette relay in front of FakeProvider, bare or
with ``install()``.

Both apps relay ``POST /v1/chat/completions`` to ``LOAD_UPSTREAM`` with one shared httpx
client, passing on ``x-fake-*`` headers, and answer ``GET /stats`` with what the benchmark
reads from the server: relays in flight, and (wrapped) the usage records a counting sink saw.
``LOAD_BACKEND`` is the wrapped app's backend URL, ``LOAD_FLUSH_INTERVAL`` a durable
backend's ``flush_interval``.

    uvicorn --factory benchmarks._gateway:bare_app
    uvicorn --factory benchmarks._gateway:wrapped_app
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

CHAT = "/v1/chat/completions"


class Stats:
    """Counters the stats route reports; one event loop writes them, so no lock."""

    def __init__(self) -> None:
        self.relays_started = 0
        self.relays_in_flight = 0
        self.records = 0
        self.duplicates = 0  # records for a generation that had one already
        self.seen: set[str] = set()
        self.outcomes: Counter[str] = Counter()
        self.record_output_tokens = 0
        self.record_delivered_tokens = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "relays_started": self.relays_started,
            "relays_in_flight": self.relays_in_flight,
            "records": self.records,
            "duplicates": self.duplicates,
            "outcomes": dict(self.outcomes),
            "record_output_tokens": self.record_output_tokens,
            "record_delivered_tokens": self.record_delivered_tokens,
        }


def _make(*, wrapped: bool) -> tuple[Starlette, Stats]:
    stats = Stats()
    hooks: dict[str, list[Any]] = {}
    if wrapped:
        from asgi_disconnect.upstream import track_response

        hooks = {"response": [track_response]}
    client = httpx.AsyncClient(
        base_url=os.environ.get("LOAD_UPSTREAM", "http://127.0.0.1:8001"),
        timeout=httpx.Timeout(120.0, connect=30.0, pool=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=4096),
        event_hooks=hooks,
    )

    async def relay(body: bytes, headers: dict[str, str]) -> AsyncIterator[bytes]:
        stats.relays_started += 1
        stats.relays_in_flight += 1
        try:
            async with client.stream("POST", CHAT, content=body, headers=headers) as upstream:
                async for chunk in upstream.aiter_raw():
                    yield chunk
        finally:
            stats.relays_in_flight -= 1

    async def chat(request: Request) -> StreamingResponse:
        headers = {"content-type": "application/json"}
        headers.update((k, v) for k, v in request.headers.items() if k.startswith("x-fake-"))
        return StreamingResponse(
            relay(await request.body(), headers), media_type="text/event-stream"
        )

    async def stats_route(request: Request) -> JSONResponse:
        return JSONResponse(stats.as_json())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(
        routes=[Route(CHAT, chat, methods=["POST"]), Route("/stats", stats_route)],
        lifespan=lifespan,
    )
    return app, stats


def bare_app() -> Starlette:
    return _make(wrapped=False)[0]


def wrapped_app() -> Starlette:
    from asgi_disconnect import UsageRecord, connect, install

    logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
    app, stats = _make(wrapped=True)

    def count(record: UsageRecord) -> None:
        if record.method != "POST":
            return
        stats.records += 1
        if record.generation_id is not None:
            if record.generation_id in stats.seen:
                stats.duplicates += 1
            stats.seen.add(record.generation_id)
        stats.outcomes[record.outcome] += 1
        stats.record_output_tokens += record.output_tokens or 0
        stats.record_delivered_tokens += record.delivered_output_tokens or 0

    url = os.environ.get("LOAD_BACKEND", "memory://")
    options: dict[str, float] = {}
    if os.environ.get("LOAD_FLUSH_INTERVAL") and not url.startswith("memory:"):
        options["flush_interval"] = float(os.environ["LOAD_FLUSH_INTERVAL"])
    install(
        app,
        backend=connect(url, **options),
        sinks=[count],
        exclude_paths=[r"/stats$"],
    )
    return app
