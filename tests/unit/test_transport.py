"""The transport: what the kernel says of a connection, and how it is read.

The arithmetic of :class:`ConnectionWatch` on hand-made samples; :class:`SockDiag` and
:func:`tune_listeners` on real loopback sockets; the middleware's option and its startup
message; a streamed response through ``install()`` under uvicorn, settled by what the
client's TCP acknowledged. Silent clients on a real network: tests/integration/
test_silent_clients.py.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import (
    DisconnectMiddleware,
    MemoryBackend,
    UsageRecord,
    disconnect_policy,
    install,
)
from asgi_disconnect._transport import (
    ConnectionWatch,
    SockDiag,
    TcpSample,
    listening_sockets,
    tune_listeners,
)
from asgi_disconnect.testing import run_server

pytestmark = pytest.mark.anyio
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")
TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)


def sample(acked: int, queued: int = 0, *, state: int = 1, last_ack_ms: int = 0) -> TcpSample:
    return TcpSample(state, acked, queued, last_ack_ms)


def watch(base: int = 100, *, chunked: bool = True) -> ConnectionWatch:
    return ConnectionWatch(b"", sample(base), chunked=chunked, exact=True, on_dead=lambda: None)


def test_acknowledged_wire_bytes_map_to_body_bytes_across_chunk_framing() -> None:
    w = watch(base=100)
    for size in (10, 300, 5):  # on the wire: "a\r\n"+10+"\r\n", "12c\r\n"+300+"\r\n", ...
        w.sizes.append(size)
    w.update(sample(100 + 15))  # the first chunk, framing and all
    assert w.acked_body == 10
    w.update(sample(100 + 15 + 5 + 100))  # the second chunk's size line and 100 of its bytes
    assert w.acked_body == 110
    w.update(sample(100 + 15 + 307 + 10))  # everything, the last chunk's CRLF too
    assert w.acked_body == 315
    assert w.settled


def test_pruned_messages_keep_their_count_and_a_keep_alive_is_not_body() -> None:
    w = watch(base=0)
    w.sizes.append(20)
    w.handed_other(len(b": keep-alive\n\n"))  # 14 bytes + "e\r\n" + "\r\n"
    w.sizes.append(20)
    w.update(sample(26))
    assert w.acked_body == 20
    assert list(w.sizes) == [-19, 20]
    w.update(sample(26 + 19 + 4 + 7))  # the keep-alive, then 7 of the next chunk's bytes
    assert w.acked_body == 27
    w.update(sample(26 + 19 + 26))
    assert w.acked_body == 40
    assert not w.sizes


def test_without_chunked_coding_the_wire_is_the_body() -> None:
    w = watch(base=50, chunked=False)
    w.sizes.extend([1000, 1000])
    w.update(sample(50 + 1500))
    assert w.acked_body == 1500


def test_a_time_wait_socket_acknowledged_everything_and_a_closing_peer_is_final() -> None:
    w = watch()
    w.sizes.extend([5, 5])
    w.update(TcpSample(6, -1, 0, 0))
    assert w.acked_body == 10
    assert w.final
    closing = watch(base=0)
    closing.sizes.extend([5, 5])
    closing.update(sample(8, 6, state=8))  # close-wait: the peer sent its FIN
    assert closing.final
    assert closing.acked_body == 5


async def test_a_connection_gone_is_a_dead_peer_only_after_a_silence_the_kernel_ends() -> None:
    """Gone between two samples: a peer last seen owing bytes for 6 s of a 10 s timeout
    (a link back after a drop, the rest read, the connection closed) got the rest; one owing
    for 9 s was ended by the kernel's user timeout (dead, counted by its last sample); a
    long first token's old acknowledgement is no silence when it owed nothing until then."""
    from asgi_disconnect._transport import TransportMonitor

    monitor = TransportMonitor(client_timeout=10.0)
    monitor._loop = asyncio.get_running_loop()
    now = monitor._loop.time()

    def gone(*, owed_for: float, last_ack_ms: int) -> ConnectionWatch:
        w = watch(base=0)
        w.sizes.extend([100, 100])
        w.update(sample(105, queued=100, last_ack_ms=last_ack_ms))  # the first chunk
        w.sampled_at, w.owed_since = now - 0.5, now - 0.5 - owed_for
        monitor._gone(w)
        return w

    back = gone(owed_for=6.0, last_ack_ms=6000)
    assert not back.dead
    assert back.acked_body == 200
    dead = gone(owed_for=9.0, last_ack_ms=9000)
    assert dead.dead
    assert dead.acked_body == 100
    thinking = gone(owed_for=1.5, last_ack_ms=14000)  # silent 14 s, owing for 1.5 s of it
    assert not thinking.dead
    assert thinking.acked_body == 200


@pytest.fixture
def connection() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
        with client, served:
            yield served, client


@linux
def test_sock_diag_reads_what_the_peer_acknowledged(
    connection: tuple[socket.socket, socket.socket],
) -> None:
    served, client = connection
    diag = SockDiag()
    try:
        request = diag.request(served.getsockname(), served.getpeername())
        before = diag.query(request)
        assert before is not None
        assert before.state == 1
        served.sendall(b"x" * 5000)
        client.recv(5000, socket.MSG_WAITALL)
        deadline = time.monotonic() + 5
        after = diag.query(request)
        while after is not None and after.bytes_acked - before.bytes_acked < 5000:
            assert time.monotonic() < deadline, after
            time.sleep(0.005)
            after = diag.query(request)
        assert after is not None
        assert after.written - before.written == 5000
        assert after.queued == 0
        unknown = diag.request(("127.0.0.1", 1), ("127.0.0.1", 2))
        assert diag.query(unknown) is None
        with pytest.raises(ValueError, match="different families"):
            diag.request(("127.0.0.1", 1), ("::1", 2))
    finally:
        diag.close()


@linux
def test_listeners_get_the_user_timeout_and_accepted_sockets_inherit_it() -> None:
    with socket.socket() as listener, socket.socket() as operators:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        operators.bind(("127.0.0.1", 0))
        operators.listen()
        operators.setsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT, 2500)
        ports = tune_listeners(7.0)
        assert listener.getsockname()[1] in ports
        assert listener.getsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT) == 7000
        assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        # Probes from a fifth of the timeout on, every tenth: a live peer's answer has time
        # to come back, a dead one is ended at about the timeout.
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 1
        assert listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert operators.getsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT) == 2500
        with socket.create_connection(listener.getsockname()):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, TCP_USER_TIMEOUT) == 7000
                assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        # Found, used and given back: the listener still works, nothing was closed.
        for found in listening_sockets():
            found.detach()
        assert listener.fileno() >= 0


@pytest.mark.parametrize("value", [0, 0.5, -3.0, float("nan"), True])
def test_a_client_timeout_under_a_second_is_refused(value: float) -> None:
    with pytest.raises(ValueError, match="client_timeout"):
        DisconnectMiddleware(Starlette(), backend=MemoryBackend(), client_timeout=value)


async def _lifespan(app: object) -> None:
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        if len(sent) == 0 and messages:
            return messages.pop(0)
        if sent and messages:
            return messages.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    async with asyncio.timeout(10):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)  # type: ignore[operator]
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_elsewhere_than_linux_the_startup_says_only_the_lag_rules_apply(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from asgi_disconnect import _disconnect

    monkeypatch.setattr(_disconnect, "_TRANSPORT_SUPPORTED", False)
    middleware = DisconnectMiddleware(Starlette(), backend=MemoryBackend())
    assert middleware.transport is None
    with caplog.at_level(logging.WARNING, logger="asgi_disconnect"):
        await _lifespan(middleware)
    (line,) = [r.message for r in caplog.records if "lag rules" in r.message]
    assert "client_timeout needs Linux" in line
    caplog.clear()
    quiet = DisconnectMiddleware(Starlette(), backend=MemoryBackend(), client_timeout=None)
    await _lifespan(quiet)
    assert not [r for r in caplog.records if "lag rules" in r.message]


async def _events(count: int, pause: float) -> AsyncIterator[bytes]:
    for index in range(count):
        yield b'data: {"n": %d}\n\n' % index
        await asyncio.sleep(pause)
    yield b"data: [DONE]\n\n"


def _app(records: list[UsageRecord], **options: object) -> Starlette:
    async def stream(request: Request) -> StreamingResponse:
        return StreamingResponse(_events(30, 0.01), media_type="text/event-stream")

    async def answer(request: Request) -> JSONResponse:
        return JSONResponse({"usage": {"prompt_tokens": 1, "completion_tokens": 2}})

    app = Starlette(routes=[Route("/stream", stream), Route("/json", answer)])
    install(app, backend=MemoryBackend(), sinks=[records.append], **options)
    return app


@linux
async def test_a_streamed_response_is_delivered_as_acknowledged_and_a_whole_one_as_sent() -> None:
    records: list[UsageRecord] = []
    with run_server(_app(records), server="uvicorn") as server:
        async with server.client() as client:
            streamed = await client.get("/stream")
            whole = await client.get("/json")
            deadline = time.monotonic() + 5
            while len(records) < 2:
                assert time.monotonic() < deadline, records
                await asyncio.sleep(0.01)
    by_route = {record.route: record for record in records}
    stream = by_route["/stream"]
    assert stream.delivery == "acked"
    assert stream.outcome == "complete"
    assert stream.delivered_bytes == stream.produced_bytes == len(streamed.content)
    # Sent in one piece: not watched, and said so.
    assert by_route["/json"].delivery == "sent"
    assert whole.status_code == 200


@linux
async def test_watching_the_transport_adds_no_task_to_a_request() -> None:
    """The monitor samples on the loop's timers: a stream in flight has the same tasks with
    and without it."""

    async def during(**options: object) -> list[str]:
        records: list[UsageRecord] = []
        app = _app(records, **options)
        with run_server(app, server="uvicorn") as server:
            async with server.client() as client, client.stream("GET", "/stream") as response:
                async for _ in response.aiter_raw():
                    return await server.tasks()
        raise AssertionError("no chunk")

    assert sorted(await during()) == sorted(await during(client_timeout=None))


@linux
async def test_a_client_gone_mid_stream_is_settled_at_once_by_what_it_acknowledged() -> None:
    """A client that closes (FIN) mid-stream: the record does not wait for acknowledgements
    that cannot come, and counts no more than the client's TCP took."""
    records: list[UsageRecord] = []
    app = _app(records)
    with run_server(app, server="uvicorn") as server:
        async with (
            httpx.AsyncClient(base_url=server.url) as client,
            client.stream("GET", "/stream") as response,
        ):
            async for chunk in response.aiter_raw():
                got = len(chunk)
                break
        deadline = time.monotonic() + 3
        while not records:
            assert time.monotonic() < deadline, "no record"
            await asyncio.sleep(0.01)
    (record,) = records
    assert record.outcome == "cancelled"
    assert record.delivery == "acked"
    assert got <= record.delivered_bytes <= record.produced_bytes


async def _late_events() -> AsyncIterator[bytes]:
    # The head is out, the client reads it and closes, and the first event follows before
    # the server's loop reads the client's FIN (here: the loop is held while it arrives).
    time.sleep(0.5)  # noqa: ASYNC251
    yield b'data: {"n": 0}\n\n'
    await asyncio.sleep(0.5)
    yield b"data: [DONE]\n\n"


@linux
async def test_a_client_gone_before_the_first_byte_of_body_is_delivered_nothing() -> None:
    """A client that reads the response's head and closes (FIN) before the first token of a
    detaching route: its connection is half-closed (CLOSE_WAIT) when the body starts, and the
    record says it got none of the body, as acknowledged, not the bytes the server's send
    took."""
    records: list[UsageRecord] = []

    @disconnect_policy("detach")
    async def late(request: Request) -> StreamingResponse:
        return StreamingResponse(_late_events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/late", late)])
    install(app, backend=MemoryBackend(), sinks=[records.append])
    with run_server(app, server="uvicorn") as server:
        host, port = server.url.removeprefix("http://").split(":")
        loop = asyncio.get_running_loop()
        with socket.socket() as sock:
            sock.setblocking(False)
            await loop.sock_connect(sock, (host, int(port)))
            request = f"GET /late HTTP/1.1\r\nhost: {host}\r\n\r\n"
            await loop.sock_sendall(sock, request.encode())
            head = b""
            while b"\r\n\r\n" not in head:
                data = await loop.sock_recv(sock, 65536)
                assert data, head
                head += data
            assert head.startswith(b"HTTP/1.1 200"), head
            assert head.endswith(b"\r\n\r\n"), "no body yet"
            sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 5
        while not records:
            assert time.monotonic() < deadline, "no record"
            await asyncio.sleep(0.01)
    (record,) = records
    assert record.outcome == "complete"
    assert record.produced_bytes > 0, record
    assert record.delivery == "acked", (record.delivered_bytes, record.produced_bytes)
    assert record.delivered_bytes == 0


@linux
async def test_the_listener_scan_never_runs_on_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The scan of the process's descriptors (``/proc/self/fd``, a socket option each) runs
    in a worker thread, at startup, later rescans and a request on an unknown port: a
    blocking-call detector (Starlette's test suite runs one) finds nothing on the loop."""
    import os
    import threading

    from asgi_disconnect import _transport
    from asgi_disconnect.testing import drive, lifespan

    scans: list[bool] = []  # for each scan: did it run on the loop's thread?
    listdir = os.listdir
    loop_thread = threading.get_ident()

    def recording_listdir(path: str) -> list[str]:
        if path == "/proc/self/fd":
            scans.append(threading.get_ident() == loop_thread)
        return listdir(path)

    monkeypatch.setattr(_transport.os, "listdir", recording_listdir)

    async def hello(request: Request) -> JSONResponse:
        return JSONResponse({"hello": "world"})

    app = Starlette(routes=[Route("/", hello)])
    install(app, backend=MemoryBackend())
    async with lifespan(app):
        scanned = len(scans)
        assert scanned >= 1, "the startup scan ran"
        result = await drive(app, path="/")  # port 80 of the driver's scope: unknown here
        assert result.status == 200
        async with asyncio.timeout(5):
            while len(scans) == scanned:
                await asyncio.sleep(0.01)
    assert not any(scans), scans
