"""The same behaviour on every server, with the middleware outermost and inside Starlette's.

Servers: uvicorn, hypercorn over HTTP/1.1 and over HTTP/2 (h2c), granian. Placements (see
``tests.integration.matrix_app``): ``outermost``, where ``DisconnectMiddleware`` gets the
server's own ``send``, and ``inside``, where it gets Starlette's wrapper of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from asgi_disconnect.testing import (
    FakeProvider,
    h2_request,
    h2_stalled_request,
    request,
    run_server,
    stalled_request,
)
from tests.integration.matrix_app import PLACEMENTS, UPSTREAM_ENV, Placement, make_app

if TYPE_CHECKING:
    from collections.abc import Iterator

    from _pytest.mark.structures import ParameterSet

    from asgi_disconnect import UsageRecord
    from asgi_disconnect.testing import ClientResult, RunningServer, ServerName

pytestmark = [pytest.mark.anyio, pytest.mark.server]

SERVERS: list[ServerName] = ["uvicorn", "hypercorn", "hypercorn-h2", "granian"]
TOKENS = 200
pytestmark.append(pytest.mark.provider(tokens=TOKENS, tokens_per_second=400))
DONE = b"data: [DONE]\n\n"


def cells() -> list[ParameterSet]:
    """(server, placement) pairs."""
    return [
        pytest.param(server, placement, id=f"{server}-{placement}")
        for server in SERVERS
        for placement in PLACEMENTS
    ]


@contextlib.contextmanager
def serve(
    provider: FakeProvider, server: ServerName, placement: Placement, **options: Any
) -> Iterator[tuple[RunningServer, dict[str, bytearray]]]:
    app, produced = make_app(provider.url, placement, **options)
    with run_server(app, server=server, shutdown_timeout=5) as srv:
        yield srv, produced


async def call(srv: RunningServer, path: str, **options: Any) -> ClientResult:
    """POST `path` over the protocol the server is served with."""
    client = h2_request if srv.http2 else request
    return await client(srv.url + path, method="POST", timeout=15, **options)


async def ended(srv: RunningServer, generation_id: str, timeout: float = 10) -> dict[str, Any]:
    """The generation's info once it is no longer running."""
    async with srv.client() as client, asyncio.timeout(timeout):
        while True:
            response = await client.get(f"/generations/{generation_id}")
            info: dict[str, Any] = msgspec.json.decode(response.content)
            if info["status"] != "running":
                return info
            await asyncio.sleep(0.02)


def tokens_in(body: bytes) -> int:
    """FakeProvider's tokens are "tok0 ", "tok1 ", ..."""
    return len(re.findall(rb"tok\d+ ", body))


def generation_id(result: ClientResult) -> str:
    ids = [value for name, value in result.headers_list if name.lower() == "x-generation-id"]
    assert len(ids) == 1, result.headers_list
    return ids[0]


def stream_problems(body: bytes) -> list[str]:
    """What is wrong with a streamed answer: [] for every token once, then [DONE]."""
    events = body.split(b"\n\n")
    problems = []
    if b"event: error" in body:
        problems.append("an event: error frame")
    if repeated := len(events) - len(set(events)):
        problems.append(f"{repeated} event(s) written twice")
    if (tokens := tokens_in(body)) != TOKENS:
        problems.append(f"{tokens} of {TOKENS} tokens")
    if not body.endswith(DONE):
        problems.append("no [DONE] at the end")
    return problems


@pytest.mark.parametrize(("server", "placement"), cells())
async def test_a_full_stream_reaches_the_client_whole(
    provider: FakeProvider, server: ServerName, placement: Placement
) -> None:
    with serve(provider, server, placement) as (srv, produced):
        result = await call(srv, "/in-generator")
        gid = generation_id(result)
        info = await ended(srv, gid)
    assert (info["status"], info["error"], stream_problems(result.body)) == ("complete", None, [])
    assert (result.status, result.stopped_by) == (200, "complete")
    assert result.body == bytes(produced[gid])
    assert info["size"] == len(result.body)


def http1_cells() -> list[ParameterSet]:
    """(server, placement) pairs over HTTP/1.1, where a client can stop reading."""
    return [cell for cell in cells() if cell.values[0] != "hypercorn-h2"]


@pytest.mark.parametrize(("server", "placement"), http1_cells())
@pytest.mark.provider(tokens=100_000, tokens_per_second=0)
async def test_a_client_that_stops_reading_is_cancelled_after_max_lag_seconds(
    provider: FakeProvider, server: ServerName, placement: Placement
) -> None:
    """The socket stays open and nothing more is read: after ``max_lag_seconds`` the client
    counts as gone and the route's policy (cancel) closes the upstream, on every server."""
    options = {"max_lag_bytes": 256 * 1024, "max_lag_seconds": 1.0, "client_timeout": None}
    with serve(provider, server, placement, **options) as (srv, _):
        client = await stalled_request(srv.url + "/in-generator", method="POST", read_bytes=100)
        try:
            (upstream,) = await provider.await_requests(1)
            started = asyncio.get_running_loop().time()
            assert await upstream.await_closed(timeout=15)
            waited = asyncio.get_running_loop().time() - started
            info = await ended(srv, client.headers["x-generation-id"])
        finally:
            await client.close()
    assert info["status"] == "cancelled", info
    assert upstream.connection_closed_early
    assert upstream.tokens_sent < upstream.tokens_planned
    # Not 15 s later (the lag was once checked every 15 s); no timing beyond that is asserted.
    assert waited < 10, waited


@pytest.mark.parametrize(("server", "placement"), cells())
async def test_cancel_closes_the_upstream_when_the_client_hangs_up(
    provider: FakeProvider, server: ServerName, placement: Placement
) -> None:
    with serve(provider, server, placement) as (srv, _):
        result = await call(srv, "/in-generator", disconnect_after_bytes=2000)
        (upstream,) = await provider.await_requests(1)
        assert await upstream.await_closed(timeout=5)
        info = await ended(srv, generation_id(result))
    assert info["status"] == "cancelled", info["error"]
    assert result.stopped_by == "disconnect_after_bytes"
    assert upstream.connection_closed_early
    assert upstream.tokens_sent < upstream.tokens_planned


@pytest.mark.parametrize(("server", "placement"), cells())
async def test_detach_finishes_and_replays_from_offset_zero(
    provider: FakeProvider, server: ServerName, placement: Placement
) -> None:
    with serve(provider, server, placement) as (srv, produced):
        result = await call(srv, "/detach", disconnect_after_bytes=2000)
        gid = generation_id(result)
        info = await ended(srv, gid)
        (upstream,) = provider.requests
        assert await upstream.await_closed(timeout=5)
        async with srv.client(timeout=15) as client:
            replay = await client.get(f"/generations/{gid}/stream", params={"offset": 0})
    assert (info["status"], info["error"], info["detached"]) == ("complete", None, True)
    assert result.stopped_by == "disconnect_after_bytes"
    assert upstream.finished
    assert not upstream.connection_closed_early
    assert replay.status_code == 200
    assert replay.content == bytes(produced[gid])
    assert replay.content.startswith(result.body)
    assert stream_problems(replay.content) == []


@pytest.mark.parametrize(("server", "placement"), cells())
async def test_a_json_route_answers_once(
    provider: FakeProvider, server: ServerName, placement: Placement
) -> None:
    with serve(provider, server, placement) as (srv, _):
        result = await call(srv, "/non-streaming")
        gid = generation_id(result)
        info = await ended(srv, gid)
    assert (result.status, result.stopped_by) == (200, "complete")
    answer = msgspec.json.decode(result.body)
    assert answer["object"] == "chat.completion"
    assert answer["usage"]["completion_tokens"] == TOKENS
    assert len(provider.requests) == 1
    assert (info["status"], info["size"]) == ("complete", len(result.body))


# -- regressions -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["embedded", "process"])
async def test_granian_outermost_streams_are_intact(provider: FakeProvider, mode: str) -> None:
    """granian's ``send()`` returns ``PyEmptyAwaitable``: awaitable, not a coroutine.

    ``embedded`` runs granian in this process's thread; ``process`` runs its command line,
    as in production, on the same app imported by path.
    """
    if mode == "embedded":
        app, _ = make_app(provider.url, "outermost")
        server = run_server(app, server="granian", shutdown_timeout=5)
    else:
        server = run_server(
            "tests.integration.matrix_app:outermost",
            server="granian",
            factory=True,
            env={UPSTREAM_ENV: provider.url},
            shutdown_timeout=5,
        )
    with server as srv:
        result = await request(srv.url + "/in-generator", method="POST", timeout=15)
        info = await ended(srv, generation_id(result))
    assert (info["status"], info["error"], stream_problems(result.body)) == ("complete", None, [])
    assert (result.status, result.stopped_by) == (200, "complete")


class Records:
    """A usage sink that keeps what it got and can be waited on from another thread."""

    def __init__(self) -> None:
        self.records: list[UsageRecord] = []
        self.arrived = threading.Event()

    def __call__(self, record: UsageRecord) -> None:
        self.records.append(record)
        self.arrived.set()

    async def wait(self, timeout: float) -> bool:
        return await asyncio.to_thread(self.arrived.wait, timeout)


async def request_tasks(srv: RunningServer, timeout: float) -> list[str]:
    """The tasks requests left on the server, once they are gone or after `timeout`: the
    middleware's and hypercorn's task that calls the app."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        left = [
            name
            for name in await srv.tasks()
            if name.startswith("asgi_disconnect._")
            or name == "hypercorn.asyncio.task_group._handle"
        ]
        if not left or loop.time() >= deadline:
            return left
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_h2_client_with_a_shut_window_hangs_up_during_the_final_send(
    placement: Placement,
) -> None:
    """The answer is produced whole while the client's window is shut; the last send (the
    one that ends the stream) waits on it when the client hangs up. hypercorn then never
    wakes that send, so only a deadline of the middleware's own ends the exchange."""
    sink = Records()
    # hypercorn's h2 stream buffer takes every body chunk at once, however shut the window;
    # only the send that ends the stream waits, for that buffer to drain.
    with FakeProvider(tokens=60, tokens_per_second=0) as provider:
        app, produced = make_app(provider.url, placement, sinks=[sink], max_lag_seconds=1)
        with run_server(app, server="hypercorn-h2", shutdown_timeout=2) as srv:
            client = await h2_stalled_request(
                srv.url + "/in-generator", method="POST", read_bytes=100, window=1024, timeout=10
            )
            try:
                gid = client.headers["x-generation-id"]
                before = await ended(srv, gid)
                assert before["status"] == "complete"
                assert len(client.body) <= 1024 < len(produced[gid])
            finally:
                await client.close()
            # max_lag_seconds=1: a few seconds are enough for any deadline to have passed.
            await sink.wait(3)
            left = await request_tasks(srv, timeout=1)
            records = [record.generation_id for record in sink.records]
            after = await ended(srv, gid)
    assert (records, left) == ([gid], []), f"3 s after the hang-up: records {records}, tasks {left}"
    assert after["status"] == "complete"
