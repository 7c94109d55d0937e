"""The client writer: hands a generation's log to the server's ``send``, in order.

The producer (the app's ``send``) appends to the log and returns; it never waits on the
client. The writer task hands the log to the server. On Python 3.12 and later, while the
client keeps up, a send is started at once in a task of its own (asyncio's eager start,
``EAGER_SENDS``): most finish in that first step, which costs one ``Task`` and no task
switch; one that waits is awaited by the writer task, and everything produced meanwhile
follows from the log. On 3.11 the producer wakes the writer task, which sends what waits.
Either way a send runs in a task that awaits it to its end, so a timeout or a cancel scope
inside the server's ``send`` binds to that task, never to the producer. A send that has not
finished after ``max_lag_seconds`` (one ``LagClock`` per middleware judges every send in
flight with a single timer), or a log that runs ``max_lag_bytes`` ahead of the client, reports
the client as lagging.

Messages other than start and body keep their place: each is queued behind the chunks
produced before it (``http.response.trailers`` behind the final body,
``http.response.pathsend`` as the end of the body, anything unknown where it was sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import types
from typing import TYPE_CHECKING, Any, Protocol

from ._aio import as_coroutine, wait_bounded
from ._states import DELIVERY_MOVES, Delivery, moved

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.types import Message, Send

    from ._contract import LogStore, RequestState
    from ._log import Generation
    from ._transport import ConnectionWatch

__all__ = ["EAGER_SENDS", "ClientWriter", "LagClock"]

logger = logging.getLogger("asgi_disconnect")

# Enum members read on the request's paths, bound once: on Python 3.11 a member's
# lookup goes through EnumType.__getattr__ (~60 ns, ~200 instructions); see
# docs/performance.md for what it costs per request and per chunk.
_DELIVERY_DONE = Delivery.DONE
_DELIVERY_FINAL = Delivery.FINAL
_DELIVERY_GONE = Delivery.GONE
_DELIVERY_OPEN = Delivery.OPEN

EAGER_SENDS = sys.version_info >= (3, 12)
"""Whether a send is started at once in a task of its own (``Task(..., eager_start=True)``,
Python 3.12+) while the client keeps up; else the writer task sends everything. Both ways
keep the same order, deadlines and outcomes (tests run both)."""

_Task = asyncio.Task
_COROUTINE = types.CoroutineType


# The largest body message the writer makes of chunks that wait: small enough that a
# client's progress shows between messages, large enough to cost few sends.
MESSAGE_BYTES = 1 << 20

# A queued message: (chunks sent before it, queued after the final body?, message).
_Extra = tuple[int, bool, "Message"]
# A send in progress: (its task, message, body size, chunks sent after).
_Pending = tuple["asyncio.Task[Any]", "Message", int, int]


class ClientWriter:
    """Delivers one response's log to the client; see the module docstring."""

    __slots__ = (
        "_pending",
        "_room",
        "_room_behind",
        "clock",
        "closing",
        "context",
        "delivery",
        "direct",
        "eager",
        "end_response",
        "end_sent",
        "error",
        "expect_trailers",
        "extras",
        "generation",
        "latest",
        "loop",
        "note",
        "on_lost",
        "reads_back",
        "send",
        "sent_index",
        "state",
        "task",
        "waiter",
        "watch",
    )

    def __init__(
        self,
        send: Send,
        generation: Generation,
        state: RequestState,
        *,
        clock: LagClock,
        expect_trailers: bool,
        on_lost: Callable[[str], None],
        sent_index: int = 0,
    ) -> None:
        self.send = send
        self.eager = EAGER_SENDS
        self.generation = generation
        self.reads_back = bool(generation.reads_back)  # a backlog may be in the store then
        self.state = state
        self.expect_trailers = expect_trailers
        self.on_lost = on_lost
        self.sent_index = sent_index
        self.delivery = _DELIVERY_OPEN
        self.end_response = True
        self.end_sent = False
        # Set by the exchange once the app ended: nothing more will be produced.
        self.closing = False
        self.extras: list[_Extra] = []
        # The app's last body message, when the exchange handed it to the writer task: sent
        # as it is if it is all that waits.
        self.latest: Message | None = None
        self.error: BaseException | None = None
        self.clock = clock  # judges each send in flight by the lag rule
        self._pending: _Pending | None = None
        self.waiter: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None
        self._room_behind = 0
        # The writer's task runs in a context of its own; eager sends' tasks too.
        self.context = contextvars.copy_context()
        self.loop = asyncio.get_running_loop()
        # True while the producer may start sends itself (eager): the writer is idle and
        # caught up.
        self.direct = self.eager
        # The connection's transport, when watched: each body message handed is noted.
        self.watch: ConnectionWatch | None = None
        self.note: Callable[[int], None] | None = None  # watch.sizes.append

    def start(self, on_done: Callable[[asyncio.Task[None]], None]) -> asyncio.Task[None]:
        """Start the writer's task (its owner waits for it; ``on_done`` hears it ended)."""
        task = self.task = self.loop.create_task(self._run(), context=self.context)
        task.add_done_callback(on_done)
        return task

    def move(self, to: Delivery) -> None:
        """Move the response on; an impossible move is a bug, named by both states."""
        self.delivery = moved(DELIVERY_MOVES, self.delivery, to)

    # -- the producer's side ------------------------------------------------------------

    def hand(self, message: Message, size: int, count: int) -> None:
        """Start sending ``message`` (in the log up to chunk ``count``) in a task of its own,
        eagerly (``hand_chunk`` is the same for a body chunk that is not the last)."""
        if _last(message, self.expect_trailers):
            self.move(_DELIVERY_FINAL)
        sending = as_coroutine(self.send(message))
        task = _Task(sending, loop=self.loop, context=self.context, eager_start=True)  # type: ignore[call-arg]
        if task.done():
            self.took(task, message, size, count)
        else:
            self.wait_for(task, message, size, count)

    def hand_chunk(self, message: Message, size: int, count: int) -> None:
        """``hand``, for a body chunk that is not the last (the hot path, eager)."""
        sending: Any = self.send(message)
        if type(sending) is not _COROUTINE:
            sending = as_coroutine(sending)
        task = _Task(sending, loop=self.loop, context=self.context, eager_start=True)  # type: ignore[call-arg]
        if not task.done():
            self.wait_for(task, message, size, count)
        elif task.exception() is None:
            self.sent_index = count
            self.state.delivered_bytes += size
            if self.note is not None:
                self.note(size)
        else:
            self.took(task, message, size, count)

    def take(self, message: Message) -> bool:
        """Wake the writer task for the app's chunk (``message``, appended to the log), if it
        waits for one; False if it is busy with what was produced before."""
        waiter = self.waiter
        if waiter is None or waiter.done():
            return False
        self.latest = message
        self.waiter = None
        waiter.set_result(None)
        return True

    def took(self, task: asyncio.Task[Any], message: Message, size: int, count: int) -> None:
        """An eager send finished in its first step: its outcome, as the writer's would be."""
        exc = task.exception()
        if exc is None:
            self._sent(message, size, count)
        elif isinstance(exc, OSError):
            self.lost("client")
        else:
            raise exc

    def wait_for(self, task: asyncio.Task[Any], message: Message, size: int, count: int) -> None:
        """An eager send waits: the writer task awaits it to its end."""
        self.direct = False
        self._pending = (task, message, size, count)
        self.clock.begin(self)
        self.wake()

    def queue(self, message: Message, *, after_end: bool) -> None:
        """Queue a message that is not start or body behind what was produced before it;
        ``after_end``: the app sent it after its final body (trailers)."""
        self.extras.append((len(self.generation.chunks), after_end, message))

    def keep_alive(self, body: bytes) -> None:
        """Send ``body`` (a comment) now if nothing else waits: the writer task sends it, in
        order, and the app's next chunk goes behind it."""
        if not self.extras and self.delivery is _DELIVERY_OPEN:
            self.queue(
                {"type": "http.response.body", "body": body, "more_body": True}, after_end=False
            )
            self.direct = False
            self.wake()

    def close(self) -> None:
        """The app ended: nothing more will be produced; hand over the rest."""
        self.direct = False
        self.closing = True
        self.wake()

    def ends_elsewhere(self) -> None:
        """Send no final body of its own: the response ends with the file the server sends
        (``pathsend``), or is left open so that the server aborts it."""
        self.end_response = False

    def watch_with(self, watch: ConnectionWatch | None) -> None:
        """Note each body message handed over to ``watch`` (None: no more)."""
        self.watch = watch
        self.note = watch.sizes.append if watch is not None else None

    def unlink(self) -> None:
        """The exchange is over: the writer no longer tells it of a loss."""
        self.on_lost = _ignore_loss

    def pump(self) -> None:
        """Hand over what waits, eagerly while the client takes it at once; else the writer
        task does."""
        if not self.eager:
            self.wake()
            return
        while self.direct:
            pending = self._next()
            if pending is None:
                break
            self.hand(*pending)
        if self.delivery is _DELIVERY_DONE or self.closing:
            self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            self.waiter = None
            waiter.set_result(None)

    def lost(self, reason: str) -> None:
        """The client is gone (``client``), lagging (``lag``) or the server refused (``error``)."""
        if self.delivery is _DELIVERY_GONE or self.delivery is _DELIVERY_DONE:
            return
        self.move(_DELIVERY_GONE)
        self.direct = False
        self._free_room()
        self.stop()
        self.on_lost(reason)

    def stop(self) -> None:
        pending = self._pending
        if pending is not None:
            pending[0].cancel()  # a send not yet awaited by the writer task
        if not self.task.done() and self.task is not asyncio.current_task():
            self.task.cancel()
        self.clock.end(self)

    # -- what goes next -----------------------------------------------------------------

    def _next(self) -> tuple[Message, int, int] | None:
        """The next message to hand over: queued chunks as one body, or a queued message."""
        if self.delivery is not _DELIVERY_OPEN:
            return None
        generation = self.generation
        count = len(generation.chunks)
        index = self.sent_index
        extras = self.extras
        if extras:
            at, after_end, extra = extras[0]
            if at <= index and (self.end_sent or not after_end):
                return extra, 0, index
            limit = at
        else:
            limit = count
        ended = not generation.running
        if index < limit:
            body, limit = _coalesced(generation.chunks, index, limit)
            final = ended and limit == count and self.end_response and not self.end_sent
            if final and extras and not extras[0][1]:
                final = False
            return (
                {"type": "http.response.body", "body": body, "more_body": not final},
                len(body),
                limit,
            )
        if ended and self.end_response and not self.end_sent and (not extras or extras[0][1]):
            return {"type": "http.response.body", "body": b"", "more_body": False}, 0, index
        return None

    def _latest(self, latest: Message) -> tuple[Message, int, int] | None:
        """Woken for one chunk: the app's own message, if that is all that waits."""
        self.latest = None
        chunks = self.generation.chunks
        index = self.sent_index
        if (
            index + 1 == len(chunks)
            and chunks[index] is latest["body"]
            and not self.extras
            and self.delivery is _DELIVERY_OPEN
        ):
            return latest, len(latest["body"]), index + 1
        return self._next()

    def room(self, behind: int) -> asyncio.Future[None]:
        """A future resolved once the client is at most ``behind`` bytes behind the log, or
        gone: a producer far ahead of a client that still reads waits on it."""
        waiter = self._room = self.loop.create_future()
        self._room_behind = behind
        return waiter

    def _free_room(self) -> None:
        waiter = self._room
        if waiter is not None:
            self._room = None
            if not waiter.done():
                waiter.set_result(None)

    def _sent(self, message: Message, size: int, count: int) -> None:
        """``message`` (up to chunk ``count`` of the log, ``size`` bytes of it) was handed."""
        kind = message["type"]
        if kind == "http.response.body":
            extras = self.extras
            watch = self.watch
            if extras and extras[0][2] is message:
                extras.pop(0)  # a keep-alive comment: not the log's, not the app's output
                if watch is not None:
                    watch.handed_other(len(message["body"]))
                return
            self.sent_index = count
            self.state.delivered_bytes += size
            if self.note is not None:
                self.note(size)
            if (
                self._room is not None
                and self.generation.size - self.state.delivered_bytes <= self._room_behind
            ):
                self._free_room()
            if message.get("more_body", False):
                return
            self.end_sent = True
            if self.expect_trailers:
                return
        else:
            self.extras.pop(0)
            if kind == "http.response.trailers":
                if message.get("more_trailers", False):
                    return
            elif kind != "http.response.pathsend":
                return
        if self.delivery is not _DELIVERY_GONE:
            self.move(_DELIVERY_DONE)
            self.direct = False

    # -- the writer task ------------------------------------------------------------------

    async def _run(self) -> None:
        generation = self.generation
        chunks = generation.chunks
        clock = self.clock
        try:
            while True:
                pending = self._pending
                if pending is not None:
                    # An eager send that waits (its clock started when it was handed).
                    task, message, size, count = pending
                    try:
                        await task
                    finally:
                        self._pending = None
                        clock.end(self)
                    self._sent(message, size, count)
                    continue
                if self.reads_back and self.sent_index < generation.base_index:
                    # What the client has yet to receive left memory (a durable store has
                    # it, see Generation.reads_back): read it back from there.
                    await self._send_backlog()
                    continue
                latest = self.latest
                if latest is not None:
                    following = self._latest(latest)
                elif self.sent_index == len(chunks) and not self.extras and generation.running:
                    following = None  # caught up
                else:
                    following = self._next()
                if following is not None:
                    message, size, count = following
                    if message is not latest and _last(message, self.expect_trailers):
                        self.move(_DELIVERY_FINAL)
                    clock.begin(self)  # judged by the lag rule while in flight
                    try:
                        await self.send(message)
                    finally:
                        clock.end(self)
                    self._sent(message, size, count)
                    continue
                if self.delivery is not _DELIVERY_OPEN or self.closing:
                    return
                self.direct = self.eager
                waiter = self.waiter = self.loop.create_future()
                try:
                    await waiter
                finally:
                    self.waiter = None
        except OSError:
            self.lost("client")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # The server refused a send (a protocol error, say): it must hear of it.
            self.error = exc
            self.lost("error")
        finally:
            self.direct = False
            self._free_room()
            clock.end(self)
            # A cancellation's traceback keeps this frame, and the task keeps the traceback:
            # let go of the writer here, or writer, task and frame wait for the cyclic
            # collector (asyncio's transports do the same).
            self = None  # type: ignore[assignment]

    async def _send_backlog(self) -> None:
        """Send the client the next part of what memory released before it got there, read
        back from the store as a resume reader reads it (``read_back``), up to where memory
        starts, at most 1 MiB at a time. Only the send counts against the lag rule."""
        generation = self.generation
        end, end_index = generation.base, generation.base_index
        offset = self.state.delivered_bytes
        store = self.state.log_store
        if store is None:
            raise RuntimeError(f"generation {generation.id} released bytes with no store")
        data = await read_back(store, generation.id, offset, self.clock.seconds)
        data = data[: end - offset]
        if not data:
            raise RuntimeError(f"the store gave back no bytes of {generation.id} at {offset}")
        message: Message = {"type": "http.response.body", "body": data, "more_body": True}
        clock = self.clock
        clock.begin(self)
        try:
            await self.send(message)
        finally:
            clock.end(self)
        caught_up = offset + len(data) >= end
        self._sent(message, len(data), end_index if caught_up else self.sent_index)

    def lagging(self) -> None:
        """The lag clock: a send of this writer has waited ``max_lag_seconds``."""
        if not self.task.done() and self.delivery is not _DELIVERY_GONE:
            self.lost("lag")

    async def join(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for the writer to hand over the rest (then stop it); True
        if it ended. What it did not hand over is not delivered."""
        if self.task.done():
            return True
        ended = await wait_bounded(self.task, seconds)
        if self.delivery is not _DELIVERY_DONE and self.delivery is not _DELIVERY_GONE:
            self.delivery = _DELIVERY_GONE
        return ended


class Lagging(Protocol):
    """What the lag clock tells of a send that waited too long."""

    def lagging(self) -> None: ...


class LagClock:
    """The lag rule of one middleware: a send in flight for ``seconds`` means its client
    lags. One timer for every send of every request, set for the oldest one (all wait the
    same ``seconds``, so the oldest is the first due); each send costs a clock read and a
    dict entry."""

    __slots__ = ("loop", "seconds", "timer", "waiting")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        # Who has a send in flight (a writer, a response sent whole) -> when it began,
        # oldest first.
        self.waiting: dict[Lagging, float] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def begin(self, sender: Lagging) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self.loop:
            self.close()  # the middleware serves another event loop now (tests do)
            self.loop = loop
        now = loop.time()
        self.waiting[sender] = now
        if self.timer is None:
            self.timer = loop.call_at(now + self.seconds, self._due)

    def end(self, sender: Lagging) -> None:
        self.waiting.pop(sender, None)

    def close(self) -> None:
        """Forget every send and stop the timer (at the lifespan's end, or a new loop)."""
        timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()
        self.waiting.clear()

    def _due(self) -> None:
        self.timer = None
        loop = self.loop
        assert loop is not None
        now = loop.time()
        waiting = self.waiting
        while waiting:
            sender, began = next(iter(waiting.items()))
            due = began + self.seconds
            if due > now:
                self.timer = loop.call_at(due, self._due)
                return
            del waiting[sender]
            sender.lagging()


def _last(message: Message, expect_trailers: bool) -> bool:
    """Whether ``message`` is the last of a response (``expect_trailers``: trailers follow
    its body)."""
    kind = message["type"]
    if kind == "http.response.body":
        return not bool(message.get("more_body", False)) and not expect_trailers
    if kind == "http.response.trailers":
        more: bool = message.get("more_trailers", False)
        return not more
    return bool(kind == "http.response.pathsend")


def _ignore_loss(reason: str) -> None:
    """A writer's ``on_lost`` once its exchange is over."""


async def read_back(store: LogStore, generation_id: str, offset: int, patience: float) -> bytes:
    """The stored bytes of a generation from ``offset`` (at most 1 MiB), for a client whose
    backlog memory let go. A store that cannot answer is asked again every half second for
    up to ``patience`` seconds (``max_lag_seconds``), so a database restart does not cut a
    client off; past that, the error ends the response."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + patience
    said = False
    while True:
        try:
            async with contextlib.aclosing(store.follow(generation_id, offset)) as pieces:
                return await anext(pieces, b"")
        except Exception as exc:
            if loop.time() >= give_up:
                raise
            if not said:
                said = True
                logger.warning(
                    "generation %s: its client's backlog cannot be read back from the store "
                    "(%s); retrying for up to %g s",
                    generation_id,
                    exc,
                    patience,
                )
        await asyncio.sleep(0.5)


def _coalesced(chunks: list[bytes], index: int, limit: int) -> tuple[bytes, int]:
    """The chunks from ``index`` that wait, as one body up to a size that still shows the
    client's progress (MESSAGE_BYTES), and the index after them."""
    size = len(chunks[index])
    end = index + 1
    while end < limit and size + len(chunks[end]) <= MESSAGE_BYTES:
        size += len(chunks[end])
        end += 1
    body = chunks[index] if end == index + 1 else b"".join(chunks[index:end])
    return body, end
