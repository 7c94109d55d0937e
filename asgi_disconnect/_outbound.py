"""The app's side of one response: what its ``send`` does.

A response is a generation or it is not (``kind_of``). A generation's start opens its log
(with ``x-generation-id``) and its body is appended there; the client writer hands the log to
the server, and the producer never waits on the client. A JSON response is held until its
first bytes tell whether it is an LLM API's; anything else passes straight through. Every
message keeps its place: trailers, ``pathsend`` and unknown types are queued behind the
chunks produced before them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ._contract import METERED_ATTRIBUTE, content_kind
from ._frames import error_frame, is_event_stream
from ._log import HOLD_CHECK, Generation
from ._policy import route_policy
from ._problem import send_problem
from ._records import Status
from ._states import Client, Delivery
from ._writer import MESSAGE_BYTES, ClientWriter
from .metering import is_llm_json

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.types import Message, Scope, Send

    from ._contract import Backend, RequestState, StoreRoom
    from ._policy import Policy
    from ._reader import RequestReader
    from ._transport import ConnectionWatch, TransportMonitor
    from ._writer import LagClock

__all__ = ["Outbound", "ResponseOptions"]

# Enum members read on the request's paths, bound once: on Python 3.11 a member's
# lookup goes through EnumType.__getattr__ (~60 ns, ~200 instructions); see
# docs/performance.md for what it costs per request and per chunk.
_CLIENT_CONNECTED = Client.CONNECTED
_CLIENT_GONE = Client.GONE
_DELIVERY_DONE = Delivery.DONE
_DELIVERY_FINAL = Delivery.FINAL
_DELIVERY_GONE = Delivery.GONE
_DELIVERY_OPEN = Delivery.OPEN
_STATUS_COMPLETE = Status.COMPLETE
_STATUS_FAILED = Status.FAILED

_KEEP_ALIVE = b": keep-alive\n\n"
_GENERATION_HEADER = b"x-generation-id"
_ENDS_BODY = frozenset({"http.response.pathsend", "http.response.trailers"})
# A JSON response streamed in pieces is judged by its first this many bytes.
_JUDGE_BYTES = 4096


def _ends(kind: str, message: Message) -> bool:
    """Whether ``message`` (not start, not body) ends a response."""
    if kind == "http.response.pathsend":
        return True
    return kind == "http.response.trailers" and not message.get("more_trailers", False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseOptions:
    """What the response side of every request needs of its middleware, read once."""

    backend: Backend
    chooses_policy: bool  # the middleware's policy is a callable: every response is a generation
    max_lag_bytes: int
    keep_alive: float | None
    reads_back: int  # see Generation.reads_back
    transport: TransportMonitor | None
    lag_clock: LagClock


class Owner(Protocol):
    """What the response side asks of the exchange that owns it."""

    def part_done(self, task: asyncio.Task[Any]) -> None: ...

    def running_as(self, generation_id: str) -> None:
        """A Stop or a drain reaches it under that id from now on."""
        ...

    @property
    def client(self) -> Client:
        """Where the client stands: the exchange keeps it."""
        ...

    def client_left(self, reason: str) -> None:
        """The client is gone (``client``, ``silent``), lags, or the server refused."""
        ...

    def declared_policy(self) -> Policy | None:
        """The route's policy when it is a constant (a callable one is asked only when a
        client leaves)."""
        ...


def response_kind(scope: Scope, state: RequestState, chooses_policy: bool, message: Message) -> str:
    """``generation`` when this request is one (its route chose a policy or metering, the
    middleware's policy is a callable, it detached, or its response is an event stream),
    ``json`` when its body must tell, else ``other``: not an LLM exchange, so nothing is
    written and no header added."""
    if state.detached or chooses_policy or route_policy(scope) is not None:
        return "generation"
    endpoint = scope.get("endpoint") or getattr(scope.get("route"), "endpoint", None)
    if getattr(endpoint, METERED_ATTRIBUTE, None):
        return "generation"
    kind = content_kind(message.get("headers", ()))
    if kind == "event-stream":
        return "generation"
    return "json" if kind == "json" else "other"


def finish_body(generation: Generation, end: str | None) -> None:
    """The app's last body message: the generation ends as its protocol says (``end``,
    from metering: ``complete``, ``truncated`` or ``error``; None: it cannot tell)."""
    if generation.status_code >= 400:
        # An error answer (an upstream's refusal passed on) is whole, not a completed one.
        generation.finish(_STATUS_FAILED, f"the response was HTTP {generation.status_code}")
    elif end is None or end == "complete":
        generation.finish(_STATUS_COMPLETE)
    elif end == "truncated":
        reason = "the stream ended without its protocol's terminal marker"
        generation.append_frame(error_frame(generation.id, "truncated_stream", reason))
        generation.finish(_STATUS_FAILED, reason)
    else:
        generation.finish(_STATUS_FAILED, "the stream carried an error event")


def with_generation_id(message: Message, generation_id: str) -> Message:
    """The start message with ``x-generation-id``, unless the app names its responses."""
    headers = message.get("headers", ())
    for name, _ in headers:
        # Header names are lower case in ASGI.
        if name == _GENERATION_HEADER:
            return message
    headers = list(headers)
    headers.append((_GENERATION_HEADER, generation_id.encode()))
    return {**message, "headers": headers}


class KeepAlive:
    """Every ``interval`` while an event stream runs: if nothing was produced since the last
    tick, the client gets a ``: keep-alive`` comment (proxies and clients that time out on
    silence keep the connection). Not in the log, not counted as output."""

    __slots__ = ("handle", "interval", "out", "seen")

    def __init__(self, out: Outbound, interval: float) -> None:
        self.out = out
        self.interval = interval
        self.seen = 0  # the log's size at the last tick
        self.handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            interval, self._tick
        )

    def stop(self) -> None:
        handle = self.handle
        if handle is not None:
            self.handle = None
            handle.cancel()

    def _tick(self) -> None:
        self.handle = None
        out = self.out
        generation = out.generation
        if generation is None or not generation.running or out.client_gone:
            return
        size = generation.size
        if size == self.seen and not out.state.detached:
            (out.writer or out.open_writer()).keep_alive(_KEEP_ALIVE)
        self.seen = size
        self.handle = asyncio.get_running_loop().call_later(self.interval, self._tick)


class DeliveryWatch:
    """A streamed response's connection, watched by the transport monitor from its first
    body message (its head is with the server already; a response sent whole costs
    nothing): a client whose TCP acknowledges nothing for ``client_timeout`` is gone, and at
    the end what it acknowledged is what it was delivered."""

    __slots__ = ("out", "transport", "watch", "writer")

    def __init__(
        self,
        out: Outbound,
        transport: TransportMonitor,
        watch: ConnectionWatch,
        writer: ClientWriter,
    ) -> None:
        self.out = out
        self.transport = transport
        self.watch = watch
        self.writer = writer
        writer.watch_with(watch)

    def closed(self) -> None:
        """The server says the client left: it acknowledges nothing more."""
        self.transport.closed(self.watch)

    def forget(self) -> None:
        writer = self.writer
        writer.watch_with(None)
        self.transport.forget(self.watch)

    def settle(self, then: Callable[[], None]) -> bool:
        """The exchange is over: True if the client's TCP has yet to acknowledge the rest
        (``then`` is called once it did, died or closed); False if that is known now."""
        watch = self.watch
        watch.on_dead = None  # over: nothing is left to cancel or detach
        if self.transport.settle(watch, lambda: self._settled(then)):
            return True
        self._settled(None)
        return False

    def _settled(self, then: Callable[[], None] | None) -> None:
        """What the client's TCP acknowledged is known: that is what it was delivered."""
        out = self.out
        out.watched = None
        watch = self.watch
        if watch.delivery == "acked":
            state = out.state
            state.delivered_bytes = min(state.delivered_bytes, watch.acked_body)
            state.delivery = "acked"
        if then is not None:
            then()


class _Over:
    """The owner of a response whose exchange ended."""

    def part_done(self, task: asyncio.Task[Any]) -> None:
        pass

    def running_as(self, generation_id: str) -> None:
        pass

    client = _CLIENT_GONE  # over: nothing more is sent

    def client_left(self, reason: str) -> None:
        pass

    def declared_policy(self) -> Policy | None:
        return None


_OVER = _Over()


class Outbound:
    """One response, as the app sends it; see the module docstring."""

    __slots__ = (
        "body_ended",
        "delivery",
        "expect_trailers",
        "generation",
        "head",
        "held",
        "held_body",
        "hold",
        "keep_alive",
        "observe",
        "options",
        "owner",
        "passthrough",
        "reader",
        "scope",
        "send",
        "state",
        "trailers_ended",
        "watched",
        "writer",
    )

    def __init__(
        self,
        options: ResponseOptions,
        owner: Owner,
        scope: Scope,
        send: Send,
        state: RequestState,
        reader: RequestReader,
    ) -> None:
        self.options = options
        self.owner = owner
        self.scope = scope
        self.send = send
        self.state = state
        self.reader = reader
        self.writer: ClientWriter | None = None
        self.generation: Generation | None = None
        self.hold: StoreRoom | None = None  # Generation.hold, read once (a slot per chunk)
        self.head: Any = ()  # the response's headers, as the app sent them
        # Not a generation (not an LLM exchange): its messages go straight to the server.
        self.passthrough = False
        # A JSON response's start, and its first body messages, held until they say whether
        # it is an LLM API's.
        self.held: Message | None = None
        self.held_body: list[Message] = []
        # Where the response stands while no writer exists (a response sent in one piece).
        self.delivery = _DELIVERY_OPEN
        self.body_ended = False
        self.expect_trailers = False
        self.trailers_ended = False  # a trailers message without more_trailers went
        # Metering's hook (RequestState.on_message), taken at the response start.
        self.observe: Callable[[Message], bool | None] | None = None
        self.keep_alive: KeepAlive | None = None  # an event stream's, while it runs
        # The connection's transport, watched from the first body message (see _transport).
        self.watched: DeliveryWatch | None = None

    @property
    def client_gone(self) -> bool:
        """Nothing more is sent to the client (its exchange says where it stands)."""
        return self.owner.client is not _CLIENT_CONNECTED

    def handed(self) -> bool:
        """The whole response went to the server."""
        writer = self.writer
        return (writer.delivery if writer is not None else self.delivery) is _DELIVERY_DONE

    def unlink(self) -> None:
        """The exchange ended: let go of it and of the keep-alive (reference counting frees
        them all)."""
        self.owner = _OVER
        self.stop_keep_alive()

    def stop_keep_alive(self) -> None:
        keep_alive, self.keep_alive = self.keep_alive, None
        if keep_alive is not None:
            keep_alive.stop()

    async def app_send(self, message: Message) -> None:
        kind = message["type"]
        observe = self.observe
        if observe is not None and observe(message):
            self.observe = None  # metering has what it needs per message: the log has the rest
        if kind == "http.response.body":
            body = message.get("body", b"")
            size = len(body)
            more_body = message.get("more_body", False)
            writer = self.writer
            if (
                writer is not None
                and more_body
                and 0 < size <= MESSAGE_BYTES
                and self.owner.client is _CLIENT_CONNECTED
            ):
                # The hot path, one chunk of a stream: append it to the log (Generation.append,
                # inlined) and hand it to the writer, or wait for a client far behind.
                live: Generation = self.generation  # type: ignore[assignment]
                if live.running:
                    live.size += size
                    chunks = live.chunks
                    chunks.append(body)
                    if live.waiters:
                        live.wake()
                    if writer.direct:
                        writer.hand_chunk(message, size, len(chunks))
                    elif (
                        not writer.take(message)
                        and live.size - self.state.delivered_bytes > self.options.max_lag_bytes
                        and not live.reads_back
                    ):
                        await writer.room(self.options.max_lag_bytes // 2)
                    hold = self.hold  # the store may be behind
                    if hold is not None and live.size - live.base > HOLD_CHECK:
                        await hold.room()
                    return
            await self._body(message, body, more_body, writer)
        elif kind == "http.response.start":
            await self._response_start(message)
        else:
            await self._other(kind, message)

    async def _hand(self, writer: ClientWriter, generation: Generation) -> None:
        """The writer takes what was appended; on the memory backend a client ``max_lag_bytes``
        behind makes the app wait (a durable store gives the writer the backlog)."""
        if writer.direct:
            writer.pump()
            return
        writer.wake()
        if (
            generation.size - self.state.delivered_bytes > self.options.max_lag_bytes
            and not generation.reads_back
        ):
            await writer.room(self.options.max_lag_bytes // 2)

    async def _body(
        self, message: Message, body: bytes, more_body: bool, writer: ClientWriter | None
    ) -> None:
        """A body message off the hot path: the first ones, a held JSON's, the last one,
        one over MESSAGE_BYTES, one while the client lags."""
        generation = self.generation
        if generation is None:
            if self.held is not None:
                if not await self._judge(message, body, more_body):
                    return
                # It is one: this message goes on below, behind the held ones.
                generation, writer = self.generation, self.writer
            elif self.passthrough:
                await self._pass_body(message, len(body), more_body)
                return
            if generation is None:
                raise RuntimeError(
                    "ASGI message 'http.response.body' sent before 'http.response.start'"
                )
        if body:
            if len(body) <= MESSAGE_BYTES:
                generation.append(body)
            else:
                # In pieces, so the client's progress through it shows.
                for start in range(0, len(body), MESSAGE_BYTES):
                    generation.append(body[start : start + MESSAGE_BYTES])
        if not more_body:
            self._end_body(generation)
        elif self.hold is not None and generation.size - generation.base > HOLD_CHECK:
            await self.hold.room()  # the store is behind: wait on it, not on the client
        if self.owner.client is not _CLIENT_CONNECTED:
            return
        if writer is not None:
            await self._hand(writer, generation)
        elif more_body:
            if body:
                self.open_writer().pump()
        elif (
            len(generation.chunks) > 1
            or self.expect_trailers
            or generation.error
            or len(body) > MESSAGE_BYTES
        ):
            self.open_writer().pump()
        else:
            await self._send_whole(message, len(body))

    def _end_body(self, generation: Generation) -> None:
        """The app's last body message: the generation ends as its protocol says."""
        if not generation.running:
            raise RuntimeError("ASGI message 'http.response.body' sent after the response ended")
        ending = self.state.stream_ending
        finish_body(generation, None if ending is None else ending())
        self.body_ended = True

    async def _response_start(self, message: Message) -> None:
        reader = self.reader
        if reader.gate is not None:
            reader.open_gate()  # the body is not asked for now: watch for the client
        observe = self.state.message_hook
        if observe is not None:
            observe(message)
            # It may step aside now: a response it does not meter.
            self.observe = self.state.message_hook
        if self.generation is not None or self.held is not None or self.passthrough:
            raise RuntimeError("ASGI message 'http.response.start' sent twice")
        if message.get("trailers"):
            self.expect_trailers = True
        kind_of = response_kind(self.scope, self.state, self.options.chooses_policy, message)
        if kind_of == "json":
            self.held = message  # its body decides
            return
        if kind_of == "other":
            self.passthrough = True
            await self._pass(message)
            return
        await self._open_generation(message)

    async def _judge(self, message: Message, body: bytes, more_body: bool) -> bool:
        """A body message of a held JSON response: decide once its first bytes (or all of
        it) are in. True: it is a generation, and ``message`` goes on as its body (the held
        ones before it went already); False: held on, or passed straight through."""
        start = self.held
        assert start is not None
        held_body = self.held_body
        head = b"".join([*(m.get("body", b"") for m in held_body), body]) if held_body else body
        if (
            more_body
            and len(head) < _JUDGE_BYTES
            and not is_llm_json(head, start["status"], whole=False)
        ):
            held_body.append(message)  # nothing tells yet: wait for more of it
            return False
        self.held = None
        self.held_body = []
        if is_llm_json(head, start["status"], whole=not more_body):
            await self._open_generation(start)
            if held_body:
                # Through the generation's path; metering saw these messages already.
                observe, self.observe = self.observe, None
                try:
                    for held in held_body:
                        await self.app_send(held)
                finally:
                    self.observe = observe
            return True
        self.passthrough = True
        await self._pass(start)
        for held in (*held_body, message):
            await self._pass_body(held, len(held.get("body", b"")), held.get("more_body", False))
        return False

    async def _pass(self, message: Message) -> None:
        """A message of a response that is not a generation, straight to the server."""
        if self.owner.client is not _CLIENT_CONNECTED:
            return
        try:
            await self.send(message)
        except OSError:
            self.client_went_away()

    async def _pass_body(self, message: Message, size: int, more_body: bool) -> None:
        await self._pass(message)
        if self.owner.client is not _CLIENT_CONNECTED:
            return
        self.state.delivered_bytes += size
        if not more_body and not self.expect_trailers:
            self.delivery = _DELIVERY_DONE

    async def _open_generation(self, message: Message) -> None:
        """The response is a generation: open its log and hand the server its start."""
        await self._pass(self._start(message))
        if self.owner.client is not _CLIENT_CONNECTED:
            return
        interval = self.options.keep_alive
        if interval is not None and is_event_stream(self.generation.content_type):  # type: ignore[union-attr]
            self.keep_alive = KeepAlive(self, interval)

    async def _other(self, kind: str, message: Message) -> None:
        """Every other message keeps its place behind what was produced before it."""
        if kind == "http.response.trailers":
            if self.trailers_ended:
                raise RuntimeError("ASGI message 'http.response.trailers' sent after the last ones")
            self.trailers_ended = not message.get("more_trailers", False)
        generation = self.generation
        if generation is None:
            held = self.held
            if held is not None and kind in _ENDS_BODY:
                # A JSON response that ends without a whole body message: no LLM answer.
                self.held = None
                self.passthrough = True
                await self._pass(held)
                for body in self.held_body:
                    await self._pass(body)
                self.held_body = []
            # Nothing of the response is held (early hints, say), or it is no generation:
            # straight through.
            await self._pass(message)
            if self.passthrough and self.owner.client is _CLIENT_CONNECTED and _ends(kind, message):
                self.delivery = _DELIVERY_DONE
            return
        if kind == "http.response.pathsend":
            # The file is the body, sent by the server; the log keeps none of it.
            if not generation.finish(_STATUS_COMPLETE):
                raise RuntimeError("ASGI message 'http.response.pathsend' after the response ended")
            self.body_ended = True
        if self.owner.client is not _CLIENT_CONNECTED:
            return
        writer = self.writer or self.open_writer()
        if kind == "http.response.pathsend":
            writer.ends_elsewhere()
            watched = self.watched
            if watched is not None:
                # The server sends the file: its bytes are not counted here.
                self.watched = None
                watched.forget()
        writer.queue(message, after_end=self.body_ended and kind != "http.response.pathsend")
        writer.pump()

    def open_writer(self) -> ClientWriter:
        generation = self.generation
        assert generation is not None
        writer = self.writer = ClientWriter(
            self.send,
            generation,
            self.state,
            clock=self.options.lag_clock,
            expect_trailers=self.expect_trailers,
            on_lost=self._writer_lost,
        )
        writer.start(self.owner.part_done)
        transport = self.options.transport
        if transport is not None:
            chunked = not any(name == b"content-length" for name, _ in self.head)
            loop = asyncio.get_running_loop()
            watch = transport.watch(self.scope, loop, self._silent, chunked=chunked)
            if watch is not None:
                self.watched = DeliveryWatch(self, transport, watch, writer)
        return writer

    def _silent(self) -> None:
        """The client's TCP acknowledged nothing for ``client_timeout``: it is gone."""
        writer = self.writer
        over = self.state.finished
        if writer is not None and self.owner.client is _CLIENT_CONNECTED and not over:
            writer.lost("silent")

    def _writer_lost(self, reason: str) -> None:
        self.owner.client_left(reason)

    def _start(self, message: Message) -> Message:
        """Open the generation; return the start message with ``x-generation-id`` added."""
        if self.generation is not None:
            raise RuntimeError("ASGI message 'http.response.start' sent twice")
        headers = self.head = message.get("headers", ())
        state = self.state
        generation = Generation(
            state.generation_id,
            principal=state.principal,
            status_code=message["status"],
            headers=headers,
        )
        # The route's policy from the start (the stored generation says it whether or not
        # its client leaves), or the one applied already.
        policy = state.policy or self.owner.declared_policy()
        if policy is not None:
            generation.policy = policy.value
            generation.detached = state.detached
        if state.continuation is not None:
            generation.continuation = state.continuation
        if state.usage_pending:
            generation.record_owed = True
        # What the client has not received stays in memory, unless the store gives it back.
        generation.reader = state
        generation.reads_back = self.options.reads_back
        self.generation = state.generation = generation
        backend = state.log_store = self.options.backend
        backend.register(generation)
        self.hold = generation.hold
        self.owner.running_as(generation.id)
        if message.get("trailers"):
            self.expect_trailers = True
        return with_generation_id(message, state.generation_id)

    def client_left(self, reason: str) -> None:
        """The exchange heard that the client is gone (``client``, ``silent``), lags
        (``lag``), or the server refused a send (``error``): nothing more is sent to it."""
        writer = self.writer
        if writer is not None:
            writer.lost(reason)
        elif self.delivery is not _DELIVERY_DONE:
            self.delivery = _DELIVERY_GONE
        watched = self.watched
        if watched is not None and reason == "client":
            watched.closed()  # the server says the client left: it acknowledges nothing more

    def client_went_away(self) -> None:
        # Servers at ASGI spec 2.4+ raise OSError on send when the client is gone.
        self.owner.client_left("client")

    async def _send_whole(self, message: Message, size: int) -> None:
        """Send the whole response, one message, from the producer's own task, judged by
        the lag rule while in flight: a client that stops reading (an HTTP/2 window that
        stays shut) is lagging then, and the policy applies to its request."""
        self.delivery = _DELIVERY_FINAL
        clock = self.options.lag_clock
        clock.begin(self)
        try:
            await self.send(message)
        except OSError:
            self.client_went_away()
            return
        finally:
            clock.end(self)
        if self.delivery is _DELIVERY_GONE:
            return  # it lagged meanwhile: what the server took late is not counted
        self.state.delivered_bytes += size
        if not self.expect_trailers:
            self.delivery = _DELIVERY_DONE

    async def send_problem(
        self, status: int, kind: str, title: str, detail: str, *, headers: list[Any]
    ) -> None:
        """Answer in one piece with a problem (the app's response never started)."""
        self.delivery = _DELIVERY_DONE
        await send_problem(self.send, status, kind, title, detail, headers=headers)

    def lagging(self) -> None:
        """The lag clock: the whole response's send waited ``max_lag_seconds``."""
        if self.delivery is _DELIVERY_FINAL:
            self.owner.client_left("lag")
