"""Serving the demo: its listening socket, and a Ctrl-C that says what it waits for.

Ctrl-C with generations running drains (as SIGTERM does): new requests get 503, the
generations get the drain's deadline to finish, and the terminal says how many and for how
long. A second Ctrl-C interrupts them at once: each ends ``interrupted``, what it produced
kept and resumable. Any later one is uvicorn's own.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import signal
import socket
from typing import TYPE_CHECKING, Any, TypeVar

import uvicorn

from .. import DisconnectMiddleware, DrainMiddleware
from ..testing.fake_provider import PROVIDER_PORT

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType

    from starlette.applications import Starlette

__all__ = ["CannotListen", "DemoServer", "listen"]

_Part = TypeVar("_Part")

logger = logging.getLogger("asgi_disconnect.demo")


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
            f"there, perhaps a demo still running; pick another with --port "
            f"{_another(family, address)}"
        ) from None
    return sock


def _another(family: socket.AddressFamily, address: tuple[Any, ...]) -> int:
    """A port after ``address``'s that is free now, and not the one a FakeProvider run alone
    listens on by default (the quickstart's upstream); 0 (any) if none is."""
    port = address[1]
    for candidate in range(port + 1, min(port + 20, 65536)):
        if candidate == PROVIDER_PORT:
            continue
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((address[0], candidate, *address[2:]))
            except OSError:
                continue
        return candidate
    return 0


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
            logger.info("Stopping: no generation is running.")
            super().handle_exit(sig, frame)
            return
        it, they = ("it", "it") if running == 1 else ("them", "they")
        logger.info(
            "Stopping: waiting up to %g s for %s still running to finish (new requests get 503).",
            drain.deadline,
            _count(running),
        )
        logger.info(
            "Press Ctrl-C again to interrupt %s now: what %s produced is kept, marked interrupted.",
            it,
            they,
        )
        drain.start_drain(cause=None).add_done_callback(lambda _: self._drained(sig, frame))

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
            logger.info(
                "Interrupting %s: what was produced is kept (status interrupted).",
                _count(interrupted),
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
