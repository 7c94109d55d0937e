"""An upstream that fails is one WARNING line with its error type and generation id, and an
answer to the client, never an ``Exception in ASGI application`` traceback: on uvicorn,
through ``install()``, against an upstream that refuses connections and FakeProvider dying
mid-stream. Each route runs twice: supervised, then inline once its policy is learned."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator

import httpx
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import MemoryBackend, UsageRecord, disconnect_policy, install
from asgi_disconnect.testing import FakeProvider, request, run_server
from asgi_disconnect.upstream import UpstreamStatusError, open_stream
from tests.apps import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.server]

BODY = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def relay(
    upstream_url: str, records: list[UsageRecord], first_token_timeout: float = 10
) -> Starlette:
    """The quickstart's relay: the provider's refusals passed on, nothing else caught."""
    client = httpx.AsyncClient(base_url=upstream_url, timeout=httpx.Timeout(None, connect=5))

    async def chat(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.startswith("x-fake-")}
        outgoing = client.build_request("POST", "/v1/chat/completions", json=BODY, headers=headers)
        try:
            upstream = await open_stream(client, outgoing, first_token_timeout=first_token_timeout)
        except UpstreamStatusError as exc:
            return JSONResponse(exc.error, status_code=exc.status_code)
        return StreamingResponse(upstream, media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    @disconnect_policy("detach")
    async def report(request: Request) -> Response:
        return await chat(request)

    app = Starlette(
        routes=[Route("/chat", chat, methods=["POST"]), Route("/report", report, methods=["POST"])],
        lifespan=lifespan,
    )
    install(app, backend=MemoryBackend(), sinks=[records.append])
    return app


class Everything(logging.Handler):
    """Every log record of the process at WARNING and above, the server's included."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def server_log() -> Iterator[Everything]:
    handler = Everything()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)


def one_line_each(log: Everything, generation_ids: list[str], error_type: str) -> None:
    """Exactly one WARNING line per request, naming it and the error type; no traceback."""
    assert all(r.exc_info is None for r in log.records), [r.getMessage() for r in log.records]
    messages = [r.getMessage() for r in log.records]
    assert not any("Exception in ASGI application" in m for m in messages), messages
    assert len(messages) == len(generation_ids), messages
    for generation_id, record in zip(generation_ids, log.records, strict=True):
        assert record.name == "asgi_disconnect"
        assert record.levelno == logging.WARNING
        message = record.getMessage()
        assert generation_id in message
        assert f": {error_type}: " in message
        assert "\n" not in message


async def test_an_upstream_that_refuses_connections_is_a_502_problem_and_one_line() -> None:
    with FakeProvider() as gone:
        url = gone.url  # its port closes with it: connections are refused
    records: list[UsageRecord] = []
    with server_log() as log, run_server(relay(url, records)) as server:
        answers = [await request(f"{server.url}/chat", method="POST") for _ in range(2)]
        await eventually(lambda: len(records) == 2, timeout=10, what="two records")
    ids = []
    for answer in answers:
        assert answer.status == 502
        assert answer.headers["content-type"] == "application/problem+json"
        problem = msgspec.json.decode(answer.body)
        assert problem["type"] == "urn:asgi-disconnect:problem:upstream-unreachable"
        assert problem["status"] == 502
        assert "ConnectError" in problem["detail"]
        ids.append(answer.headers.get("x-generation-id"))
    # The id its log line and record carry, for the caller to quote.
    assert sorted(ids) == sorted(record.generation_id for record in records)
    one_line_each(log, ids, "upstream_unreachable")
    for record in records:
        assert record.outcome == "error"
        assert record.error_type == "upstream_unreachable"


async def test_an_upstream_that_never_answers_is_a_504_problem_and_one_line() -> None:
    records: list[UsageRecord] = []
    with socket.socket() as silent:  # listens, never accepts: the request waits unanswered
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with server_log() as log, run_server(relay(url, records, 0.3)) as server:
            answer = await request(f"{server.url}/chat", method="POST")
            await eventually(lambda: records, timeout=10, what="the record")
    assert answer.status == 504
    problem = msgspec.json.decode(answer.body)
    assert problem["type"] == "urn:asgi-disconnect:problem:first-token-timeout"
    assert problem["title"] == "Gateway Timeout"
    one_line_each(log, [records[0].generation_id or ""], "first_token_timeout")


@pytest.mark.parametrize(
    ("fault", "error_type", "frame_type"),
    [
        ("reset-after=5", "truncated_stream", "truncated_stream"),
        ("error-after=5", "upstream_error", "server_error"),
    ],
)
async def test_an_upstream_that_dies_mid_stream_is_an_error_frame_and_one_line(
    fault: str, error_type: str, frame_type: str
) -> None:
    records: list[UsageRecord] = []
    with (
        FakeProvider(tokens=30, tokens_per_second=300) as provider,
        server_log() as log,
        run_server(relay(provider.url, records)) as server,
    ):
        answers = [
            await request(f"{server.url}/chat", method="POST", headers={"x-fake-fault": fault})
            for _ in range(2)
        ]
        await eventually(lambda: len(records) == 2, timeout=10, what="two records")
    ids = []
    for answer in answers:
        assert answer.status == 200
        assert answer.complete  # ended properly, with its error frame: not cut
        assert b"data: [DONE]" not in answer.body
        last = answer.body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        assert msgspec.json.decode(last.split(b"data: ", 1)[1])["error"]["type"] == frame_type
        ids.append(answer.headers["x-generation-id"])
    one_line_each(log, ids, error_type)
    assert sorted(record.generation_id or "" for record in records) == sorted(ids)


async def test_detached_work_whose_upstream_dies_is_one_line() -> None:
    records: list[UsageRecord] = []
    with (
        FakeProvider(tokens=40, tokens_per_second=100) as provider,
        server_log() as log,
        run_server(relay(provider.url, records)) as server,
    ):
        left = await request(
            f"{server.url}/report",
            method="POST",
            headers={"x-fake-fault": "reset-after=20"},
            disconnect_after_bytes=600,
        )
        await eventually(lambda: records, timeout=10, what="the record")
    assert left.stopped_by == "disconnect_after_bytes"
    (record,) = records
    assert record.detached
    assert record.outcome == "truncated"
    one_line_each(log, [left.headers["x-generation-id"]], "truncated_stream")
