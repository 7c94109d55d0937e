"""DrainMiddleware: deploys that cut no stream.

A drain stops admitting new requests (503 with ``Retry-After``, problem+json ``draining``),
turns the readiness endpoint to 503 so the load balancer stops sending, and lets the work in
flight end: requests, and generations that detached. Resume reads and Stops go on. At the
deadline what still runs ends through the lifecycle's ``drain`` hooks: an event stream its
client still reads gets an ``event: error`` frame of type ``interrupted`` with
``"stopped_by": "drain"`` and ``retry_after``, detached work ends ``interrupted`` with the
prefix it produced kept.

A drain starts by ``DrainMiddleware.drain``, by ``POST {drain_path}`` (a Kubernetes
preStop hook), or by SIGTERM: the middleware takes the signal from the server (uvicorn,
hypercorn) at startup, drains, then hands the signal back to the server, whose own shutdown
then finds nothing left to cut. Handing a running generation over to another replica is out
of scope: a client resumes what was produced, or retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl

import msgspec

from ._contract import SCOPE_KEY, RequestState, answered
from ._lifecycle import Lifecycle, lifecycle_of
from ._problem import send_json, send_problem

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["DrainMiddleware"]

logger = logging.getLogger("asgi_disconnect")

_encode = msgspec.json.Encoder().encode
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})
# A request that carries any of these came through a proxy: its address is not its own.
_FORWARDED = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip", b"x-forwarded-host"})
# After the deadline, how long a drain waits for interrupted work to finish ending.
_GRACE = 5.0


class DrainMiddleware:
    """Refuse new requests while draining, let the work in flight end, interrupt the rest
    at the deadline. See the module's docstring.

    - ``deadline``: seconds a drain gives the work in flight (a drain may pass its own);
    - ``retry_after``: the ``Retry-After`` of refused requests and of a drain's frames;
    - ``ready_path``: readiness, 200 while serving, 503 while draining (None: none);
    - ``drain_path``: ``POST`` starts a drain, ``?deadline=S``, ``?wait=true`` answers
      when it is over; only with ``Authorization: Bearer {drain_token}`` (None: no
      endpoint), or from loopback with ``trust_loopback=True`` (a warning at startup says
      so; a request that came through a proxy never counts as loopback). The readiness
      body shows the requests in flight to the same callers only;
    - ``resume_prefix``: requests under it (resume reads, Stops) are served while draining;
    - ``signals``: take SIGTERM from the server (main thread only), drain, hand it back;
    - ``window``: how many recent request durations ``suggest_drain_deadline`` reads.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        deadline: float = 30.0,
        retry_after: int = 5,
        ready_path: str | None = "/readyz",
        drain_path: str | None = "/drainz",
        drain_token: str | None = None,
        trust_loopback: bool = False,
        resume_prefix: str | None = "/generations",
        signals: bool = True,
        window: int = 1000,
    ) -> None:
        if not (deadline > 0 and math.isfinite(deadline)):
            raise ValueError("deadline must be a positive number of seconds")
        if isinstance(retry_after, bool) or not isinstance(retry_after, int) or retry_after < 0:
            raise ValueError("retry_after must be a non-negative whole number of seconds")
        for name, path in (("ready_path", ready_path), ("drain_path", drain_path)):
            if path is not None and not path.startswith("/"):
                raise ValueError(f"{name} must start with '/'")
        if window < 1:
            raise ValueError("window must be at least 1")
        self.app = app
        self.deadline = deadline
        self.retry_after = retry_after
        self.ready_path = ready_path
        self.drain_path = drain_path
        if drain_token is not None and (not drain_token or not drain_token.isascii()):
            raise ValueError("drain_token must be a non-empty ASCII string")
        self._token = b"Bearer " + drain_token.encode() if drain_token else None
        self.trust_loopback = trust_loopback
        self.resume_prefix = resume_prefix
        self.signals = signals
        self.in_flight = 0
        self.durations: deque[float] = deque(maxlen=window)
        self.draining = False
        self.drained = False
        self.lifecycle: Lifecycle | None = None
        self._drain_task: asyncio.Task[None] | None = None
        # The drain under way: its deadline in seconds, and when it ends (the loop's clock).
        self._deadline: tuple[float, float] | None = None
        self._idle: asyncio.Event | None = None
        self._retry_header = (b"retry-after", str(retry_after).encode())
        self._sigterm: SigtermHold | None = None
        # Generations whose request is over but whose work goes on (detached), until they end.
        self._detached: set[RequestState] = set()

    # -- requests -----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path == self.ready_path:
                await self._ready(scope, send)
                return
            if path == self.drain_path:
                await self._drain_endpoint(scope, send)
                return
            if self.draining and not self._serves_while_draining(path):
                answered(scope, 503)
                await self._refuse(send)
                return
            await self._counted(scope, receive, send)
        elif kind == "lifespan":
            lifecycle, owner = lifecycle_of(scope)
            self.lifecycle = lifecycle
            lifecycle.register(
                "DrainMiddleware",
                unique=True,
                startup=self._startup,
                stop_admitting=self._stop_admitting,
                close=self._closed,
            )
            await lifecycle.run(owner, self.app, scope, receive, send)
        elif kind == "websocket" and self.draining:
            await send({"type": "websocket.close", "code": 1012})  # service restart
        else:
            await self.app(scope, receive, send)

    def _serves_while_draining(self, path: str) -> bool:
        prefix = self.resume_prefix
        return prefix is not None and path.startswith(prefix + "/")

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.in_flight += 1
        started = time.monotonic()
        try:
            await self.app(scope, receive, send)
        finally:
            self.durations.append(time.monotonic() - started)
            self.in_flight -= 1
            state = scope.get(SCOPE_KEY)
            if isinstance(state, RequestState) and not state.finished and state.progress().detached:
                self._detached.add(state)
                state.on_end(lambda _: self._detached.discard(state))
            idle = self._idle
            if idle is not None and self.in_flight == 0:
                idle.set()

    async def _refuse(self, send: Send) -> None:
        await send_problem(
            send,
            503,
            "draining",
            "Service Unavailable",
            "This server is draining for a restart; retry, another replica will answer.",
            headers=[self._retry_header, (b"connection", b"close")],
        )

    async def _ready(self, scope: Scope, send: Send) -> None:
        # Readiness is for anyone (a load balancer's probe); what runs, for operators only.
        operator = self._may_drain(scope)
        if self.draining:
            detail = "Draining."
            if operator:
                detail = f"Draining; {self.in_flight} request(s) in flight."
            await send_problem(
                send, 503, "draining", "Not Ready", detail, headers=[self._retry_header]
            )
            return
        ready: dict[str, object] = {"status": "ready"}
        if operator:
            ready["in_flight"] = self.in_flight
        await send_json(send, 200, _encode(ready))

    async def _drain_endpoint(self, scope: Scope, send: Send) -> None:
        if scope["method"] != "POST":
            await send_problem(
                send,
                405,
                "method-not-allowed",
                "Method Not Allowed",
                "Start a drain with POST.",
                headers=[(b"allow", b"POST")],
            )
            return
        if not self._may_drain(scope):
            await send_problem(
                send,
                403,
                "drain-forbidden",
                "Forbidden",
                "A drain is started with Authorization: Bearer {drain_token}"
                + ("" if self._token is not None else "; this server has no drain_token set")
                + ".",
            )
            return
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        deadline = self.deadline
        if "deadline" in query:
            try:
                deadline = float(query["deadline"])
            except ValueError:
                deadline = math.nan
            if not (0 < deadline <= 86_400):
                await send_problem(
                    send,
                    400,
                    "invalid-drain-deadline",
                    "Bad Drain Deadline",
                    "deadline must be a number of seconds above 0 and at most 86400.",
                )
                return
        wait = query.get("wait", "").lower() in ("1", "true", "yes")
        task = self.start_drain(deadline)
        if wait:
            await asyncio.shield(task)
        # A drain already under way keeps its deadline: say which applies, and how long is left.
        assert self._deadline is not None
        applies, end = self._deadline
        remaining = 0.0 if self.drained else max(0.0, end - asyncio.get_running_loop().time())
        body = _encode(
            {
                "status": "drained" if self.drained else "draining",
                "deadline": applies,
                "remaining": round(remaining, 3),
                "in_flight": self.in_flight,
            }
        )
        await send_json(send, 200 if self.drained else 202, body)

    def _may_drain(self, scope: Scope) -> bool:
        """An operator: the drain token, or loopback when trusted and not forwarded."""
        token = self._token
        forwarded = False
        for name, value in scope["headers"]:
            if name == b"authorization" and token is not None:
                if hmac.compare_digest(value, token):
                    return True
            elif name in _FORWARDED:
                forwarded = True
        if not self.trust_loopback or forwarded:
            return False
        client = scope.get("client")
        return client is not None and client[0] in _LOOPBACK

    # -- the drain ----------------------------------------------------------------------

    @property
    def detached(self) -> int:
        """How many detached generations run on here, their requests over."""
        return len(self._detached)

    def start_drain(
        self, deadline: float | None = None, *, cause: str | None = "draining"
    ) -> asyncio.Task[None]:
        """Start draining (once; later calls return the same drain) and return its task.
        ``cause`` begins the one line that says what it waits for, and for how long (None:
        the caller says it; then the drain's end is not logged either)."""
        task = self._drain_task
        if task is None:
            self.draining = True
            seconds = self.deadline if deadline is None else deadline
            loop = asyncio.get_running_loop()
            self._deadline = (seconds, loop.time() + seconds)
            task = self._drain_task = loop.create_task(self._run(seconds, cause))
        return task

    async def drain(self, deadline: float | None = None) -> None:
        """Drain: refuse new requests, let the work in flight end until ``deadline``
        seconds from now (default: the middleware's), interrupt what is left; returns when
        it is over. Requests keep being refused until the process exits."""
        await asyncio.shield(self.start_drain(deadline))

    async def _run(self, deadline: float, cause: str | None) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + deadline
        if cause is not None:
            logger.warning(
                "%s: waiting up to %gs for %d request(s) in flight and %d detached "
                "generation(s) to finish, then interrupting what is left; new requests get 503",
                cause,
                deadline,
                self.in_flight,
                len(self._detached),
            )
        lifecycle = self.lifecycle
        if lifecycle is not None:
            await lifecycle.drain(end, self.retry_after)
        elif self.in_flight:
            logger.warning("the server runs without lifespan: a drain can only wait")
        # Requests that no part of the stack tracks (a plain JSON route, say).
        self._idle = asyncio.Event()
        if self.in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(end - loop.time(), 0) + _GRACE)
        self.drained = True
        if cause is not None:
            logger.warning(
                "drained: %d request(s) still in flight, %d detached generation(s) still running",
                self.in_flight,
                len(self._detached),
            )

    def suggest_drain_deadline(self, quantile: float = 0.99, headroom: float = 1.25) -> float:
        """A drain deadline from the recent requests: their ``quantile`` duration times
        ``headroom``, rounded up to whole seconds (at least 1); the configured deadline
        while no request has ended yet."""
        if not 0 < quantile <= 1:
            raise ValueError("quantile must be in (0, 1]")
        durations = sorted(self.durations)
        if not durations:
            return self.deadline
        index = min(len(durations) - 1, math.ceil(quantile * len(durations)) - 1)
        return float(max(1, math.ceil(durations[index] * headroom)))

    # -- lifecycle and signals ------------------------------------------------------------

    def _startup(self) -> None:
        self._admit()
        if self.trust_loopback and self.drain_path is not None:
            logger.warning(
                "DrainMiddleware trusts loopback: any process on this host, and any same-host "
                "proxy or port forward, may drain this server at %s; set drain_token instead",
                self.drain_path,
            )
        if self.signals:
            self._take_sigterm()

    def _admit(self) -> None:
        self.draining = self.drained = False
        self._drain_task = None
        self._deadline = None

    def _stop_admitting(self) -> None:
        self.draining = True

    def _closed(self) -> None:
        """The lifespan ended: SIGTERM goes back to the server, and requests that still come
        (one app used with and without a lifespan, as tests do) are served as before it."""
        self._restore_signals()
        self._admit()

    def _take_sigterm(self) -> None:
        """Take SIGTERM from the server: drain first, then hand it back."""
        if threading.current_thread() is not threading.main_thread():
            logger.info("DrainMiddleware: not in the main thread, SIGTERM is left to the server")
            return
        self._restore_signals()
        self._sigterm = SigtermHold.take(asyncio.get_running_loop(), self._on_sigterm)

    def _on_sigterm(self, hold: SigtermHold) -> None:
        if self._drain_task is not None:
            # A second SIGTERM, or one after a drain: the server shuts down now.
            logger.warning("SIGTERM while draining: the server shuts down now")
            hold.hand_back()
            return
        drain = self.start_drain(cause="SIGTERM: draining before the server shuts down")
        drain.add_done_callback(lambda _: hold.hand_back())

    def _restore_signals(self) -> None:
        hold, self._sigterm = self._sigterm, None
        if hold is not None:
            try:
                hold.release()
            except Exception:  # the loop may be closing; nothing to hand back then
                logger.debug("restoring the server's SIGTERM handler failed", exc_info=True)


class SigtermHold:
    """SIGTERM kept from the process's own handlers while a drain runs, then raised again
    for them, through public APIs only.

    A handler set with ``signal.signal`` (uvicorn's) is put aside. A handler set with
    ``loop.add_signal_handler`` (hypercorn's, any asyncio program's) is run by its loop when
    the signal's number arrives on the signal wakeup fd: the hold points that fd at a socket
    of its own, keeps SIGTERM's number and passes every other number on. Handing back puts
    both back and raises SIGTERM, which reaches whichever handlers were there, unknown to us.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_sigterm: Callable[[SigtermHold], None],
        previous: Callable[[int, FrameType | None], Any],
    ) -> None:
        self._loop = loop
        self._on_sigterm = on_sigterm
        self._previous = previous
        self._handler = self._on_signal  # one bound method, to know it again in getsignal()
        # The loop's wakeup fd while ours stands in for it, and our socket pair.
        self._diverted = -1
        self._sockets: tuple[socket.socket, socket.socket] | None = None
        self.held = False

    @classmethod
    def take(
        cls, loop: asyncio.AbstractEventLoop, on_sigterm: Callable[[SigtermHold], None]
    ) -> SigtermHold | None:
        """Hold SIGTERM, or None when it has no handler of the process's to hand back to, or
        when its loop runs handlers in a way the hold cannot stand in for."""
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous):
            logger.info("DrainMiddleware: SIGTERM has no handler of the server's; not taken")
            return None
        hold = cls(loop, on_sigterm, previous)
        hold.held = True
        # The handler first: a SIGTERM between the two steps then starts a drain, never none.
        signal.signal(signal.SIGTERM, hold._handler)
        if not hold._divert_wakeup_fd():
            hold.release()
            logger.info(
                "DrainMiddleware: the event loop cannot watch a socket of ours, so the "
                "signal handlers it runs cannot be held; SIGTERM is left to the server"
            )
            return None
        return hold

    def _divert_wakeup_fd(self) -> bool:
        """Point the wakeup fd at a socket of ours; False if a loop reads it and we cannot."""
        reader, writer = socket.socketpair()
        reader.setblocking(False)
        writer.setblocking(False)
        diverted = signal.set_wakeup_fd(writer.fileno())
        if diverted == -1:  # no wakeup fd: no loop runs signal handlers through one
            signal.set_wakeup_fd(-1)
            reader.close()
            writer.close()
            return True
        try:
            self._loop.add_reader(reader.fileno(), self._pass_on)
        except NotImplementedError:
            signal.set_wakeup_fd(diverted)
            reader.close()
            writer.close()
            return False
        self._diverted = diverted
        self._sockets = (reader, writer)
        return True

    def _pass_on(self) -> None:
        """Pass the loop every signal number but SIGTERM's, as the signal would have."""
        assert self._sockets is not None
        others = bytearray()
        with contextlib.suppress(BlockingIOError):
            while data := self._sockets[0].recv(4096):
                others += bytes(number for number in data if number != signal.SIGTERM)
        if others:
            with contextlib.suppress(OSError):  # full: the signal itself would be dropped too
                os.write(self._diverted, others)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._taken)
        except RuntimeError:  # the loop is closed: nothing to drain
            self.hand_back()

    def _taken(self) -> None:
        if self.held:
            self._on_sigterm(self)
        else:  # released while this SIGTERM waited for the loop: it goes where it would have
            signal.raise_signal(signal.SIGTERM)

    def hand_back(self) -> None:
        """Put back what was taken and raise SIGTERM for the handlers that had it (once)."""
        if self.held:
            self.release()
            signal.raise_signal(signal.SIGTERM)

    def release(self) -> None:
        """Put back what was taken, leaving any handler set since in place."""
        if not self.held:
            return
        self.held = False
        if signal.getsignal(signal.SIGTERM) == self._handler:
            signal.signal(signal.SIGTERM, self._previous)
        sockets, self._sockets = self._sockets, None
        if sockets is None:
            return
        reader, writer = sockets
        try:
            current = signal.set_wakeup_fd(self._diverted)
        except (ValueError, OSError):  # the loop closed its end: nobody to wake
            current = signal.set_wakeup_fd(-1)
        if current != writer.fileno():  # the loop pointed it elsewhere since: that stands
            signal.set_wakeup_fd(current)
        self._loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
