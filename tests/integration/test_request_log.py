"""One log line per LLM request, when its usage record is final: on uvicorn, through
``install()`` with idempotency, drain and a SQLite store, against FakeProvider, under a real
client disconnect. The line says how the request ended and carries the record's figures."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import UsageRecord, connect, disconnect_policy, install
from asgi_disconnect.testing import FakeProvider, request, run_server
from asgi_disconnect.upstream import UpstreamStatusError, open_stream
from tests.apps import as_tester, eventually

pytestmark = [pytest.mark.anyio, pytest.mark.server]

BODY = {
    "model": "fake-model",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "hi"}],
}


def relay(upstream_url: str) -> Starlette:
    """The quickstart's relay: ``/chat`` cancels, ``/report`` detaches; ``x-fake-fault``
    goes upstream."""
    client = httpx.AsyncClient(base_url=upstream_url, timeout=httpx.Timeout(None, connect=5))

    async def forward(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.startswith("x-fake-")}
        outgoing = client.build_request("POST", "/v1/chat/completions", json=BODY, headers=headers)
        try:
            upstream = await open_stream(client, outgoing, first_token_timeout=10)
        except UpstreamStatusError as exc:
            return JSONResponse(exc.error, status_code=exc.status_code)
        return StreamingResponse(upstream, media_type="text/event-stream")

    @disconnect_policy("cancel")
    async def chat(request: Request) -> Response:
        return await forward(request)

    @disconnect_policy("detach")
    async def report(request: Request) -> Response:
        return await forward(request)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    return Starlette(
        routes=[Route("/chat", chat, methods=["POST"]), Route("/report", report, methods=["POST"])],
        lifespan=lifespan,
    )


class Lines(logging.Handler):
    """Every record of the ``asgi_disconnect`` loggers, from the server's thread too."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def requests(self) -> list[logging.LogRecord]:
        return [r for r in self.records if r.name == "asgi_disconnect.requests"]


@contextlib.contextmanager
def captured() -> Iterator[Lines]:
    lines = Lines()
    logger = logging.getLogger("asgi_disconnect")
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)


def installed(tmp_path: Path, upstream: str, records: list[UsageRecord], **options: Any) -> Any:
    app = relay(upstream)
    install(
        app,
        backend=connect(f"sqlite:///{tmp_path / 'log.db'}"),
        idempotency=True,
        drain={"signals": False, "drain_token": "op"},
        principal=as_tester,
        sinks=[records.append],
        **options,
    )
    return app


async def test_each_request_logs_one_json_line_that_agrees_with_its_usage_record(
    tmp_path: Path,
) -> None:
    records: list[UsageRecord] = []
    with (
        FakeProvider(tokens=60, tokens_per_second=120) as provider,
        captured() as lines,
        run_server(installed(tmp_path, provider.url, records, request_log="json")) as server,
    ):
        whole = await request(f"{server.url}/chat", method="POST")
        cut = await request(f"{server.url}/chat", method="POST", disconnect_after_bytes=800)
        left = await request(f"{server.url}/report", method="POST", disconnect_after_bytes=800)
        await eventually(
            lambda: len(records) == 3 and len(lines.requests()) == 3,
            timeout=20,
            what="three records and three lines",
        )
    assert whole.complete
    assert cut.stopped_by == left.stopped_by == "disconnect_after_bytes"
    by_id = {record.generation_id: record for record in records}
    logged = {}
    for line in lines.requests():
        assert line.levelno == logging.INFO
        values = json.loads(line.getMessage())
        assert list(values) == [
            "generation_id",
            "method",
            "route",
            "status_code",
            "policy",
            "end",
            "stopped_by",
            "disconnect_reason",
            "detached",
            "error_type",
            "model",
            "input_tokens",
            "output_tokens",
            "delivered_output_tokens",
            "usage_source",
            "delivery",
            "duration",
        ]
        logged[values["generation_id"]] = values
    assert set(logged) == set(by_id)
    for generation_id, values in logged.items():
        record = by_id[generation_id]
        assert values["output_tokens"] == record.output_tokens
        assert values["delivered_output_tokens"] == record.delivered_output_tokens
        assert values["input_tokens"] == record.input_tokens
        assert values["usage_source"] == record.usage_source
        assert values["end"] == record.outcome
        assert values["policy"] == record.policy
        assert values["route"] == record.route
        assert values["status_code"] == 200
        assert values["duration"] == round(record.duration, 3)
    first = logged[whole.headers["x-generation-id"]]
    assert first["end"] == "complete"
    assert first["policy"] == "cancel"  # the route's, though nobody left
    assert first["detached"] is False
    assert first["output_tokens"] == first["delivered_output_tokens"] == 60
    assert first["usage_source"] == "provider"
    second = logged[cut.headers["x-generation-id"]]
    assert second["end"] == "cancelled"
    assert second["policy"] == "cancel"
    assert second["disconnect_reason"] == "client"
    assert second["delivered_output_tokens"] <= second["output_tokens"] < 60  # it stopped
    third = logged[left.headers["x-generation-id"]]
    assert third["end"] == "complete"
    assert third["policy"] == "detach"
    assert third["detached"] is True
    assert third["disconnect_reason"] == "client"
    assert third["output_tokens"] == 60
    assert third["delivered_output_tokens"] < 60


async def test_the_text_line_says_cancelled_with_the_records_figures(tmp_path: Path) -> None:
    records: list[UsageRecord] = []
    with (
        FakeProvider(tokens=60, tokens_per_second=120) as provider,
        captured() as lines,
        run_server(installed(tmp_path, provider.url, records)) as server,
    ):
        cut = await request(f"{server.url}/chat", method="POST", disconnect_after_bytes=800)
        await eventually(
            lambda: records and lines.requests(), timeout=20, what="a record and its line"
        )
    (record,) = records
    (line,) = lines.requests()
    text = line.getMessage()
    assert text.startswith(f"{cut.headers['x-generation-id']} POST /chat status=200 ")
    assert " policy=cancel end=cancelled disconnect=client " in text
    # Cancelled, the provider's usage never came: the counts are estimates, and say so.
    assert record.usage_source == "estimated"
    assert (
        f" tokens in=~{record.input_tokens} billed=~{record.output_tokens} "
        f"delivered=~{record.delivered_output_tokens} usage=estimated "
    ) in text
    assert record.delivered_output_tokens is not None
    assert record.output_tokens is not None
    assert record.delivered_output_tokens <= record.output_tokens < 60  # it stopped
    assert text.endswith(f" duration={record.duration:.3f}s")


@pytest.mark.parametrize("off", ["option", "logger"])
async def test_no_line_when_turned_off_or_when_the_logger_says_no(tmp_path: Path, off: str) -> None:
    records: list[UsageRecord] = []
    options = {"request_log": None} if off == "option" else {}
    with (
        FakeProvider(tokens=20, tokens_per_second=500) as provider,
        captured() as lines,
        run_server(installed(tmp_path, provider.url, records, **options)) as server,
    ):
        if off == "logger":
            logging.getLogger("asgi_disconnect.requests").setLevel(logging.WARNING)
        try:
            whole = await request(f"{server.url}/chat", method="POST")
            await eventually(lambda: records, timeout=10, what="the record")
        finally:
            logging.getLogger("asgi_disconnect.requests").setLevel(logging.NOTSET)
    assert whole.complete
    assert records[0].output_tokens == 20
    assert lines.requests() == []
