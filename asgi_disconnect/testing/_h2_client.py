"""Raw-socket HTTP/2 clients (cleartext, prior knowledge) that hang up or shut their
flow-control window at a precise point of a response.

An HTTP/2 server does not stop on a full socket buffer: it stops when the stream's
flow-control window is spent, and only the client reopens it (WINDOW_UPDATE). These clients
decide when: `h2_request` acknowledges every byte and can hang up after N of them;
`h2_stalled_request` opens with a small window and never reopens it. They need the `h2`
package (installed with hypercorn).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from ._socket_client import (
    ClientResult,
    StalledClient,
    _connect,
    _Exchange,
    _read_or_hang_up,
    _Response,
    _split_url,
)

if TYPE_CHECKING:
    import socket
    from collections.abc import Callable, Mapping

    import h2.connection

__all__ = ["h2_request", "h2_stalled_request"]


class _H2Exchange(_Exchange):
    """One request on an HTTP/2 connection of its own (stream 1).

    With `window` set, the stream's initial flow-control window is that many bytes and no
    WINDOW_UPDATE is sent until `unstall()`; otherwise each DATA frame is acknowledged as
    it is read.
    """

    def __init__(
        self,
        sock: socket.socket,
        started: float,
        *,
        window: int | None,
        reset_stream: bool,
    ) -> None:
        import h2.config
        import h2.connection
        import h2.settings

        super().__init__(sock, _Response(), started)
        settings: dict[h2.settings.SettingCodes, int] = {h2.settings.SettingCodes.ENABLE_PUSH: 0}
        if window is not None:
            settings[h2.settings.SettingCodes.INITIAL_WINDOW_SIZE] = window
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        conn.local_settings = h2.settings.Settings(client=True, initial_values=settings)
        conn.initiate_connection()
        self.conn: h2.connection.H2Connection = conn
        self.stream_id = conn.get_next_available_stream_id()
        self.acknowledging = window is None
        self.reset_stream = reset_stream
        # Bytes read but not acknowledged while the window is held shut.
        self._owed = 0

    @classmethod
    async def open(
        cls,
        url: str,
        *,
        method: str,
        headers: Mapping[str, str] | None,
        body: bytes,
        timeout: float,
        window: int | None = None,
        reset_stream: bool = False,
    ) -> _H2Exchange:
        host, port, target, authority = _split_url(url)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout
        sock = await _connect(host, port, deadline, None)
        exchange = cls(sock, started, window=window, reset_stream=reset_stream)
        try:
            exchange._send_request(method, target, authority, headers or {}, body)
            async with asyncio.timeout_at(deadline):
                await exchange.flush()
        except BaseException:
            exchange.close()
            raise
        return exchange

    def _send_request(
        self, method: str, target: str, authority: str, headers: Mapping[str, str], body: bytes
    ) -> None:
        fields = [
            (b":method", method.upper().encode()),
            (b":scheme", b"http"),
            (b":authority", authority.encode()),
            (b":path", target.encode()),
        ]
        names = {name.lower() for name in headers}
        if "content-length" not in names and (body or method.upper() in ("POST", "PUT", "PATCH")):
            fields.append((b"content-length", str(len(body)).encode()))
        fields += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
        conn = self.conn
        conn.send_headers(self.stream_id, fields, end_stream=not body)
        if not body:
            return
        if len(body) > conn.local_flow_control_window(self.stream_id):
            raise ValueError("the request body is larger than the server's initial window")
        step = conn.max_outbound_frame_size
        for start in range(0, len(body), step):
            end = start + step
            conn.send_data(self.stream_id, body[start:end], end_stream=end >= len(body))

    def feed(self, data: bytes) -> None:
        import h2.events

        response = self.response
        conn = self.conn
        for event in conn.receive_data(data):
            if getattr(event, "stream_id", self.stream_id) != self.stream_id:
                continue
            if isinstance(event, h2.events.ResponseReceived):
                self._on_head(event.headers or [])
            elif isinstance(event, h2.events.DataReceived):
                response.body += event.data or b""
                size = event.flow_controlled_length or 0
                if self.acknowledging:
                    conn.acknowledge_received_data(size, self.stream_id)
                else:
                    self._owed += size
            elif isinstance(event, h2.events.StreamEnded):
                response.complete = True
            elif isinstance(event, h2.events.StreamReset):
                self.server_closed = True
                self.ended_by = "reset"
            elif (
                isinstance(event, h2.events.ConnectionTerminated)
                and (event.last_stream_id or 0) < self.stream_id
            ):
                # GOAWAY: streams up to last_stream_id still end normally, the rest never.
                self.server_closed = True
                self.ended_by = "reset"

    def _on_head(self, fields: list[tuple[bytes, bytes]]) -> None:
        response = self.response
        for name, value in fields:
            if name == b":status":
                status = int(value)
                if 100 <= status < 200:
                    return  # an interim response; the final head follows
                response.status = status
            elif not name.startswith(b":"):
                response.headers_list.append((name.decode("latin-1"), value.decode("latin-1")))
        response.headers = {name: value for name, value in response.headers_list}
        response.head_done = True

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if not data or self.closed:
            return
        try:
            await asyncio.get_running_loop().sock_sendall(self.sock, data)
        except ConnectionError:
            self.server_closed = True

    async def unstall(self) -> None:
        self.acknowledging = True
        owed, self._owed = self._owed, 0
        if owed:
            self.conn.acknowledge_received_data(owed, self.stream_id)
        await self.flush()

    async def hang_up(self) -> None:
        if self.reset_stream:
            import h2.errors

            with contextlib.suppress(Exception):
                self.conn.reset_stream(self.stream_id, h2.errors.ErrorCodes.CANCEL)
                await self.flush()


async def h2_request(
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
    reset_stream: bool = False,
) -> ClientResult:
    """``request`` over HTTP/2 with prior knowledge (h2c), on a connection of its own.

    Every DATA frame is acknowledged as it is read. Hanging up closes the connection (FIN,
    or RST with `abortive`); with `reset_stream` the client first cancels the stream
    (RST_STREAM CANCEL), as a browser does when a tab stops a fetch. `stopped_by` is as for
    ``request``; "reset" also covers a RST_STREAM or GOAWAY that dropped the stream.
    """
    exchange = await _H2Exchange.open(
        url, method=method, headers=headers, body=body, timeout=timeout, reset_stream=reset_stream
    )
    return await _read_or_hang_up(
        exchange,
        disconnect_after_bytes=disconnect_after_bytes,
        disconnect_after_seconds=disconnect_after_seconds,
        disconnect_when=disconnect_when,
        timeout=timeout,
        abortive=abortive,
    )


async def h2_stalled_request(
    url: str,
    *,
    method: str = "GET",
    headers: Mapping[str, str] | None = None,
    body: bytes = b"",
    read_bytes: int = 0,
    window: int = 1024,
    timeout: float = 30.0,
) -> StalledClient:
    """Send a request over HTTP/2 (h2c) announcing a stream window of `window` bytes, read
    the head plus at least `read_bytes` body bytes, and never send a WINDOW_UPDATE: the
    server can send at most `window` body bytes, then its sends wait on flow control while
    the connection stays healthy. ``close()`` hangs up; ``resume()`` reopens the window.

    Raises TimeoutError when the head and `read_bytes` did not arrive within `timeout`.
    """
    if not 0 <= read_bytes <= window:
        raise ValueError("read_bytes must be between 0 and window")
    exchange = await _H2Exchange.open(
        url, method=method, headers=headers, body=body, timeout=timeout, window=window
    )
    received = exchange.response.body
    try:
        await exchange.read(
            deadline=exchange.started + timeout,
            stop=lambda: "stalled" if len(received) >= read_bytes else None,
        )
    except BaseException:
        exchange.close()
        raise
    return StalledClient(exchange)
