"""Raw-socket HTTP/1.1 clients that hang up or stop reading at a precise point of a response.

httpx cannot close its socket after exactly N body bytes or before the response head arrives;
these clients can, which is what disconnect tests against real servers need.
"""

from __future__ import annotations

import asyncio
import re
import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from types import TracebackType

__all__ = ["ClientResult", "StalledClient", "request", "stalled_request"]

_RECV_SIZE = 65536
_MAX_LINE = 64 * 1024
_HEX = re.compile(rb"[0-9a-fA-F]+")


@dataclass
class ClientResult:
    """What a client received before it stopped.

    `stopped_by` says why it stopped: "complete", "server_closed" (EOF before the response was
    complete), "reset", "disconnect_after_bytes", "disconnect_after_seconds" or "disconnect_when".
    """

    status: int | None
    headers: dict[str, str]
    headers_list: list[tuple[str, str]]
    body: bytes
    complete: bool
    elapsed: float
    stopped_by: str


class _ChunkedDecoder:
    """Incremental ``Transfer-Encoding: chunked`` decoder; input may be split anywhere."""

    def __init__(self) -> None:
        self.done = False
        self._pending = bytearray()
        self._state = "size"  # size | data | data_end | trailer
        self._remaining = 0

    def feed(self, data: bytes) -> bytes:
        self._pending += data
        out = bytearray()
        while not self.done:
            if self._state == "data":
                if not self._pending:
                    break
                piece = self._pending[: self._remaining]
                out += piece
                del self._pending[: len(piece)]
                self._remaining -= len(piece)
                if not self._remaining:
                    self._state = "data_end"
                continue
            line = self._take_line()
            if line is None:
                break
            self._on_line(line)
        return bytes(out)

    def _take_line(self) -> bytes | None:
        end = self._pending.find(b"\r\n")
        if end < 0:
            if len(self._pending) > _MAX_LINE:
                raise ValueError("chunked body: line too long")
            return None
        line = bytes(self._pending[:end])
        del self._pending[: end + 2]
        return line

    def _on_line(self, line: bytes) -> None:
        if self._state == "size":
            size = line.split(b";", 1)[0].strip()
            if not _HEX.fullmatch(size):
                raise ValueError(f"chunked body: bad chunk size line {line!r}")
            self._remaining = int(size, 16)
            self._state = "data" if self._remaining else "trailer"
        elif self._state == "data_end":
            if line:
                raise ValueError("chunked body: missing CRLF after chunk data")
            self._state = "size"
        elif not line:
            self.done = True


class _Response:
    """What a client has read of one response so far, whatever the protocol."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.headers_list: list[tuple[str, str]] = []
        self.body = bytearray()
        self.head_done = False
        self.complete = False


class _ResponseParser(_Response):
    """Incremental HTTP/1.1 response parser (head, then chunked, sized or read-to-close body)."""

    def __init__(self, method: str) -> None:
        super().__init__()
        self._head_only = method.upper() == "HEAD"
        self._buffer = bytearray()
        self._chunked: _ChunkedDecoder | None = None
        self._remaining: int | None = None

    def feed(self, data: bytes) -> None:
        if self.complete:
            return
        if not self.head_done:
            self._buffer += data
            data = self._parse_head()
        if self.head_done and data and not self.complete:
            self._feed_body(data)

    def feed_eof(self) -> None:
        if self.head_done and self._chunked is None and self._remaining is None:
            self.complete = True

    def _parse_head(self) -> bytes:
        """Parse the head once it is buffered; return the body bytes that followed it."""
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > _MAX_LINE:
                    raise ValueError("response head too large")
                return b""
            head = bytes(self._buffer[:end]).decode("latin-1")
            rest = bytes(self._buffer[end + 4 :])
            self._buffer.clear()
            status, headers_list = _parse_response_head(head)
            if 100 <= status < 200 and status != 101:
                self._buffer += rest
                continue
            self.status = status
            self.headers_list = headers_list
            self.headers = {name.lower(): value for name, value in headers_list}
            self.head_done = True
            self._set_framing(status)
            return rest

    def _set_framing(self, status: int) -> None:
        if self._head_only or status in (101, 204, 304):
            self.complete = True
        elif "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._chunked = _ChunkedDecoder()
        elif "content-length" in self.headers:
            self._remaining = int(self.headers["content-length"])
            self.complete = self._remaining == 0

    def _feed_body(self, data: bytes) -> None:
        if self._chunked is not None:
            self.body += self._chunked.feed(data)
            self.complete = self._chunked.done
        elif self._remaining is not None:
            piece = data[: self._remaining]
            self.body += piece
            self._remaining -= len(piece)
            self.complete = self._remaining == 0
        else:
            self.body += data


def _parse_response_head(head: str) -> tuple[int, list[tuple[str, str]]]:
    status_line, *lines = head.split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ValueError(f"malformed status line {status_line!r}")
    headers: list[tuple[str, str]] = []
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError(f"malformed header line {line!r}")
        headers.append((name.strip(), value.strip()))
    return int(parts[1]), headers


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _wait_readable(sock: socket.socket, deadline: float) -> bool:
    """Wait until `sock` is readable (data, EOF or error); False once `deadline` passed."""
    loop = asyncio.get_running_loop()
    timeout = deadline - loop.time()
    if timeout <= 0:
        return False
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(sock.fileno(), _resolve, ready)
    try:
        await asyncio.wait_for(ready, timeout)
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(sock.fileno())
    return True


def _split_url(url: str) -> tuple[str, int, str, str]:
    """``(host, port, target, authority)`` of an ``http://`` URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http://host[:port]/path URLs are supported, got {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, parts.port or 80, target, parts.netloc.rpartition("@")[2]


async def _connect(host: str, port: int, deadline: float, recv_buffer: int | None) -> socket.socket:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"cannot resolve {host!r}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            if recv_buffer is not None:
                # Must precede connect(): the receive window is negotiated in the handshake.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, recv_buffer)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            async with asyncio.timeout_at(deadline):
                await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise error


def _request_bytes(
    method: str, target: str, host: str, headers: Mapping[str, str], body: bytes
) -> bytes:
    names = {name.lower() for name in headers}
    lines = [f"{method} {target} HTTP/1.1"]
    if "host" not in names:
        lines.append(f"Host: {host}")
    framed = "content-length" in names or "transfer-encoding" in names
    if not framed and (body or method.upper() in ("POST", "PUT", "PATCH")):
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Exchange:
    """One request/response on a non-blocking socket, read only when asked to.

    A subclass speaks the protocol: `feed` takes what was read, `flush` writes what the
    protocol owes the server (HTTP/2 acknowledgements), `unstall` lets a stalled response
    flow again.
    """

    def __init__(self, sock: socket.socket, response: _Response, started: float) -> None:
        self.sock = sock
        self.response = response
        self.started = started
        self.server_closed = False
        self.closed = False
        # Set by a protocol that learns the response is over before EOF (an HTTP/2 reset).
        self.ended_by: str | None = None

    def feed(self, data: bytes) -> None:
        raise NotImplementedError

    def feed_eof(self) -> None:
        """The server closed the connection."""

    async def flush(self) -> None:
        """Write what the protocol owes the server; nothing for HTTP/1.1."""

    async def unstall(self) -> None:
        """Let a response that was held back flow again; nothing for HTTP/1.1."""

    async def hang_up(self) -> None:
        """What the client says before it closes early; nothing for HTTP/1.1."""

    def recv_nowait(self, size: int = _RECV_SIZE) -> bytes | None:
        """Bytes already received (b"" at EOF), or None when nothing is readable yet."""
        try:
            return self.sock.recv(size)
        except BlockingIOError:
            return None

    async def read(
        self,
        *,
        deadline: float,
        cut_at: float = float("inf"),
        stop: Callable[[], str | None] = lambda: None,
        recv_size: int = _RECV_SIZE,
    ) -> str:
        """Read until the response completes, the server closes, `stop()` names a reason once
        the head arrived, or `cut_at` passes; return why it stopped. TimeoutError at `deadline`."""
        loop = asyncio.get_running_loop()
        response = self.response
        while True:
            if response.complete:
                return "complete"
            if self.ended_by is not None:
                return self.ended_by
            if response.head_done and (reason := stop()):
                return reason
            if loop.time() >= cut_at:
                return "disconnect_after_seconds"
            if loop.time() >= deadline:
                raise TimeoutError("the response did not end before the timeout")
            try:
                data = self.recv_nowait(recv_size)
            except ConnectionError:
                self.server_closed = True
                return "reset"
            if data is None:
                await _wait_readable(self.sock, min(deadline, cut_at))
            elif data:
                self.feed(data)
                await self.flush()
                # A server flooding the socket must not starve the rest of this event loop.
                await asyncio.sleep(0)
            else:
                self.server_closed = True
                self.feed_eof()
                return "complete" if response.complete else "server_closed"

    async def wait_server_closed(self, timeout: float) -> bool:
        """Whether the server closed the connection (or ended the response) within `timeout`,
        reading whatever arrives meanwhile."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.server_closed and not self.closed:
            try:
                data = self.recv_nowait()
            except ConnectionError:
                self.server_closed = True
                break
            if data == b"":
                self.server_closed = True
                self.feed_eof()
            elif data is not None:
                self.feed(data)
                await self.flush()
                if loop.time() >= deadline:
                    return False
                await asyncio.sleep(0)
            elif not await _wait_readable(self.sock, deadline):
                return False
        return self.server_closed

    def result(self, stopped_by: str) -> ClientResult:
        response = self.response
        return ClientResult(
            status=response.status,
            headers=dict(response.headers),
            headers_list=list(response.headers_list),
            body=bytes(response.body),
            complete=response.complete,
            elapsed=asyncio.get_running_loop().time() - self.started,
            stopped_by=stopped_by,
        )

    def close(self, *, abortive: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if abortive:
            # Linger on with a zero timeout: close() sends RST instead of FIN.
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


class _Http1Exchange(_Exchange):
    """An HTTP/1.1 request on a connection of its own."""

    def __init__(self, sock: socket.socket, method: str, started: float) -> None:
        self.parser = _ResponseParser(method)
        super().__init__(sock, self.parser, started)

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        method: str,
        headers: Mapping[str, str] | None,
        body: bytes,
        timeout: float,
        recv_buffer: int | None = None,
    ) -> _Http1Exchange:
        host, port, target, authority = _split_url(url)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        sock = await _connect(host, port, deadline, recv_buffer)
        exchange = cls(sock, method, started)
        data = _request_bytes(method, target, authority, headers or {}, body)
        try:
            async with asyncio.timeout_at(deadline):
                await loop.sock_sendall(sock, data)
        except BaseException:
            exchange.close()
            raise
        return exchange

    def feed(self, data: bytes) -> None:
        self.parser.feed(data)

    def feed_eof(self) -> None:
        self.parser.feed_eof()


async def request(
    url: str,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
    disconnect_after_bytes: int | None = None,
    disconnect_after_seconds: float | None = None,
    disconnect_when: Callable[[bytes], bool] | None = None,
    timeout: float = 30.0,
    abortive: bool = False,
) -> ClientResult:
    """Send one request and read the response, closing the socket early when told to.

    `disconnect_after_bytes` counts de-chunked body bytes (the result may hold a little more:
    whatever arrived in the same read). `disconnect_after_seconds` counts from the moment the
    request was sent and also applies before the response head. `abortive` closes with RST.
    Raises TimeoutError when nothing else stopped the client within `timeout`.
    """
    exchange = await _Http1Exchange.open(
        url, method=method, headers=headers, body=body, timeout=timeout
    )
    return await _read_or_hang_up(
        exchange,
        disconnect_after_bytes=disconnect_after_bytes,
        disconnect_after_seconds=disconnect_after_seconds,
        disconnect_when=disconnect_when,
        timeout=timeout,
        abortive=abortive,
    )


async def _read_or_hang_up(
    exchange: _Exchange,
    *,
    disconnect_after_bytes: int | None,
    disconnect_after_seconds: float | None,
    disconnect_when: Callable[[bytes], bool] | None,
    timeout: float,
    abortive: bool,
) -> ClientResult:
    """Read `exchange` until it ends or a disconnect condition holds; then close it."""
    loop = asyncio.get_running_loop()
    cut_at = float("inf")
    if disconnect_after_seconds is not None:
        cut_at = loop.time() + disconnect_after_seconds
    received = exchange.response.body

    def stop() -> str | None:
        if disconnect_after_bytes is not None and len(received) >= disconnect_after_bytes:
            return "disconnect_after_bytes"
        if disconnect_when is not None and disconnect_when(bytes(received)):
            return "disconnect_when"
        return None

    try:
        stopped_by = await exchange.read(
            deadline=exchange.started + timeout, cut_at=cut_at, stop=stop
        )
        if stopped_by.startswith("disconnect_"):
            await exchange.hang_up()
    finally:
        exchange.close(abortive=abortive)
    return exchange.result(stopped_by)


class StalledClient:
    """A client that read the response head (and a few body bytes) and then stopped reading,
    keeping its connection open: over HTTP/1.1 the server's send buffer fills up, over
    HTTP/2 the stream's flow-control window stays shut."""

    def __init__(self, exchange: _Exchange) -> None:
        self._exchange = exchange

    @property
    def status(self) -> int | None:
        return self._exchange.response.status

    @property
    def headers(self) -> dict[str, str]:
        return dict(self._exchange.response.headers)

    @property
    def headers_list(self) -> list[tuple[str, str]]:
        return list(self._exchange.response.headers_list)

    @property
    def body(self) -> bytes:
        """The de-chunked body bytes read so far."""
        return bytes(self._exchange.response.body)

    @property
    def complete(self) -> bool:
        return self._exchange.response.complete

    @property
    def server_closed(self) -> bool:
        return self._exchange.server_closed

    async def resume(self, timeout: float = 30.0) -> ClientResult:
        """Read the rest until the response ends or the server closes; the socket stays open
        until `close()`. Raises TimeoutError when neither happens within `timeout`."""
        exchange = self._exchange
        if exchange.closed:
            raise RuntimeError("the client is closed")
        deadline = asyncio.get_running_loop().time() + timeout
        await exchange.unstall()
        return exchange.result(await exchange.read(deadline=deadline))

    async def wait_server_closed(self, timeout: float = 10.0) -> bool:
        """Whether the server closed the connection (EOF or reset) within `timeout`.

        An EOF is only visible after the bytes before it, so whatever is readable meanwhile is
        read into `body`; `timeout=0` makes this a single non-blocking check.
        """
        return await self._exchange.wait_server_closed(timeout)

    async def close(self, *, abortive: bool = False) -> None:
        """Close the socket: a normal close (FIN), or RST when `abortive`. Idempotent."""
        self._exchange.close(abortive=abortive)

    async def __aenter__(self) -> StalledClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()


async def stalled_request(
    url: str,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
    read_bytes: int = 0,
    recv_buffer: int = 4096,
    timeout: float = 30.0,
) -> StalledClient:
    """Send a request from a socket with a small receive buffer, read the head plus at least
    `read_bytes` body bytes (at most one `recv_buffer` more), then stop reading.

    Raises TimeoutError when the head and `read_bytes` did not arrive within `timeout`.
    """
    exchange = await _Http1Exchange.open(
        url, method=method, headers=headers, body=body, timeout=timeout, recv_buffer=recv_buffer
    )
    received = exchange.response.body
    try:
        await exchange.read(
            deadline=exchange.started + timeout,
            stop=lambda: "stalled" if len(received) >= read_bytes else None,
            recv_size=recv_buffer,
        )
    except BaseException:
        exchange.close()
        raise
    return StalledClient(exchange)
