"""The request's one reader of the server's ``receive``.

It hands the request's body to the app as the app asks for it (reading the next part only
once the app took the last: backpressure is kept), and meanwhile watches, in a task of its
own that its exchange starts and stops, for the client's ``http.disconnect``, which it
reports to the exchange. A body limit outside (the server's ``receive`` raising) reaches
the app's next ``receive``, as without the middleware.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol

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

    def disconnected(self) -> None:
        """The watch read ``http.disconnect``."""
        ...


class _Over:
    """The owner of a reader whose exchange ended: the response is over."""

    def handed(self) -> bool:
        return True

    def hears_disconnect(self) -> bool:
        return True

    def disconnected(self) -> None:
        pass


_OVER = _Over()


class RequestReader:
    """Reads ``receive`` for one request; see the module docstring."""

    __slots__ = (
        "body_read",
        "error",
        "gate",
        "heard",
        "inbox",
        "inbox_waiter",
        "owner",
        "receive",
        "taken_waiter",
        "task",
    )

    def __init__(self, receive: Receive, owner: Owner) -> None:
        self.receive = receive
        self.owner = owner
        self.inbox: deque[Message] | None = None
        self.inbox_waiter: asyncio.Future[None] | None = None
        self.taken_waiter: asyncio.Future[None] | None = None
        self.body_read = False  # the body's last part came
        self.heard = False  # the server said the client disconnected
        # What the server's receive raised (a body limit outside): the app's receive raises it.
        self.error: Exception | None = None
        # Resolved when the app first asks for a message or starts its response; the watch
        # reads nothing before (see ``hold_body``).
        self.gate: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None  # the watch, once started

    def hold_body(self) -> None:
        """Read the body when the app asks for it, not before: a body size limit outside
        applies the limit routing set (a route's own), not the app's."""
        self.gate = asyncio.get_running_loop().create_future()

    def open_gate(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None and not gate.done():
            gate.set_result(None)

    def start_watch(self) -> None:
        """Watch the client from a task of its own, until it disconnects or ``halt``."""
        if self.task is None and not self.owner.handed():
            self.task = asyncio.get_running_loop().create_task(self._watch())

    def halt(self) -> None:
        """Stop the watch: cancelled, it ends at the event loop's next turn."""
        task = self.task
        if task is not None:
            task.cancel()

    async def _watch(self) -> None:
        """Read until the client disconnects, then tell the owner; or until what comes
        tells nothing more of the client."""
        receive = self.receive
        gate = self.gate
        if gate is not None:
            await gate
        while True:
            try:
                message = await receive()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # What is outside refused the request's body (a body size limit raises in
                # its ``receive``): the app's next receive raises it, as without this
                # middleware, and the watch reads no more.
                self.error = exc
                self._give()
                return
            kind = message["type"]
            if kind == "http.request":
                if self.body_read:
                    # No server sends more after the body's last part: this receive
                    # answers at once and tells nothing of the client (a test's own, say).
                    # Reading it again would spin.
                    return
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
                self.heard = True
                self.owner.disconnected()
                return

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

    async def until_heard(self, seconds: float) -> None:
        """Read until the server says the client disconnected, at most ``seconds``.

        A client found silent is cut before its server knows: the kernel ends the connection
        a moment later (the listener's ``TCP_USER_TIMEOUT`` is ``client_timeout``), and a
        server whose app returned mid-response meanwhile logs an error for a response it
        thinks abandoned (uvicorn: "ASGI callable returned without completing response").
        The request's work is stopped or detached already; only its return waits."""
        if self.heard:
            return
        receive = self.receive
        try:
            async with asyncio.timeout(seconds):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # http.disconnect: heard
                    if self.body_read:
                        return  # an answer at once that tells nothing of the client
                    if not message.get("more_body", False):
                        self.body_read = True
        except Exception:  # the timeout, or a server whose receive refuses now
            return

    def release(self) -> None:
        """Wake an app that waits for its body: it was cancelled."""
        self._give()

    def unlink(self) -> None:
        """The exchange ended: let go of it and of the watch (reference counting frees them
        all: a cancelled watch's traceback holds its frame, which holds this reader)."""
        self.owner = _OVER
        self.task = None

    def _give(self) -> None:
        waiter = self.inbox_waiter
        if waiter is not None:
            self.inbox_waiter = None
            if not waiter.done():
                waiter.set_result(None)
