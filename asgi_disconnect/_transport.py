"""The client judged at its transport: what its TCP acknowledged, and whether it still does.

A phone that loses its signal sends no FIN: the server's TCP keeps taking writes into
kernel buffers and the ASGI ``send`` keeps returning. Two things notice it here, on Linux:

- ``tune_listeners`` sets ``TCP_USER_TIMEOUT`` and keep-alive probes on the process's
  listening TCP sockets; each connection accepted afterwards inherits them, so the kernel
  ends a connection whose peer acknowledged nothing for that long, and the server reports
  a disconnect. No server flag, no private attribute: the sockets are found among the
  process's file descriptors.
- ``TransportMonitor`` asks the kernel (sock_diag netlink, by the connection's
  addresses from the scope) how many bytes the client's TCP acknowledged and when it last
  did. A streamed response is watched from its first body message: a peer that has left
  data unacknowledged for ``client_timeout`` is a disconnect, and the response's delivered
  bytes are the body bytes it acknowledged, not those handed to the server.

Elsewhere nothing here runs, and silent clients are found by the lag rules alone.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import sys
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from starlette.types import Scope

__all__ = [
    "SUPPORTED",
    "ConnectionWatch",
    "SockDiag",
    "TcpSample",
    "TransportMonitor",
    "listening_sockets",
    "tune_listeners",
]

logger = logging.getLogger("asgi_disconnect")

SUPPORTED = sys.platform.startswith("linux")

# linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h, linux/tcp.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_INET_DIAG_INFO = 2
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)
_TCP_TIME_WAIT = 6
_TCP_LISTEN = 10

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=IHHIIBBBxI2s2s16s16sIII")  # nlmsghdr + inet_diag_req_v2
_MESSAGE = struct.Struct("=BBBB2s2s16s16sIIIIIIII")  # inet_diag_msg
_ATTRIBUTE = struct.Struct("=HH")  # rtattr: len, type
# struct tcp_info: tcpi_unacked at 24, tcpi_last_ack_recv at 56, tcpi_bytes_acked at 120.
_TCP_INFO = struct.Struct("=24xI28xI60xQ")


class TcpSample(NamedTuple):
    """What the kernel says of one connection."""

    state: int
    """The TCP state (``1`` established, ``6`` time-wait: everything was acknowledged)."""
    bytes_acked: int
    """Bytes the peer acknowledged over the connection's life."""
    queued: int
    """Bytes written to the kernel and not acknowledged yet, sent or not."""
    last_ack_ms: int
    """Milliseconds since the peer's last acknowledgement."""

    @property
    def written(self) -> int:
        """Every byte the server wrote to the kernel for this connection so far."""
        return self.bytes_acked + self.queued


def _address(host: str) -> tuple[int, bytes]:
    """The family and the 16 bytes sock_diag wants for ``host`` (an IPv4 or IPv6 text)."""
    try:
        return socket.AF_INET, socket.inet_pton(socket.AF_INET, host) + bytes(12)
    except OSError:
        return socket.AF_INET6, socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])


class SockDiag:
    """One netlink socket that asks the kernel about TCP connections by their addresses.

    It answers for the network namespace it was opened in: open it on the thread that
    serves the connections.
    """

    __slots__ = ("_seq", "_sock")

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def __del__(self) -> None:
        # A monitor dropped with its loop (a test's server) closes its socket here.
        self._sock.close()

    def request(self, local: tuple[str, int], remote: tuple[str, int]) -> bytes:
        """The query for one connection, to pass to ``query`` as often as needed."""
        family, source = _address(local[0])
        family_r, destination = _address(remote[0])
        if family != family_r:
            raise ValueError(f"{local!r} and {remote!r} are of different families")
        return _REQUEST.pack(
            _REQUEST.size,
            _SOCK_DIAG_BY_FAMILY,
            _NLM_F_REQUEST,
            0,
            0,
            family,
            socket.IPPROTO_TCP,
            1 << (_INET_DIAG_INFO - 1),
            0xFFFFFFFF,
            local[1].to_bytes(2, "big"),
            remote[1].to_bytes(2, "big"),
            source,
            destination,
            0,
            _INET_DIAG_NOCOOKIE,
            _INET_DIAG_NOCOOKIE,
        )

    def query(self, request: bytes) -> TcpSample | None:
        """The connection's state now; None if the kernel knows no such connection."""
        sock = self._sock
        sock.send(request)
        reply = sock.recv(4096)
        length, kind = _HEADER.unpack_from(reply)[:2]
        if kind == _NLMSG_ERROR:
            return None
        fields = _MESSAGE.unpack_from(reply, _HEADER.size)
        state, queued = fields[1], fields[13]
        if state == _TCP_LISTEN:
            return None  # the connection is gone: the lookup fell back to its listener
        offset = _HEADER.size + _MESSAGE.size
        while offset + _ATTRIBUTE.size <= length:
            size, attribute = _ATTRIBUTE.unpack_from(reply, offset)
            if size < _ATTRIBUTE.size:
                break
            if attribute == _INET_DIAG_INFO and size - _ATTRIBUTE.size >= _TCP_INFO.size:
                _, last_ack, acked = _TCP_INFO.unpack_from(reply, offset + _ATTRIBUTE.size)
                return TcpSample(state, acked, queued, last_ack)
            offset += (size + 3) & ~3
        # A time-wait socket has no tcp_info: both ends closed, everything acknowledged.
        return TcpSample(state, -1, 0, 0)


def listening_sockets() -> list[socket.socket]:
    """The process's listening TCP sockets, each wrapped around its descriptor: the caller
    must ``detach()`` every one (closing one would close the server's listener)."""
    found: list[socket.socket] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except OSError:
            continue  # closed meanwhile, or not a socket after all
        try:
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.type == socket.SOCK_STREAM
                and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            ):
                found.append(sock)
                continue
        except OSError:
            pass
        sock.detach()
    return found


def tune_listeners(client_timeout: float) -> set[int]:
    """Give every listening TCP socket of the process ``TCP_USER_TIMEOUT`` and keep-alive
    probes, for the connections it accepts from now on; the ports it listens on.

    A listener that already carries a user timeout (the operator's) is left as it is.

    With a user timeout the kernel ends an idle connection at the first probe tick at which
    nothing came from the peer for that long and a probe is unanswered. Probes begin after a
    fifth of ``client_timeout`` and repeat every tenth: a dead peer is ended at about
    ``client_timeout``, and a live one answers in time though its link buffers seconds or
    drops for a while (idle ``client_timeout`` with a quarter's interval left one interval
    for the only probe's answer: a phone behind a deep queue, waiting on a long first
    token, was cut).
    """
    timeout_ms = int(client_timeout * 1000)
    idle = max(1, int(client_timeout / 5))
    interval = max(1, int(client_timeout / 10))
    ports: set[int] = set()
    for sock in listening_sockets():
        try:
            ports.add(sock.getsockname()[1])
            if sock.getsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT) == 0:
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT, timeout_ms)
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        except OSError:
            logger.debug("a listening socket could not be tuned", exc_info=True)
        finally:
            sock.detach()
    return ports


def _chunk_framing(size: int) -> int:
    """The bytes HTTP/1.1 chunked coding adds around a chunk of ``size`` (hex, CRLF, CRLF)."""
    return ((size.bit_length() + 3) >> 2) + 4 if size else 0


# A watch forgets the messages its client acknowledged once it holds this many.
_PRUNE_AT = 256

# The peer sent its FIN (or both ends are closing): no more acknowledgements will come.
_PEER_CLOSED = frozenset({7, 8, 9, 11})  # close, close-wait, last-ack, closing
_WATCHABLE = _PEER_CLOSED | {1}  # and established


class ConnectionWatch:
    """One streamed response on one TCP connection, as its client's TCP acknowledged it.

    ``sizes`` is every body message handed to the server since the watch began, in order
    (a negative size is bytes on the wire that are not the app's body: a keep-alive
    comment), pruned as the client acknowledges them. ``final`` once no acknowledgement
    can come any more (the peer died, closed, or the connection is gone): ``acked_body``
    is then what it got.
    """

    __slots__ = (
        "_body",
        "_other",
        "_wire",
        "base",
        "chunked",
        "dead",
        "delivery",
        "final",
        "last",
        "on_dead",
        "on_settled",
        "owed_since",
        "request",
        "sampled_at",
        "sizes",
    )

    def __init__(
        self,
        request: bytes,
        sample: TcpSample,
        *,
        chunked: bool,
        exact: bool,
        on_dead: Callable[[], None],
    ) -> None:
        self.request = request
        self.last = sample
        # Everything written to the kernel before this response's body: its head, earlier
        # responses on the connection.
        self.base = sample.written
        self.chunked = chunked
        # "acked" when the body's bytes on the wire are known (HTTP/1.x), else "sent".
        self.delivery = "acked" if exact else "sent"
        self.sizes = array.array("q")
        self._body = 0  # body bytes of the messages pruned from sizes
        self._wire = 0  # their bytes on the wire
        self._other = 0  # bytes on the wire in sizes that are not body (keep-alives)
        self.dead = False
        self.final = sample.state in _PEER_CLOSED
        self.on_dead: Callable[[], None] | None = on_dead
        self.on_settled: Callable[[], None] | None = None
        # The first sample (loop time) since the peer owed nothing that found bytes it has
        # not acknowledged: it has been silent no longer than since then, whatever the age
        # of its last acknowledgement (old after a long first token, with nothing owed).
        self.owed_since: float | None = None
        self.sampled_at: float | None = None  # loop time of ``last``, once sampled here

    def handed_other(self, size: int) -> None:
        """A body message of ``size`` bytes that is not the app's output (a keep-alive)."""
        wire = size + (_chunk_framing(size) if self.chunked else 0)
        self.sizes.append(-wire)
        self._other += wire

    def update(self, sample: TcpSample) -> None:
        """Take a new sample. Cheap: the body it covers is worked out when asked for."""
        self.last = sample
        if sample.bytes_acked < 0:  # time-wait: all of it
            self.all_received()
            return
        if sample.state in _PEER_CLOSED:
            self.final = True
        sizes = self.sizes
        if (
            sizes
            and not sample.queued
            and sample.bytes_acked - self.base - self._wire >= sum(sizes) + 2 * self._other
        ):
            # Nothing is left unacknowledged, and at least every byte handed was: all of it.
            self.all_received()

    @property
    def acked_body(self) -> int:
        """The body bytes the client's TCP acknowledged, by the last sample."""
        sizes = self.sizes
        if not sizes:
            return self._body
        acked = self.last.bytes_acked - self.base
        body, wire = self._body, self._wire
        chunked = self.chunked
        covered = 0
        partial = 0
        for size in sizes:
            if size < 0:
                on_wire = -size
            elif chunked:
                head = ((size.bit_length() + 3) >> 2) + 2
                on_wire = head + size + 2
            else:
                head, on_wire = 0, size
            if wire + on_wire > acked:
                if size > 0:
                    partial = min(max(acked - wire - head, 0), size)
                break
            wire += on_wire
            if size > 0:
                body += size
            else:
                self._other += size
            covered += 1
        if covered:
            del sizes[:covered]  # acknowledged: no need to hold them
            self._body, self._wire = body, wire
        return body + partial

    def all_received(self, *, final: bool = False) -> None:
        """Everything handed so far reached the client (``final``: and nothing more will)."""
        self._body += sum(self.sizes) + self._other
        acked = self.last.bytes_acked
        if acked >= 0:
            self._wire = acked - self.base
        self._other = 0
        del self.sizes[:]  # in place: the writer holds its append
        self.final = self.final or final or acked < 0

    @property
    def settled(self) -> bool:
        """Nothing more to wait for: all of it acknowledged, or no acknowledgement to come."""
        return self.final or not self.sizes


class TransportMonitor:
    """Watches streamed responses at their connections; one per middleware, on one loop.

    Every ``interval`` seconds while anything is watched it samples each watched
    connection: a peer that left data unacknowledged for ``client_timeout`` is reported
    dead (``on_dead``); a response whose app is done settles once its client acknowledged
    it all, or died, or closed.
    """

    __slots__ = (
        "_diag",
        "_failed",
        "_loop",
        "_timer",
        "client_timeout",
        "interval",
        "kernel_behind",
        "watches",
    )

    SETTLE_INTERVAL = 0.02

    def __init__(self, client_timeout: float) -> None:
        self.client_timeout = client_timeout
        self.interval = min(1.0, client_timeout / 4)
        # A client found dead here is a moment ahead of its kernel, which ends the
        # connection by TCP_USER_TIMEOUT (client_timeout, counted from the transmission the
        # peer left unacknowledged: at most about a sample later): how long its server may
        # take to hear of it.
        self.kernel_behind = 2 * self.interval + 1.0
        self.watches: dict[ConnectionWatch, None] = {}
        self._diag: SockDiag | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._failed = False

    def _diagnostics(self, loop: asyncio.AbstractEventLoop) -> SockDiag | None:
        if self._loop is not loop:
            # Another loop (a test client's): its own socket, in its thread's namespace.
            if self._diag is not None:
                self._diag.close()
            self._diag, self._loop, self._timer = None, loop, None
            self.watches.clear()
        if self._diag is None and not self._failed:
            try:
                self._diag = SockDiag()
            except OSError as exc:
                self._failed = True
                logger.warning(
                    "the kernel's socket diagnostics are unavailable (%s): silent clients "
                    "are found by the listeners' TCP_USER_TIMEOUT and the lag rules only",
                    exc,
                )
        return self._diag

    def watch(
        self,
        scope: Scope,
        loop: asyncio.AbstractEventLoop,
        on_dead: Callable[[], None],
        *,
        chunked: bool,
    ) -> ConnectionWatch | None:
        """Watch the connection of ``scope`` from now (its response's head was handed over,
        none of its body yet); None where the kernel cannot tell (no TCP peer, a proxy's
        address in the scope)."""
        client, server = scope.get("client"), scope.get("server")
        if not client or not server or server[1] is None:
            return None
        diag = self._diagnostics(loop)
        if diag is None:
            return None
        try:
            # int(): granian's scope carries its ports as text.
            request = diag.request((server[0], int(server[1])), (client[0], int(client[1])))
            sample = diag.query(request)
        except (OSError, ValueError, TypeError, OverflowError, struct.error):
            sample = None
        # A peer that closed already (it read the head and left) is watched too: what it
        # acknowledges from now is none of the body, not what the server's send took.
        if sample is None or sample.bytes_acked < 0 or sample.state not in _WATCHABLE:
            if not self.watches:
                self._close()
            return None
        exact = scope.get("http_version", "1.1") in ("1.1", "1.0")
        watch = ConnectionWatch(request, sample, chunked=chunked, exact=exact, on_dead=on_dead)
        self.watches[watch] = None
        if self._timer is None:
            self._timer = loop.call_later(self.interval, self._tick)
        return watch

    def closed(self, watch: ConnectionWatch) -> None:
        """The server reported the client gone: what it acknowledged is final now."""
        if watch in self.watches and not watch.final:
            self._sample(watch)
            watch.final = True

    def settle(self, watch: ConnectionWatch, on_settled: Callable[[], None]) -> bool:
        """The response is over for the app: its delivered figure settles now (False) or
        once its client acknowledged the rest, died or closed (True, then ``on_settled``)."""
        if watch not in self.watches:
            return False
        if watch.delivery == "sent":
            self._drop(watch)  # HTTP/2: its delivered figure is what was sent; nothing to wait for
            return False
        if not watch.final:
            self._sample(watch)
        if watch.settled:
            self._drop(watch)
            return False
        watch.on_settled = on_settled
        if self._timer is not None:
            self._timer.cancel()
        assert self._loop is not None
        self._timer = self._loop.call_later(self.SETTLE_INTERVAL, self._tick)
        return True

    def forget(self, watch: ConnectionWatch) -> None:
        self._drop(watch)

    def settle_all(self) -> None:
        """Settle every response that waits, with what it has (at shutdown)."""
        for watch in list(self.watches):
            if watch.on_settled is not None:
                self._settled(watch)

    def close(self) -> None:
        """Watch nothing more (the lifespan's end): settle what waits, close the socket."""
        self.settle_all()
        self.watches.clear()
        self._close()

    def _drop(self, watch: ConnectionWatch) -> None:
        """Watch it no more; with nothing left to watch, close the netlink socket."""
        self.watches.pop(watch, None)
        if not self.watches:
            self._close()

    def _close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._diag is not None:
            self._diag.close()
            self._diag = None

    def _sample(self, watch: ConnectionWatch, *, prune: bool = False) -> None:
        diag = self._diag
        sample = None
        if diag is not None:
            try:
                sample = diag.query(watch.request)
            except OSError:
                logger.debug("a sock_diag query failed", exc_info=True)
        if sample is None:
            self._gone(watch)
            return
        watch.update(sample)
        assert self._loop is not None
        watch.sampled_at = self._loop.time()
        if prune and len(watch.sizes) > _PRUNE_AT:
            watch.acked_body  # noqa: B018 - works out what is acknowledged, and forgets it
        if not sample.queued:
            watch.owed_since = None
            return
        assert self._loop is not None
        now = self._loop.time()
        owed_since = watch.owed_since
        if owed_since is None:
            watch.owed_since = owed_since = now
        timeout = self.client_timeout
        if (
            not watch.final
            and sample.last_ack_ms >= timeout * 1000
            and now - owed_since >= timeout
            and watch.sizes
        ):
            self._dead(watch)

    def _gone(self, watch: ConnectionWatch) -> None:
        """The connection closed. A peer silent long enough for the kernel to have ended it
        (the listener's TCP_USER_TIMEOUT is ``client_timeout``) is counted by its last sample
        (and is dead); one that closed sooner talked until it closed: it got the rest (its
        close, or the server's after the response, came behind it). Silent since it last
        acknowledged, or since it first owed bytes, whichever is later (a long first token
        owes nothing), up to now: a link back after a drop, the rest read and the connection
        closed between two samples, is not a dead peer."""
        last = watch.last
        silent = last.last_ack_ms / 1000
        sampled_at, owed_since = watch.sampled_at, watch.owed_since
        if sampled_at is not None and self._loop is not None:
            if owed_since is not None:
                silent = min(silent, sampled_at - owed_since + self.interval)
            silent += self._loop.time() - sampled_at
        looked_dead = last.queued and silent >= max(0.0, self.client_timeout - 2 * self.interval)
        if looked_dead:
            watch.final = True
            self._dead(watch)
        else:
            watch.all_received(final=True)

    def _dead(self, watch: ConnectionWatch) -> None:
        watch.dead = watch.final = True
        on_dead, watch.on_dead = watch.on_dead, None
        if on_dead is not None:
            try:
                on_dead()
            except Exception:
                logger.exception("reporting a silent client failed")

    def _settled(self, watch: ConnectionWatch) -> None:
        self._drop(watch)
        on_settled, watch.on_settled = watch.on_settled, None
        if on_settled is not None:
            try:
                on_settled()
            except Exception:
                logger.exception("settling a response's delivery failed")

    def _tick(self) -> None:
        self._timer = None
        settling = False
        for watch in list(self.watches):
            if not watch.final:
                self._sample(watch, prune=watch.on_settled is None)
            if watch.on_settled is not None:
                if watch.settled:
                    self._settled(watch)
                else:
                    settling = True
            # A final watch whose exchange is still on waits for it to settle.
        loop = self._loop
        if self.watches and self._timer is None and loop is not None and not loop.is_closed():
            interval = self.SETTLE_INTERVAL if settling else self.interval
            self._timer = loop.call_later(interval, self._tick)
