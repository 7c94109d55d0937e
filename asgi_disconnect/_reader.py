"""The request's one reader of the server's ``receive``.

It hands the request's body to the app as the app asks for it (reading the next part only
once the app took the last: backpressure is kept), and meanwhile watches for the client's
``http.disconnect``. The exchange that owns it stops a read in progress with ``wake``,
saying why; a body limit outside (the server's ``receive`` raising) reaches the app's next
``receive``, as without the middleware.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

if TYPE_CHECKING:
    from starlette.types import Message, Receive

__all__ = ["RequestReader"]

_DISCONNECT: Message = {"type": "http.disconnect"}


class Owner(Protocol):
    """What the reader asks of the exchange that owns it."""

    def handed(self) -> bool:
        """The whole response went to the server (a disconnect now is the normal end)."""
        ...

    def hears_disconnect(self) -> bool:
        """The app's next ``receive`` answers ``http.disconnect``."""
        ...

    async def client_lost(self, reason: str) -> None:
        """The watch of its own task saw the client go (``client``, ``lag``, ...)."""
        ...


class _Over:
    """The owner of a reader whose exchange ended: the response is over."""

    def handed(self) -> bool:
        return True

    def hears_disconnect(self) -> bool:
        return True

    async def client_lost(self, reason: str) -> None:
        pass


_OVER = _Over()


class RequestReader:
    """Reads ``receive`` for one request; see the module docstring."""

    __slots__ = (
        "body_read",
        "error",
        "gate",
        "inbox",
        "inbox_waiter",
        "owner",
        "reason",
        "receive",
        "taken_waiter",
        "task",
        "watching",
        "woken",
    )

    def __init__(self, receive: Receive, owner: Owner) -> None:
        self.receive = receive
        self.owner = owner
        self.inbox: deque[Message] | None = None
        self.inbox_waiter: asyncio.Future[None] | None = None
        self.taken_waiter: asyncio.Future[None] | None = None
        self.body_read = False  # the body's last part came
        # What the server's receive raised (a body limit outside): the app's receive raises it.
        self.error: Exception | None = None
        # Resolved when the app first asks for a message or starts its response; the watch
        # reads nothing before (see ``hold_body``).
        self.gate: asyncio.Future[None] | None = None
        # The task that watches, once one does; why the exchange woke it.
        self.task: asyncio.Task[Any] | None = None
        self.watching = False
        self.woken = False
        self.reason: str | None = None

    def hold_body(self) -> None:
        """Read the body when the app asks for it, not before: a body size limit outside
        applies the limit routing set (a route's own), not the app's."""
        self.gate = asyncio.get_running_loop().create_future()

    def open_gate(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None and not gate.done():
            gate.set_result(None)

    async def watch(self) -> str:
        """Read until the client disconnects: ``complete`` if the response was handed over
        by then, else ``client``; or the reason the exchange woke the watch."""
        receive = self.receive
        self.watching = True
        try:
            gate = self.gate
            if gate is not None:
                await gate
            while True:
                try:
                    message = await receive()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    await self._refused(exc)
                kind = message["type"]
                if kind == "http.request":
                    if self.body_read:
                        # No server sends more after the body's last part: this receive
                        # answers at once and tells nothing of the client (a test's own,
                        # say). Reading it again would spin; the exchange wakes the watch.
                        await asyncio.get_running_loop().create_future()
                    if not message.get("more_body", False):
                        self.body_read = True
                    inbox = self.inbox
                    if inbox is None:
                        inbox = self.inbox = deque()
                    inbox.append(message)
                    self._give()
                    if message.get("more_body", False) and inbox:
                        # Read the next part only once the app took this one.
                        self.taken_waiter = asyncio.get_running_loop().create_future()
                        await self.taken_waiter
                elif kind == "http.disconnect":
                    return "complete" if self.owner.handed() else "client"
        except asyncio.CancelledError as exc:
            if not self.woken:
                raise
            self.woken = False
            task = self.task
            if task is not None and task.uncancel() > 0:
                raise
            # Our own wake-up, handled: its traceback holds the frames that hold the
            # cancelled future that holds it; let reference counting free them.
            exc.__traceback__ = None
            assert self.reason is not None
            return self.reason
        finally:
            self.watching = False

    async def take(self) -> Message:
        """The app's ``receive``."""
        if self.gate is not None:
            self.open_gate()
        while True:
            inbox = self.inbox
            if inbox:
                message = inbox.popleft()
                waiter = self.taken_waiter
                if waiter is not None:
                    self.taken_waiter = None
                    if not waiter.done():
                        waiter.set_result(None)
                return message
            if self.error is not None:
                raise self.error
            owner = self.owner
            if owner.hears_disconnect():
                return _DISCONNECT
            if self.task is None:
                self.start_watch()
            # Under detach the app never hears of the disconnect: it would stop itself.
            waiter = self.inbox_waiter = asyncio.get_running_loop().create_future()
            await waiter

    def wake(self, reason: str) -> None:
        """Stop the watch's read of ``receive`` and tell it why."""
        if self.reason is None:
            self.reason = reason
        if self.watching and not self.woken and self.task is not None:
            self.woken = True
            self.task.cancel()

    def release(self) -> None:
        """Wake an app that waits for its body: it was cancelled."""
        self._give()

    def start_watch(self) -> None:
        """Watch the client from a task of its own, while the app runs in the request's
        (a route that can only cancel); the owner hears of a client that went."""
        if self.task is None and not self.owner.handed():
            self.task = asyncio.get_running_loop().create_task(self._watch_alone())

    async def _watch_alone(self) -> None:
        reason = await self.watch()
        if reason in ("client", "lag", "error", "silent"):
            await self.owner.client_lost(reason)

    def stop(self) -> None:
        """Stop a watch of its own task (one started for an inline app)."""
        task = self.task
        if task is not None and not task.done():
            task.cancel()

    def unlink(self) -> None:
        """The exchange ended: let go of it (reference counting frees both)."""
        self.owner = _OVER

    def _give(self) -> None:
        waiter = self.inbox_waiter
        if waiter is not None:
            self.inbox_waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _refused(self, exc: Exception) -> NoReturn:
        """What is outside refused the request's body (a body size limit raises in its
        ``receive``): the app's next receive raises it, as without this middleware, and the
        watch reads no more until the exchange is over."""
        self.error = exc
        self._give()
        await asyncio.get_running_loop().create_future()  # until the exchange wakes it
        raise AssertionError("unreachable")
