"""One vocabulary for how a generation ended: each row of the table in docs/architecture.md
("How a generation ended") is a real request through ``install()``'s stack that ends so, and
its stored status, its request log line, the error frame a reader gets and its usage record
say it in the table's words, with what ended it in a field of its own."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import (
    DisconnectMiddleware,
    DrainMiddleware,
    MemoryBackend,
    UsageRecord,
    connect,
    install,
)
from asgi_disconnect import disconnect_policy as policy
from asgi_disconnect.testing import FakeProvider, drive
from asgi_disconnect.testing._driver import lifespan
from asgi_disconnect.upstream import UpstreamStreamError, open_stream
from tests.apps import as_tester, eventually

pytestmark = pytest.mark.anyio

DOC = Path(__file__).parents[2] / "docs" / "architecture.md"
EVENT = b'data: {"choices":[{"delta":{"content":"tok "}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def table() -> dict[str, dict[str, str]]:
    """The rows of the doc's table, by their first cell."""
    text = DOC.read_text()
    section = text.split("## How a generation ended", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def word(cell: str) -> str | None:
    """A cell's word (``none``: None); a cell that names the record's field, that name."""
    if cell == "none":
        return None
    named = re.fullmatch(r"the record's `(\w+)`", cell)
    if named:
        return "record." + named.group(1)
    found = re.fullmatch(r"`([\w-]+)`", cell)
    assert found, f"not one word: {cell!r}"
    return found.group(1)


def causes(cell: str) -> dict[str, str]:
    """``stopped_by``: ``owner``, ... as a dict."""
    return dict(re.findall(r"`(\w+)`: `(\w+)`", cell))


@dataclass
class Ended:
    """What each place says of one request that ended."""

    status: str
    line: dict[str, Any]
    frame: dict[str, Any] | None
    record: UsageRecord
    live_frames: list[dict[str, Any]] = field(default_factory=list)


def frames(body: bytes) -> list[dict[str, Any]]:
    return [
        msgspec.json.decode(block.split(b"data: ", 1)[1])["error"]
        for block in body.replace(b"\r\n", b"\n").split(b"\n\n")
        if block.startswith(b"event: error\n")
    ]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))


@pytest.fixture
def lines() -> Any:
    handler = Lines()
    logger = logging.getLogger("asgi_disconnect.requests")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def streaming_app(records: list[UsageRecord], **options: Any) -> Starlette:
    """``/chat`` (the default policy: cancel) and ``/report`` (detach) stream ``events``
    events ``interval`` apart, then ``[DONE]``; ``/cut`` stops without it; ``/broken``
    fails as an upstream does."""

    async def body(request: Request) -> AsyncIterator[bytes]:
        events = int(request.query_params.get("events", "5"))
        interval = float(request.query_params.get("interval", "0.01"))
        for _ in range(events):
            yield EVENT
            await asyncio.sleep(interval)
        if request.url.path == "/broken":
            raise UpstreamStreamError("the provider reset the connection")
        if request.url.path != "/cut":
            yield DONE

    async def chat(request: Request) -> StreamingResponse:
        return StreamingResponse(body(request), media_type="text/event-stream")

    @policy("detach")
    async def report(request: Request) -> StreamingResponse:
        return await chat(request)

    app = Starlette(
        routes=[
            Route("/chat", chat),
            Route("/report", report),
            Route("/cut", chat),
            Route("/broken", chat),
        ]
    )
    install(
        app,
        backend=options.pop("backend", None) or MemoryBackend(),
        sinks=[records.append],
        drain={"signals": False, "deadline": 0.2},
        principal=as_tester,
        request_log="json",
        **options,
    )
    app.middleware_stack = app.build_middleware_stack()
    return app


def part(app: Starlette, kind: type[Any]) -> Any:
    layer: Any = app.middleware_stack
    while not isinstance(layer, kind):
        layer = layer.app
    return layer


async def read_back(app: Starlette, generation_id: str) -> tuple[str, dict[str, Any] | None]:
    """Its status, and the last error frame a reader of its whole stream gets (of one
    still running, what it stored so far)."""
    info = await drive(app, path=f"/generations/{generation_id}")
    status = msgspec.json.decode(info.body)["status"]
    stream = await drive(
        app,
        path=f"/generations/{generation_id}/stream",
        disconnect_after_seconds=0.5 if status == "running" else None,
    )
    found = frames(stream.body)
    return status, found[-1] if found else None


async def ended(
    app: Starlette, records: list[UsageRecord], lines: Lines, live: bytes = b""
) -> Ended:
    await eventually(lambda: records and lines.lines, what="the record and its line")
    (record,) = records
    (line,) = lines.lines
    assert record.generation_id is not None
    status, frame = await read_back(app, record.generation_id)
    return Ended(status, line, frame, record, frames(live))


Scenario = Callable[[list[UsageRecord], Lines], Awaitable[Ended]]


async def whole(records: list[UsageRecord], lines: Lines) -> Ended:
    app = streaming_app(records)
    async with lifespan(app):
        result = await drive(app, path="/chat")
        assert result.body.endswith(DONE)
        return await ended(app, records, lines, result.body)


async def client_left_cancel(records: list[UsageRecord], lines: Lines) -> Ended:
    app = streaming_app(records)
    async with lifespan(app):
        await drive(app, path="/chat", query_string=b"events=200", disconnect_after_bytes=100)
        return await ended(app, records, lines)


async def client_left_detach(records: list[UsageRecord], lines: Lines) -> Ended:
    app = streaming_app(records)
    async with lifespan(app):
        await drive(app, path="/report", query_string=b"events=30", disconnect_after_bytes=100)
        return await ended(app, records, lines)


async def stop(records: list[UsageRecord], lines: Lines) -> Ended:
    app = streaming_app(records)
    async with lifespan(app):
        reading = asyncio.ensure_future(
            drive(app, path="/report", query_string=b"events=500", timeout=10)
        )
        generation_id = await running(app, reading)
        stopped = await drive(app, method="POST", path=f"/generations/{generation_id}/cancel")
        assert stopped.status == 200
        result = await reading
        return await ended(app, records, lines, result.body)


async def running(app: Starlette, reading: asyncio.Future[Any]) -> str:
    """The id of the one generation running, once it produced a few events."""
    backend = part(app, DisconnectMiddleware).backend

    async def found() -> bool:
        listed = await backend.recent(status="running")
        return bool(listed) and listed[0].size > 3 * len(EVENT)

    await eventually(found, what="a running generation")
    (info,) = await backend.recent(status="running")
    assert not reading.done()
    return str(info.id)


async def drain(records: list[UsageRecord], lines: Lines) -> Ended:
    app = streaming_app(records)
    async with lifespan(app):
        reading = asyncio.ensure_future(
            drive(app, path="/chat", query_string=b"events=500", timeout=10)
        )
        await running(app, reading)
        await part(app, DrainMiddleware).drain()
        result = await reading
        return await ended(app, records, lines, result.body)


async def shutdown(records: list[UsageRecord], lines: Lines) -> Ended:
    backend = MemoryBackend()
    app = streaming_app(records, backend=backend, shutdown_timeout=0.1)
    async with lifespan(app):
        await drive(app, path="/report", query_string=b"events=500", disconnect_after_bytes=100)
    # The process stopped; its store still answers a reader (a durable one would, later).
    async with lifespan(app):
        return await ended(app, records, lines)


async def truncated(records: list[UsageRecord], lines: Lines) -> Ended:
    app = streaming_app(records)
    async with lifespan(app):
        result = await drive(app, path="/cut")
        return await ended(app, records, lines, result.body)


async def upstream_failed(records: list[UsageRecord], lines: Lines) -> Ended:
    app = streaming_app(records)
    async with lifespan(app):
        result = await drive(app, path="/broken")
        return await ended(app, records, lines, result.body)


async def handover(records: list[UsageRecord], lines: Lines, url: str) -> Ended:
    """A detached report whose process shuts down before it ends, on a store another replica
    could take it over from: left to the next owner."""
    async with (
        FakeProvider(tokens=400, tokens_per_second=50) as provider,
        httpx.AsyncClient(base_url=provider.url) as client,
    ):

        @policy("detach")
        async def relay(request: Request) -> StreamingResponse:
            outgoing = client.build_request(
                "POST",
                "/v1/chat/completions",
                json={"model": "fake-model", "stream": True, "messages": [{"role": "user"}]},
            )
            stream = await open_stream(
                client, outgoing, upstream="fake", continuation="continue_final_message"
            )
            return StreamingResponse(stream, media_type="text/event-stream")

        app = Starlette(routes=[Route("/relay", relay, methods=["POST"])])
        install(
            app,
            backend=connect(url, flush_interval=0.02, lease=0.3),
            sinks=[records.append],
            principal=as_tester,
            request_log="json",
            upstreams={"fake": client},
            shutdown_timeout=0.1,
        )
        async with lifespan(app):
            await drive(app, method="POST", path="/relay", disconnect_after_bytes=300)
        # Another process reads the store: its status, and what a reader gets.
        reader = Starlette()
        install(reader, backend=connect(url), principal=as_tester)
        async with lifespan(reader):
            return await ended(reader, records, lines)


SCENARIOS: dict[str, Scenario] = {
    "the whole answer": whole,
    "the client left, the route cancels": client_left_cancel,
    "the client left, the route detaches, the work completed": client_left_detach,
    "its owner's Stop": stop,
    "a drain's deadline": drain,
    "a shutdown": shutdown,
    "left to another replica": handover,  # type: ignore[dict-item]
    "the stream ended without its terminal marker": truncated,
    "the upstream failed": upstream_failed,
}


def test_every_ending_of_the_table_is_driven_here() -> None:
    assert set(table()) == set(SCENARIOS)


@pytest.mark.parametrize("ending", list(SCENARIOS))
async def test_each_place_says_how_it_ended_in_the_tables_words(
    ending: str, lines: Lines, sqlite_url: str
) -> None:
    row = table()[ending]
    records: list[UsageRecord] = []
    scenario = SCENARIOS[ending]
    if scenario is handover:  # type: ignore[comparison-overlap]
        got = await handover(records, lines, sqlite_url)
    else:
        got = await scenario(records, lines)
    record, line = got.record, got.line
    assert got.status == word(row["status"]), "the status"
    assert line["end"] == word(row["log `end`"]), "the log line"
    assert record.outcome == word(row["record `outcome`"]), "the record"
    frame_type = word(row["frame `type`"])
    if frame_type is not None and frame_type.startswith("record."):
        frame_type = getattr(record, frame_type.removeprefix("record."))
    assert (got.frame or {}).get("type") == frame_type, "the frame a reader gets"
    for live in got.live_frames:  # a client that stayed got the same frame
        assert live["type"] == frame_type
    said = causes(row["what says why"])
    assert line["stopped_by"] == record.stopped_by == said.get("stopped_by")
    if got.frame is not None and "stopped_by" in said:
        assert got.frame["stopped_by"] == said["stopped_by"]
    if "disconnect_reason" in said:
        assert line["disconnect_reason"] == said["disconnect_reason"]
    if "detached" in said:
        assert line["detached"] is record.detached is (said["detached"] == "true")
    # The route's policy, however it ended.
    assert line["policy"] == record.policy
    assert record.policy == ("cancel" if record.route in ("/chat", "/cut", "/broken") else "detach")


@pytest.mark.parametrize("route", ["/chat", "/report"])
async def test_a_completed_routes_record_says_its_policy(route: str, tmp_path: Path) -> None:
    """Nobody left: the record still says the route's policy, not null, and so does the
    stored generation (``GET /generations/{id}``, the CLI's list)."""
    records: list[UsageRecord] = []
    backend = connect(f"sqlite:///{tmp_path / 'g.db'}", flush_interval=0.02)
    app = streaming_app(records, backend=backend)
    async with lifespan(app):
        result = await drive(app, path=route)
        await eventually(lambda: records, what="the record")
        generation_id = result.header("x-generation-id")
        assert generation_id is not None
        await eventually(lambda: backend.pending_bytes() == 0, what="the flush")  # type: ignore[attr-defined]
        info = await backend.get(generation_id)  # type: ignore[attr-defined]
    assert result.body.endswith(DONE)
    (record,) = records
    assert record.outcome == "complete"
    assert record.policy == {"/chat": "cancel", "/report": "detach"}[route]
    assert record.detached is False
    assert info is not None
    assert info.policy == record.policy
    assert info.detached is False
