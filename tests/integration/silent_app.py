"""The gateway of the silent-client tests and of ``benchmarks.silent_clients``: the
quickstart's relay, through ``install()`` with idempotency and drain on, on SQLite (or bare,
for a control), served in the server host's namespace with FakeProvider beside it; and the
clients that read it from the client host."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from asgi_disconnect import UsageRecord, connect, disconnect_policy, install
from asgi_disconnect.testing import FakeProvider, run_server
from asgi_disconnect.testing._socket_client import _ChunkedDecoder
from asgi_disconnect.upstream import UpstreamStatusError, open_stream, track_response

from . import netns

CHAT = {"model": "fake-model", "stream": True, "stream_options": {"include_usage": True}}


def gateway(
    upstream: str, records: list[UsageRecord], db: Path, *, bare: bool = False, **options: Any
) -> FastAPI:
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

    if bare:
        return app
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


def cli_app() -> FastAPI:
    """The gateway for a server's own command line (``granian ... --factory``): where its
    upstream and its database are, and its client timeout, from the environment."""
    return gateway(
        os.environ["SILENT_UPSTREAM"],
        [],
        Path(os.environ["SILENT_DB"]),
        client_timeout=float(os.environ["SILENT_CLIENT_TIMEOUT"]),
    )


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
def served_from_the_command_line(
    server: str, tmp: Path, *, client_timeout: float
) -> Iterator[Setup]:
    """The gateway under ``granian --interface asgi`` in a process of its own, as it runs in
    production; its usage records land in its SQLite database (``tmp / "generations.db"``)."""
    with netns.link() as cable:
        with netns.inside(cable.server_ns):
            provider = FakeProvider(tokens=400, tokens_per_second=20).start()
        try:
            env = {
                "SILENT_UPSTREAM": provider.url,
                "SILENT_DB": str(tmp / "generations.db"),
                "SILENT_CLIENT_TIMEOUT": str(client_timeout),
            }
            with netns.inside(cable.server_ns):
                context = run_server(
                    "tests.integration.silent_app:cli_app",
                    server=server,  # type: ignore[arg-type]
                    host=cable.server_ip,
                    factory=True,
                    env=env,
                    shutdown_timeout=20,
                )
                running = context.__enter__()
            try:
                yield Setup(cable, running.port, provider, [])
            finally:
                context.__exit__(None, None, None)
        finally:
            provider.stop()


@contextlib.contextmanager
def served(server: str, tmp: Path, *, bare: bool = False, **options: Any) -> Iterator[Setup]:
    """The gateway under ``server`` on the server host, FakeProvider beside it."""
    records: list[UsageRecord] = []
    with netns.link() as cable:
        with netns.inside(cable.server_ns):
            provider = FakeProvider(tokens=400, tokens_per_second=20).start()
        try:
            app = gateway(provider.url, records, tmp / "generations.db", bare=bare, **options)
            with netns.inside(cable.server_ns):
                context = run_server(app, server=server, host=cable.server_ip, shutdown_timeout=20)
                running = context.__enter__()
            try:
                yield Setup(cable, running.port, provider, records)
            finally:
                context.__exit__(None, None, None)
        finally:
            provider.stop()


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


class H2Reader:
    """An HTTP/2 client (cleartext, prior knowledge) on the client host: one stream, every
    DATA frame acknowledged as it is read."""

    def __init__(self, sock: Any) -> None:
        import h2.config
        import h2.connection

        self.sock = sock
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.ended = False
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, setup: Setup, path: str, headers: dict[str, str], body: bytes) -> H2Reader:
        cable = setup.cable
        sock = cable.client_socket()
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.sock_connect(sock, (cable.server_ip, setup.port)), 5)
        reader = cls(sock)
        conn = reader.conn
        conn.initiate_connection()
        request = [
            (":method", "POST"),
            (":path", path),
            (":scheme", "http"),
            (":authority", f"{cable.server_ip}:{setup.port}"),
            *headers.items(),
        ]
        conn.send_headers(1, request)
        conn.send_data(1, body, end_stream=True)
        await loop.sock_sendall(sock, conn.data_to_send())
        reader._task = loop.create_task(reader._read())
        return reader

    async def _read(self) -> None:
        import h2.events

        loop = asyncio.get_running_loop()
        while not self.ended:
            data = await loop.sock_recv(self.sock, 65536)
            if not data:
                return
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    self.headers = {k.decode(): v.decode() for k, v in event.headers}
                elif isinstance(event, h2.events.DataReceived):
                    self.body += event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    self.ended = True
            await loop.sock_sendall(self.sock, self.conn.data_to_send())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sock.close()
