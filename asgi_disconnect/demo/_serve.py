"""Serving the demo: its listening socket, and a Ctrl-C that says what it waits for.

Ctrl-C with generations running drains (as SIGTERM does): new requests get 503, the
generations get the drain's deadline to finish, and the terminal says how many and for how
long. A second Ctrl-C interrupts them at once: each ends ``interrupted``, what it produced
kept and resumable. Any later one is uvicorn's own.
"""

from __future__ import annotations

import asyncio
import enum
import signal
import socket
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn

from .. import DisconnectMiddleware, DrainMiddleware

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType

    from starlette.applications import Starlette

__all__ = ["CannotListen", "DemoServer", "listen"]

_Part = TypeVar("_Part")


class CannotListen(Exception):
    """The demo cannot listen where asked: the message says why, and what to pass instead."""


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for the demo to serve on, before anything is printed.

    Bound as uvicorn binds (``SO_REUSEADDR``), so a port left in ``TIME_WAIT`` by the last
    run is not taken; a port another process listens on is."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise CannotListen(
            f"cannot listen on {host!r}: {exc.strerror}; pass --host 127.0.0.1"
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise CannotListen(
            f"port {port} on {host} is taken ({exc.strerror}): another program listens "
            f"there, perhaps a demo still running; pick another with --port {_another(port)}"
        ) from None
    return sock


def _another(port: int) -> int:
    return port + 1 if 0 < port < 65535 else 8001


class _Stopping(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # the first Ctrl-C: generations get the drain's deadline
    INTERRUPTING = "interrupting"  # the second: they end now


class DemoServer(uvicorn.Server):
    """uvicorn, whose Ctrl-C drains the generations running and says so, and whose second
    Ctrl-C interrupts them (see the module's docstring)."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.app = app
        self.stopping = _Stopping.SERVING
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if sig != signal.SIGINT or loop is None or self.stopping is _Stopping.INTERRUPTING:
            super().handle_exit(sig, frame)
            return
        # A signal handler runs between two bytecodes of the loop's thread: the work is
        # done by the loop, as its next callback.
        if self.stopping is _Stopping.SERVING:
            self.stopping = _Stopping.DRAINING
            loop.call_soon_threadsafe(self._drain, sig, frame)
        else:
            self.stopping = _Stopping.INTERRUPTING
            loop.call_soon_threadsafe(self._interrupt)

    def _drain(self, sig: int, frame: FrameType | None) -> None:
        disconnect = self._part(DisconnectMiddleware)
        drain = self._part(DrainMiddleware)
        running = disconnect.running if disconnect is not None else 0
        if disconnect is None or drain is None or not running:
            super().handle_exit(sig, frame)
            return
        them = _count(running)
        print(
            f"\nStopping: {them} still running; waiting up to {drain.deadline:g} s for "
            f"{'it' if running == 1 else 'them'} to finish (new requests get 503).\n"
            f"Press Ctrl-C again to interrupt {'it' if running == 1 else 'them'} now: what "
            f"{'it' if running == 1 else 'they'} produced is kept, marked interrupted.",
            flush=True,
        )
        drain.start_drain().add_done_callback(lambda _: self._drained(sig, frame))

    def _drained(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:  # else a later Ctrl-C already handed it to uvicorn
            super().handle_exit(sig, frame)

    def _interrupt(self) -> None:
        disconnect = self._part(DisconnectMiddleware)
        drain = self._part(DrainMiddleware)
        if disconnect is None:
            return
        # A stream still read is told, in its error frame, when to retry: the drain's answer.
        interrupted = disconnect.interrupt(drain.retry_after if drain is not None else 1)
        if interrupted:
            print(
                f"Interrupting {_count(interrupted)}: what was produced is kept "
                "(status interrupted).",
                flush=True,
            )

    def _part(self, kind: type[_Part]) -> _Part | None:
        for layer in _layers(self.app):
            if isinstance(layer, kind):
                return layer
        return None


def _layers(app: Starlette) -> Iterator[Any]:
    """The app's middleware stack, outermost first (built at the app's first call)."""
    layer: Any = app.middleware_stack
    while layer is not None:
        yield layer
        layer = getattr(layer, "app", None)


def _count(n: int) -> str:
    return f"{n} generation{'' if n == 1 else 's'}"
