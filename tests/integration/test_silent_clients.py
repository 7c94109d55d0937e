"""Silent clients: a client host whose link goes down mid-stream sends no FIN and no RST.

The gateway (the README quickstart's relay, through ``install()`` with idempotency and
drain on, SQLite) runs under a real uvicorn or hypercorn in a network namespace of the
test's own; FakeProvider runs beside it; the client reads from a second namespace over a
veth pair that the test cuts, slows or restores. Nothing here passes a server flag: the
package finds the listening sockets itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from asgi_disconnect import UsageRecord, connect, disconnect_policy, estimate_tokens, install
from asgi_disconnect.sse import SSEDecoder
from asgi_disconnect.testing import FakeProvider, run_server
from asgi_disconnect.testing._socket_client import _ChunkedDecoder
from asgi_disconnect.upstream import UpstreamStatusError, open_stream, track_response

from . import netns

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

SERVERS = ["uvicorn", "hypercorn"]
CHAT = {"model": "fake-model", "stream": True, "stream_options": {"include_usage": True}}


def gateway(upstream: str, records: list[UsageRecord], db: Path, **options: Any) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Made on the server's loop, in the server's namespace.
        async with httpx.AsyncClient(
            base_url=upstream,
            timeout=httpx.Timeout(connect=5.0, read=None, write=10.0, pool=5.0),
            event_hooks={"response": [track_response]},
        ) as client:
            app.state.client = client
            yield

    app = FastAPI(lifespan=lifespan)

    async def relay(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        headers = {k: v for k, v in request.headers.items() if k.startswith("x-fake-")}
        outgoing = client.build_request(
            "POST", "/v1/chat/completions", content=await request.body(), headers=headers
        )
        try:
            upstream = await open_stream(client, outgoing, first_token_timeout=90)
        except UpstreamStatusError as exc:
            return JSONResponse(exc.error, status_code=exc.status_code)
        return StreamingResponse(upstream, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    @disconnect_policy("cancel")
    async def chat(request: Request) -> Response:
        return await relay(request)

    @app.post("/v1/reports")
    @disconnect_policy("detach")
    async def report(request: Request) -> Response:
        return await relay(request)

    install(
        app,
        backend=connect(f"sqlite:///{db}"),
        sinks=[records.append],
        idempotency=True,
        drain=True,
        **options,
    )
    return app


class Reader:
    """An HTTP/1.1 client on the client host that reads a streamed response as it comes and
    notes when each body byte arrived."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.head = b""
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.complete = False
        self._dechunk = _ChunkedDecoder()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        cable: netns.Link,
        port: int,
        path: str,
        headers: dict[str, str],
        body: bytes,
        method: str = "POST",
    ) -> Reader:
        sock = cable.client_socket()
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_connect(sock, (cable.server_ip, port)), 5)
        lines = [f"{method} {path} HTTP/1.1", f"host: {cable.server_ip}:{port}"]
        lines += [f"{k}: {v}" for k, v in {**headers, "content-length": str(len(body))}.items()]
        await loop.sock_sendall(sock, ("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        reader = cls(sock)
        reader._task = loop.create_task(reader._read())
        return reader

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        buffer = b""
        while True:
            data = await loop.sock_recv(self.sock, 65536)
            if not data:
                return
            if not self.status:
                buffer += data
                if b"\r\n\r\n" not in buffer:
                    continue
                head, _, data = buffer.partition(b"\r\n\r\n")
                self.head = head
                first, *rest = head.decode().split("\r\n")
                self.status = int(first.split()[1])
                self.headers = {
                    k.lower(): v.strip() for k, _, v in (h.partition(":") for h in rest)
                }
            self.body += self._dechunk.feed(data)
            if self._dechunk.done:
                self.complete = True
                return

    async def wait_bytes(self, size: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while len(self.body) < size:
                await asyncio.sleep(0.01)

    async def wait_done(self, timeout: float) -> None:
        assert self._task is not None
        await asyncio.wait_for(asyncio.shield(self._task), timeout)

    def stop(self) -> None:
        """Stop reading (what the kernel already holds is not read any more)."""
        if self._task is not None:
            self._task.cancel()

    def close(self) -> None:
        self.stop()
        self.sock.close()


@dataclasses.dataclass
class Setup:
    cable: netns.Link
    port: int
    provider: FakeProvider
    records: list[UsageRecord]

    async def open(
        self, path: str, headers: dict[str, str], body: bytes = b"", method: str = "POST"
    ) -> Reader:
        return await Reader.open(self.cable, self.port, path, headers, body, method)


@contextlib.contextmanager
def served(server: str, tmp: Path, **options: Any) -> Iterator[Setup]:
    """The gateway under ``server`` on the server host, FakeProvider beside it."""
    records: list[UsageRecord] = []
    with netns.link() as cable:
        with netns.inside(cable.server_ns):
            provider = FakeProvider(tokens=400, tokens_per_second=20).start()
        try:
            app = gateway(provider.url, records, tmp / "generations.db", **options)
            with netns.inside(cable.server_ns):
                context = run_server(app, server=server, host=cable.server_ip, shutdown_timeout=20)
                running = context.__enter__()
            try:
                yield Setup(cable, running.port, provider, records)
            finally:
                context.__exit__(None, None, None)
        finally:
            provider.stop()


async def eventually(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout} s")
        await asyncio.sleep(0.02)


def body_json(
    tokens: int, rate: float, first_token_delay: float = 0.0
) -> tuple[dict[str, str], bytes]:
    headers = {
        "content-type": "application/json",
        "authorization": "Bearer alice",
        "x-fake-tokens": str(tokens),
        "x-fake-rate": str(rate),
    }
    if first_token_delay:
        headers["x-fake-first-token-delay"] = str(first_token_delay)
    body = {**CHAT, "messages": [{"role": "user", "content": "hi"}]}
    return headers, json.dumps(body).encode()


def whole_events(body: bytes) -> int:
    return body.count(b"\n\n")


@pytest.mark.parametrize("server", SERVERS)
async def test_a_vanished_client_is_cancelled_and_billed_for_what_it_received(
    server: str, tmp_path: Path
) -> None:
    """cancel: the upstream closes within client_timeout + 5 s of the vanish; the record
    says what the client's TCP acknowledged, within one event of what it received."""
    timeout = 4.0
    with served(server, tmp_path, client_timeout=timeout) as setup:
        cable, provider, records = setup.cable, setup.provider, setup.records
        headers, body = body_json(tokens=400, rate=20)
        reader = await setup.open("/v1/chat/completions", headers, body)
        await reader.wait_bytes(1, 10)
        await asyncio.sleep(2.0)
        cable.cut()
        vanished = time.monotonic()
        await asyncio.sleep(0.2)  # what was on the wire has landed
        reader.stop()
        received = bytes(reader.body)
        (call,) = provider.requests
        assert await call.await_closed(timeout + 5), "the upstream was not closed"
        assert call.closed_at is not None
        assert call.closed_at - vanished <= timeout + 5
        assert not call.finished
        await eventually(lambda: records, timeout + 5, "a usage record")
        stopped = time.monotonic()
    # The server's shutdown did not wait for the half-open connection.
    assert time.monotonic() - stopped < timeout + 10
    (record,) = records
    assert record.outcome == "cancelled"
    assert record.delivery == "acked"
    event = len(received) / max(whole_events(received), 1)
    assert abs(record.delivered_bytes - len(received)) <= event + 1, (record, len(received))
    assert record.produced_bytes > record.delivered_bytes
    # Tokens: about 20/s for the 2 s read, not the tokens produced into the void.
    delivered_tokens = record.delivered_output_tokens
    assert delivered_tokens is not None
    assert record.output_tokens is not None
    assert delivered_tokens < record.output_tokens
    text = "".join(
        json.loads(event.data)["choices"][0]["delta"].get("content", "")
        for event in SSEDecoder().feed(received)
        if event.data.startswith("{") and json.loads(event.data)["choices"]
    )
    got = estimate_tokens(text)  # counted as the record counts them
    assert abs(delivered_tokens - got) <= 2, (delivered_tokens, got)
    reader.close()


@pytest.mark.parametrize("server", SERVERS)
async def test_a_vanished_client_of_detached_work_comes_back_for_exactly_the_rest(
    server: str, tmp_path: Path
) -> None:
    """detach: the generation completes; the client, back on a new connection, resumes with
    Last-Event-ID and gets exactly the rest."""
    with served(server, tmp_path, client_timeout=4.0) as setup:
        cable, provider, records = setup.cable, setup.provider, setup.records
        headers, body = body_json(tokens=240, rate=20)
        reader = await setup.open("/v1/reports", headers, body)
        await reader.wait_bytes(1, 10)
        await asyncio.sleep(1.5)
        cable.cut()
        await asyncio.sleep(0.2)
        reader.stop()
        received = bytes(reader.body)
        generation_id = reader.headers["x-generation-id"]
        (call,) = provider.requests
        assert await call.await_closed(20)
        assert call.finished, "detached work was not finished"
        await eventually(lambda: records, 20, "a usage record")
        cable.restore()
        # Back on a new connection: the event id of the last whole event it holds.
        last_whole = received.rfind(b"\n\n") + 2
        rest = await setup.open(
            f"/generations/{generation_id}/stream",
            {"authorization": "Bearer alice", "last-event-id": str(last_whole)},
            b"",
            method="GET",
        )
        await rest.wait_done(20)
        assert rest.status == 200
        # The resume stream carries id: fields; its data lines are the rest, byte for byte.
        events = SSEDecoder().feed(bytes(rest.body))
        resumed = b"".join(f"data: {event.data}\n\n".encode() for event in events)
        everything = await setup.open(
            f"/generations/{generation_id}/stream?offset=0",
            {"authorization": "Bearer alice"},
            b"",
            method="GET",
        )
        await everything.wait_done(20)
        assert everything.body.endswith(b"data: [DONE]\n\n")
        assert received[:last_whole] + resumed == bytes(everything.body)
        everything.close()
        rest.close()
        reader.close()
    (record,) = records
    assert record.outcome == "complete"
    assert record.detached
    assert record.delivery == "acked"
    assert abs(record.delivered_bytes - len(received)) <= len(received) / whole_events(received) + 1
    assert record.delivered_bytes < record.produced_bytes


@pytest.mark.parametrize("server", SERVERS)
async def test_a_client_vanishing_during_a_silent_first_token_is_noticed(
    server: str, tmp_path: Path
) -> None:
    """No byte of the answer yet: keep-alive comments and the kernel's keep-alive probes
    give TCP something to acknowledge; noticed within keep_alive + client_timeout + 5 s."""
    keep_alive, timeout = 3.0, 4.0
    with served(server, tmp_path, client_timeout=timeout, keep_alive=keep_alive) as setup:
        cable, provider, records = setup.cable, setup.provider, setup.records
        headers, body = body_json(tokens=50, rate=20, first_token_delay=60)
        reader = await setup.open("/v1/chat/completions", headers, body)
        await eventually(lambda: provider.requests, 10, "the upstream call")
        await asyncio.sleep(0.5)
        cable.cut()
        vanished = time.monotonic()
        (call,) = provider.requests
        assert await call.await_closed(keep_alive + timeout + 5), "the upstream was not closed"
        assert call.closed_at is not None
        assert call.closed_at - vanished <= keep_alive + timeout + 5
        assert call.tokens_generated == 0
        await eventually(lambda: records, 10, "a usage record")
        reader.close()
    (record,) = records
    assert record.outcome == "cancelled"


@pytest.mark.parametrize("server", SERVERS)
async def test_a_live_client_on_a_slow_link_is_never_cut(server: str, tmp_path: Path) -> None:
    """40 kbit/s, an answer produced far faster than the link carries it, for longer than
    client_timeout: read to its end, complete, every byte acknowledged."""
    with served(server, tmp_path, client_timeout=3.0) as setup:
        cable, provider, records = setup.cable, setup.provider, setup.records
        cable.slow("40kbit")
        headers, body = body_json(tokens=150, rate=0)
        started = time.monotonic()
        reader = await setup.open("/v1/chat/completions", headers, body)
        await reader.wait_done(60)
        read_for = time.monotonic() - started
        assert reader.complete
        (call,) = provider.requests
        assert call.finished
        await eventually(lambda: records, 10, "a usage record")
        reader.close()
    (record,) = records
    assert read_for > 3.0, "the link was not slower than client_timeout"
    assert record.outcome == "complete"
    assert record.delivery == "acked"
    assert record.delivered_bytes == record.produced_bytes == len(reader.body)


@pytest.mark.parametrize("server", SERVERS)
async def test_a_link_that_drops_for_3_s_and_comes_back_keeps_its_stream(
    server: str, tmp_path: Path
) -> None:
    """With the defaults (client_timeout 10 s), under cancel: nothing is cancelled."""
    with served(server, tmp_path) as setup:
        cable, provider, records = setup.cable, setup.provider, setup.records
        headers, body = body_json(tokens=140, rate=20)
        reader = await setup.open("/v1/chat/completions", headers, body)
        await reader.wait_bytes(1, 10)
        await asyncio.sleep(1.0)
        cable.cut()
        await asyncio.sleep(3.0)
        cable.restore()
        await reader.wait_done(30)
        assert reader.complete
        (call,) = provider.requests
        assert call.finished
        await eventually(lambda: records, 10, "a usage record")
        reader.close()
    (record,) = records
    assert record.outcome == "complete"
    assert record.delivered_bytes == record.produced_bytes == len(reader.body)
    assert record.delivered_output_tokens == record.output_tokens
