"""DisconnectMiddleware: run the app decoupled from the client; cancel or detach on disconnect."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from base64 import urlsafe_b64encode
from collections import deque
from typing import TYPE_CHECKING, Any

from ._aio import join, shielded
from ._backends import Backend, MemoryBackend
from ._log import Generation, Status
from ._policy import Policy, PolicySource, check_source, resolve_policy, route_policy
from ._resume import ResumeEndpoints, error_frame, is_event_stream
from ._state import Counters, RequestState, current_state
from ._supervisor import Supervisor

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Generator

    from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["DisconnectMiddleware", "default_principal"]

logger = logging.getLogger("asgi_disconnect")

_DISCONNECT: Message = {"type": "http.disconnect"}
_GENERATION_HEADER = b"x-generation-id"
_DIRECT_SEND_LIMIT = 1 << 16
_ROUTE_MEMO_SIZE = 4096


def default_principal(scope: Scope) -> str:
    """A digest of the caller's ``Authorization`` or ``x-api-key`` header; ``""`` if none."""
    for name, value in scope["headers"]:
        if name == b"authorization" or name == b"x-api-key":
            return hashlib.sha256(value).hexdigest()[:32]
    return ""


class _IdSource:
    """Random ids from the OS CSPRNG, read and encoded 256 at a time (18 bytes = 24 chars)."""

    __slots__ = ("_ids",)

    _BATCH = 256

    def __init__(self) -> None:
        self._ids: list[str] = []

    def __call__(self) -> str:
        ids = self._ids
        if not ids:
            encoded = urlsafe_b64encode(os.urandom(18 * self._BATCH)).decode()
            ids += ["gen_" + encoded[start : start + 24] for start in range(0, len(encoded), 24)]
        return ids.pop()


_new_generation_id = _IdSource()


class DisconnectMiddleware:
    """Makes a client disconnect a deliberate decision per route: cancel or detach.

    The app runs in a task owned by the middleware's supervisor; its ``send`` appends to
    the request's generation log and returns at once, and a client writer drains the
    log to the server. A single reader owns ``receive``. When the client disconnects,
    or falls more than ``max_lag_bytes`` / ``max_lag_seconds`` behind, the route's
    policy applies: ``cancel`` cancels the app and closes tracked upstream responses;
    ``detach`` lets it finish, its output readable under ``resume_prefix``.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        backend: Backend | None = None,
        policy: PolicySource = Policy.CANCEL,
        principal: Callable[[Scope], str | None] | None = None,
        resume_prefix: str | None = "/generations",
        max_lag_bytes: int = 4 << 20,
        max_lag_seconds: float = 30.0,
        shutdown_timeout: float = 30.0,
    ) -> None:
        if max_lag_bytes <= 0:
            raise ValueError("max_lag_bytes must be positive")
        if max_lag_seconds <= 0:
            raise ValueError("max_lag_seconds must be positive")
        if shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must not be negative")
        if resume_prefix is not None and (
            not resume_prefix.startswith("/") or resume_prefix.endswith("/")
        ):
            raise ValueError("resume_prefix must start with '/' and not end with '/'")
        self.app = app
        if backend is None:
            logger.warning(
                "DisconnectMiddleware has no backend: generations are kept in memory only "
                "and detached output will not survive a restart; pass backend=connect(...)"
            )
            backend = MemoryBackend()
        self.backend = backend
        self.policy = check_source(policy)
        self.principal = principal or default_principal
        self.resume_prefix = resume_prefix
        self.max_lag_bytes = max_lag_bytes
        self.max_lag_seconds = max_lag_seconds
        self.shutdown_timeout = shutdown_timeout
        self.counters = Counters()
        self.supervisor = Supervisor()
        self._resume = ResumeEndpoints(backend, self.principal)
        self._warned_no_lifespan = False
        # (method, path) -> whether that route can only cancel, learned after routing.
        self._cancel_only: dict[tuple[str, str], bool] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope_type = scope["type"]
        if scope_type == "http":
            prefix = self.resume_prefix
            if prefix is not None and scope["path"].startswith(prefix):
                rest = scope["path"][len(prefix) :]
                if rest.startswith("/"):
                    await self._resume(scope, receive, send, rest)
                    return
            exchange = _Exchange(self, scope, receive, send)
            if self._cancel_only.get((scope["method"], scope["path"]), False):
                await exchange.run_inline()
            else:
                await exchange.run_supervised()
        elif scope_type == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def lifespan_receive() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.backend.open()
                self.supervisor.start()
            elif message["type"] == "lifespan.shutdown":
                # Drain first, so the app's own resources (upstream clients) are still open.
                await self.supervisor.drain(self.shutdown_timeout)
                await self.backend.aclose()
            return message

        await self.app(scope, lifespan_receive, send)

    def learn_route(self, scope: Scope) -> None:
        """Remember whether this route can only cancel, so later requests run it inline."""
        if "endpoint" not in scope:
            return
        source = route_policy(scope)
        memo = self._cancel_only
        if len(memo) >= _ROUTE_MEMO_SIZE:
            memo.clear()
        memo[(scope["method"], scope["path"])] = (
            source if source is not None else self.policy
        ) is Policy.CANCEL

    def resolve(self, scope: Scope) -> Policy:
        source = route_policy(scope)
        return resolve_policy(self.policy if source is None else source, scope)

    def owns_detached(self) -> bool:
        if self.supervisor.started:
            return True
        if not self._warned_no_lifespan:
            self._warned_no_lifespan = True
            logger.warning(
                "the ASGI server did not run the lifespan protocol: detached generations "
                "stay tied to their requests and are not drained at shutdown"
            )
        return False


class _Exchange:
    """One HTTP request: the receive reader, the app task and the client writer."""

    # What most requests never change stays on the class; an exchange sets its own when it
    # does. This keeps the start of every request down to a few stores.
    inbox: deque[Message] | None = None
    inbox_waiter: asyncio.Future[None] | None = None
    taken_waiter: asyncio.Future[None] | None = None
    request_task: asyncio.Task[Any] | None = None
    app_task: asyncio.Task[None] | None = None
    writer: asyncio.Task[None] | None = None
    lag_timer: asyncio.TimerHandle | None = None
    app_error: BaseException | None = None
    generation: Generation | None = None
    client_gone = False
    response_complete = False
    final_sending = False
    end_response = True
    send_started = 0.0
    sent_index = 0
    watching = False
    woken = False
    wake_reason: str | None = None
    watcher: asyncio.Task[Any] | None = None
    cancelled_by_policy = False
    # True while a body chunk can go straight to the server: the response started, is
    # running, everything before was sent and no writer task is busy.
    direct = False

    def __init__(self, mw: DisconnectMiddleware, scope: Scope, receive: Receive, send: Send):
        self.mw = mw
        self.scope = scope
        self.receive = receive
        self.send = send
        self.state = state = RequestState(_new_generation_id())
        scope["asgi_disconnect"] = state

    # -- inline: a route that can only cancel runs in the request's own task -----------

    async def run_inline(self) -> None:
        state = self.state
        current_state.set(state)
        app: Any = self.mw.app(self.scope, self.app_receive, self.app_send)
        if getattr(app, "send", None) is None:  # an awaitable that is not a coroutine
            app = _awaited(app)
        try:
            try:
                waiting_on = app.send(None)
            except StopIteration:
                pass
            else:
                # The app waits on something: watch the client meanwhile. An app that
                # never waits needs no watcher.
                self.request_task = asyncio.current_task()
                self._start_watcher()
                await _Resume(app, waiting_on)
            generation = self.generation
            if generation is not None and generation.running:
                self._record_end(Status.FAILED, "the app returned before its response was complete")
            if self.writer is not None:
                await join(self.writer)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            if not self.cancelled_by_policy or task.uncancel() > 0:
                self._record_end(Status.INTERRUPTED, "interrupted before it finished")
                raise
            self._record_end(Status.CANCELLED, "cancelled after the client disconnected")
        except BaseException as exc:
            self._failed(exc)
            if self.writer is not None:
                await join(self.writer)
            raise
        finally:
            watcher = self.watcher
            if watcher is not None and not watcher.done() and not state.detached:
                watcher.cancel()
            if state.detached:
                self._count_detach_completed()
            state.finish()

    def _start_watcher(self) -> None:
        if self.watcher is None and not self.response_complete:
            self.watcher = asyncio.get_running_loop().create_task(self._watch_inline())

    async def _watch_inline(self) -> None:
        reason = await self._watch()
        if reason == "client" or reason == "lag":
            await self._client_lost(reason)

    # -- supervised: the app runs in the supervisor's task, the request task watches ---

    async def run_supervised(self) -> None:
        self.request_task = self.watcher = asyncio.current_task()
        app_task = self.app_task = self.mw.supervisor.spawn(self.run_app())
        app_task.add_done_callback(self._part_done)
        try:
            reason = await self._watch()
        except asyncio.CancelledError:
            # The server cancelled the request: the work is the request's, not detached.
            if not self.state.detached:
                app_task.cancel()
            raise
        finally:
            self.mw.learn_route(self.scope)
        if reason == "complete":
            if self.writer is not None:
                await join(self.writer)
            await join(app_task)
        elif reason != "done":
            await self._client_lost(reason)
            if not app_task.done():
                return
        error = self.app_error
        if error is not None and not self.state.detached:
            self.app_error = None
            raise error

    async def _watch(self) -> str:
        receive = self.receive
        self.watching = True
        try:
            while True:
                message = await receive()
                kind = message["type"]
                if kind == "http.request":
                    inbox = self.inbox
                    if inbox is None:
                        inbox = self.inbox = deque()
                    inbox.append(message)
                    waiter = self.inbox_waiter
                    if waiter is not None:
                        self.inbox_waiter = None
                        if not waiter.done():
                            waiter.set_result(None)
                    if message.get("more_body", False) and inbox:
                        # Read the next part only once the app took this one: keep backpressure.
                        self.taken_waiter = asyncio.get_running_loop().create_future()
                        await self.taken_waiter
                elif kind == "http.disconnect":
                    if self.response_complete or self.final_sending:
                        return "complete"
                    return "client"
        except asyncio.CancelledError:
            if not self.woken:
                raise
            self.woken = False
            task = self.watcher
            if task is not None and task.uncancel() > 0:
                raise
            assert self.wake_reason is not None
            return self.wake_reason
        finally:
            self.watching = False

    def _wake(self, reason: str) -> None:
        """Stop the watcher's read of ``receive`` and tell it why."""
        if self.wake_reason is None:
            self.wake_reason = reason
        if self.watching and not self.woken and self.watcher is not None:
            self.woken = True
            self.watcher.cancel()

    def _part_done(self, _: asyncio.Task[Any]) -> None:
        app_task = self.app_task
        writer = self.writer
        if app_task is not None and app_task.done() and (writer is None or writer.done()):
            self._wake("complete" if self.response_complete else "done")
            self.state.finish()

    async def _client_lost(self, reason: str) -> None:
        mw = self.mw
        state = self.state
        self.client_gone = True
        self.direct = False
        state.disconnect_reason = reason
        state.disconnected.set()
        mw.counters.disconnects += 1
        self._stop_writer()
        runner = self.app_task or self.request_task
        assert runner is not None
        if runner.done() or self.response_complete:
            return
        policy = state.policy = mw.resolve(self.scope)
        generation = self.generation
        if generation is not None:
            generation.policy = policy.value
        if policy is Policy.CANCEL:
            mw.counters.cancelled += 1
            self.cancelled_by_policy = True
            runner.cancel()
            waiter = self.inbox_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            if state.upstreams:
                await shielded(state.close_upstreams())
            if runner is self.app_task:
                await join(runner)
            return
        mw.counters.detached += 1
        state.detached = True
        if generation is not None:
            generation.detached = True
        if runner is not self.app_task:
            # Predicted cancel-only, yet it detached: it stays tied to this request.
            mw._cancel_only[(self.scope["method"], self.scope["path"])] = False
        elif not mw.owns_detached():
            await join(runner)

    # -- the app task ---------------------------------------------------------------

    async def run_app(self) -> None:
        current_state.set(self.state)
        try:
            await self.mw.app(self.scope, self.app_receive, self.app_send)
        except asyncio.CancelledError:
            self._record_end(
                Status.CANCELLED if self.state.policy is Policy.CANCEL else Status.INTERRUPTED,
                "cancelled after the client disconnected"
                if self.state.policy is Policy.CANCEL
                else "interrupted before it finished",
            )
            raise
        except BaseException as exc:
            self._failed(exc)
            if self.state.detached:
                logger.error(
                    "detached generation %s failed", self.state.generation_id, exc_info=exc
                )
            else:
                self.app_error = exc
        else:
            generation = self.generation
            if generation is not None and generation.running:
                self._record_end(Status.FAILED, "the app returned before its response was complete")
        finally:
            self._count_detach_completed()

    def _count_detach_completed(self) -> None:
        generation = self.generation
        if self.state.detached and generation is not None and generation.status is Status.COMPLETE:
            self.mw.counters.detach_completed += 1

    def _record_end(self, status: Status, error: str) -> None:
        self.direct = False
        generation = self.generation
        if generation is None or not generation.running:
            return
        if status is Status.FAILED and is_event_stream(generation.content_type):
            generation.append(error_frame(generation.id, "incomplete_response", error))
        generation.finish(status, error)

    def _failed(self, exc: BaseException) -> None:
        self.direct = False
        generation = self.generation
        if generation is None or not generation.running:
            return
        code = getattr(exc, "error_type", "stream_error")
        if is_event_stream(generation.content_type):
            generation.append(
                error_frame(generation.id, str(code), "The stream failed after it started.")
            )
        else:
            self.end_response = False
        generation.finish(Status.FAILED, f"{type(exc).__name__}: {exc}"[:500])
        if not self.client_gone and self.writer is None and self.generation is not None:
            self._pump()

    async def app_receive(self) -> Message:
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
            if self.response_complete or (self.client_gone and not self.state.detached):
                return _DISCONNECT
            if self.watcher is None:
                self._start_watcher()
            # Under detach the app never hears of the disconnect: it would stop itself.
            waiter = self.inbox_waiter = asyncio.get_running_loop().create_future()
            await waiter

    async def app_send(self, message: Message) -> None:
        kind = message["type"]
        if kind != "http.response.body":
            if kind == "http.response.start":
                message = self._start(message)
            if not self.client_gone:
                try:
                    await self.send(message)
                except OSError:
                    self._client_went_away()
                else:
                    # The client may have gone while the server took the start.
                    self.direct = kind == "http.response.start" and not self.client_gone
            return
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.direct and more_body and body:
            # The hot path, one chunk of a stream whose client keeps up: append it to the
            # log and hand the app's own message to the server from this task, as long as
            # the server takes it without waiting.
            # Generation.append, inlined: a direct exchange's generation is running.
            live: Generation = self.generation  # type: ignore[assignment]
            live.size += len(body)
            live.chunks.append(body)
            if live.waiters:
                live.wake()
            sending: Any = self.send(message)
            try:
                waiting_on = sending.send(None)
            except StopIteration:
                self.sent_index += 1
                self.state.delivered_bytes += len(body)
            except OSError:
                self._client_went_away()
            else:
                self._start_writer(sending, waiting_on, (message, len(body), self.sent_index + 1))
            return
        generation = self.generation
        if generation is None:
            raise RuntimeError(
                "ASGI message 'http.response.body' sent before 'http.response.start'"
            )
        if body:
            generation.append(body)
        if not more_body:
            self.direct = False
            if not generation.finish(Status.COMPLETE):
                raise RuntimeError(
                    "ASGI message 'http.response.body' sent after the response ended"
                )
        if self.client_gone or (more_body and not body):
            return
        if self.writer is not None:
            if generation.size - self.state.delivered_bytes > self.mw.max_lag_bytes:
                self._wake("lag")
        elif more_body or self.sent_index or len(generation.chunks) > 1:
            self._pump()
        else:
            await self._send_whole(message, len(body))

    def _start(self, message: Message) -> Message:
        """Open the generation; return the start message with ``x-generation-id`` added."""
        if self.generation is not None:
            raise RuntimeError("ASGI message 'http.response.start' sent twice")
        headers = message.get("headers", ())
        state = self.state
        generation = Generation(
            state.generation_id,
            principal=self.mw.principal(self.scope) or "",
            status_code=message["status"],
            headers=headers,
        )
        if state.policy is not None:
            generation.policy = state.policy.value
            generation.detached = state.detached
        self.generation = state.generation = generation
        self.mw.backend.register(generation)
        headers = list(headers)
        headers.append((_GENERATION_HEADER, state.generation_id.encode()))
        return {**message, "headers": headers}

    def _client_went_away(self) -> None:
        # Servers at ASGI spec 2.4+ raise OSError on send when the client is gone.
        self.client_gone = True
        self.direct = False
        self._wake("client")

    async def _send_whole(self, message: Message, size: int) -> None:
        """Send the whole response, one message, as the app gave it. A large one is sent
        under the lag deadline, so a client that stops reading cannot hold it."""
        self.final_sending = True
        try:
            if size <= _DIRECT_SEND_LIMIT:
                await self.send(message)
            else:
                async with asyncio.timeout(self.mw.max_lag_seconds):
                    await self.send(message)
        except OSError:
            self._client_went_away()
            return
        except TimeoutError:
            self.final_sending = False
            self._wake("lag")
            return
        self.state.delivered_bytes += size
        self.response_complete = True

    # -- the client writer ----------------------------------------------------------

    def _stop_writer(self) -> None:
        writer = self.writer
        if writer is not None and not writer.done():
            writer.cancel()
        if self.lag_timer is not None:
            self.lag_timer.cancel()
            self.lag_timer = None

    def _check_lag(self) -> None:
        if self.writer is None or self.writer.done():
            self.lag_timer = None
            return
        limit = self.mw.max_lag_seconds
        loop = asyncio.get_running_loop()
        if self.send_started and loop.time() - self.send_started > limit:
            self.lag_timer = None
            self._wake("lag")
            return
        self.lag_timer = loop.call_later(limit / 2, self._check_lag)

    def _next_message(self) -> tuple[Message, int, int] | None:
        """The chunks produced and not yet handed to the server, as one message."""
        generation = self.generation
        assert generation is not None
        count = len(generation.chunks)
        ended = not generation.running
        if self.sent_index < count:
            chunks = generation.chunks_from(self.sent_index)
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif ended and not self.response_complete:
            body = b""
        else:
            return None
        final = ended and self.end_response
        if ended and not final and not body:
            return None
        if final:
            self.final_sending = True
        return (
            {"type": "http.response.body", "body": body, "more_body": not final},
            len(body),
            count,
        )

    def _sent(self, message: Message, size: int, count: int) -> None:
        self.sent_index = count
        self.state.delivered_bytes += size
        if not message["more_body"]:
            self.response_complete = True

    def _pump(self) -> None:
        """Hand what waits to the server from the producer's task, while it takes it at once.

        A send that would wait (the client is not reading) is not awaited here: it goes on
        in a writer task, so the producer never waits on the client.
        """
        pending = self._next_message()
        if pending is None:
            return
        message, size, count = pending
        sending: Any = self.send(message)
        try:
            waiting_on = sending.send(None)
        except StopIteration:
            self._sent(message, size, count)
            return
        except OSError:
            self._client_went_away()
            return
        self._start_writer(sending, waiting_on, pending)

    def _start_writer(
        self, sending: Any, waiting_on: Any, pending: tuple[Message, int, int]
    ) -> None:
        """Finish a send that waits, and what follows it, in a writer task."""
        self.direct = False
        writer = asyncio.get_running_loop().create_task(
            self._write_loop(sending, waiting_on, pending)
        )
        writer.add_done_callback(self._part_done)
        self.writer = writer

    async def _write_loop(
        self, sending: Any, waiting_on: Any, pending: tuple[Message, int, int]
    ) -> None:
        loop = asyncio.get_running_loop()
        self.send_started = loop.time()
        self.lag_timer = loop.call_later(self.mw.max_lag_seconds / 2, self._check_lag)
        try:
            await _Resume(sending, waiting_on)
            self._sent(*pending)
            while not self.client_gone:
                next_message = self._next_message()
                if next_message is None:
                    return
                self.send_started = loop.time()
                await self.send(next_message[0])
                self._sent(*next_message)
        except OSError:
            self._client_went_away()
        finally:
            self.send_started = 0.0
            if self.lag_timer is not None:
                self.lag_timer.cancel()
                self.lag_timer = None
            if self.writer is asyncio.current_task():
                # Caught up: the producer hands the next chunks over itself.
                self.writer = None
                generation = self.generation
                self.direct = (
                    not self.client_gone
                    and generation is not None
                    and generation.running
                    and self.sent_index == len(generation.chunks)
                )


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


class _Resume:
    """Finish, in the awaiting task, a coroutine that another task started and that waits."""

    __slots__ = ("coro", "waiting_on")

    def __init__(self, coro: Any, waiting_on: Any) -> None:
        self.coro = coro
        self.waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self.coro
        value = self.waiting_on
        while True:
            try:
                sent = yield value
            except BaseException as exc:
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value
