"""DisconnectMiddleware: run the app decoupled from the client; cancel or detach on disconnect.

The flow of one request (see docs/architecture.md)::

    receive ──> RequestReader ──> the app's receive    (one reader of the client)
    app ──> app_send ──> generation log ──> ClientWriter ──> server send
                          └──> backend (durable copy), resume readers, metering

The app's ``send`` appends to the log and returns; it never waits on the client. How the
app ended maps to the generation's status, the exchange's ``Ending`` and the counters
in one place, ``Outcome.app_ended`` (``_outcome.py``), whichever task ran the app.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import re
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from ._aio import join, shielded, wait_bounded
from ._backends import MemoryBackend
from ._contract import (
    SCOPE_KEY,
    Ending,
    RequestState,
    TakeoverStore,
    current_state,
    default_principal,
    new_generation_id,
)
from ._frames import DRAINED, HANDED_OVER, TAKEN_OVER
from ._lifecycle import lifecycle_of
from ._outbound import Outbound, ResponseOptions
from ._outcome import AppEnd, Counters, Outcome
from ._policy import Policy, PolicySource, check_source, resolve_policy, route_policy
from ._problem import send_problem
from ._reader import RequestReader
from ._records import Status
from ._resume import (
    ResumeEndpoints,
    redact_tokens_in_access_logs,
)
from ._states import CLIENT_MOVES, CLIENT_OF_REASON, MOVES, Client, Delivery, Stage, moved
from ._supervisor import Supervisor
from ._takeover import Takeover, TakeoverOptions, record_lost
from ._transport import SUPPORTED as _TRANSPORT_SUPPORTED
from ._transport import TransportMonitor, tune_listeners
from ._writer import ClientWriter, LagClock

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from starlette.types import ASGIApp, Receive, Scope, Send

    from ._contract import AttemptObserver, Backend, UsageSink
    from ._lifecycle import Lifecycle
    from ._records import Adopted

__all__ = ["DisconnectMiddleware"]

# Enum members read on the request's paths, bound once: on Python 3.11 a member's
# lookup goes through EnumType.__getattr__ (~60 ns, ~200 instructions); see
# docs/performance.md for what it costs per request and per chunk.
_APP_RETURNED = AppEnd.RETURNED
_CLIENT_CONNECTED = Client.CONNECTED
_DELIVERY_DONE = Delivery.DONE
_ENDING_DELIVERED = Ending.DELIVERED
_POLICY_CANCEL = Policy.CANCEL
_POLICY_DETACH = Policy.DETACH
_STAGE_CANCELLING = Stage.CANCELLING
_STAGE_DETACHED = Stage.DETACHED
_STAGE_ENDED = Stage.ENDED
_STAGE_RUNNING = Stage.RUNNING
_STAGE_SETTLING = Stage.SETTLING
_STATUS_COMPLETE = Status.COMPLETE


logger = logging.getLogger("asgi_disconnect")

_ROUTE_MEMO_SIZE = 4096
# How long a request cancelled by the server waits for its app to run its finally blocks.
_TEARDOWN_TIMEOUT = 5.0
# On a durable backend, how much of what its client has not received a generation keeps in
# memory once the store has it; the client writer reads older bytes back from the store.
READ_BACK_PAST = 16 << 10
# When to look again for the server's listening sockets after startup: uvicorn binds after
# the lifespan startup, granian replaces a placeholder, within a few milliseconds.
_LISTENER_SCANS = (0.01, 0.05, 0.25, 1.0, 3.0)


class DisconnectMiddleware:
    """Makes a client disconnect a deliberate decision per route: cancel or detach.

    The app runs in a task owned by the middleware's supervisor; its ``send`` appends to
    the request's generation log and returns at once, and a client writer drains the
    log to the server. A single reader owns ``receive``. When the client disconnects,
    or makes no progress for ``max_lag_seconds``, the route's policy applies (a client that
    reads but falls ``max_lag_bytes`` behind makes the app wait instead, on the memory
    backend; a durable backend gives the client its backlog from the store): ``cancel`` cancels
    the app and closes tracked upstream responses; ``detach`` lets it finish, its output
    readable under ``resume_prefix``.

    ``exclude_paths``: regular expressions of paths the middleware leaves alone (static
    files, health checks): no generation, no ``x-generation-id``, no policy.

    ``client_timeout``: a client whose TCP acknowledged nothing it was sent for that many
    seconds is disconnected (on Linux: the listening sockets' ``TCP_USER_TIMEOUT`` and the
    kernel's socket diagnostics, see docs/operations.md), and a streamed response's
    delivered bytes are what the client's TCP acknowledged. None turns both off.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        backend: Backend | None = None,
        policy: PolicySource = Policy.CANCEL,
        principal: Callable[[Scope], str | None] | None = None,
        resume_prefix: str | None = "/generations",
        exclude_paths: Sequence[str] = (),
        max_lag_bytes: int = 4 << 20,
        max_lag_seconds: float = 30.0,
        shutdown_timeout: float = 30.0,
        keep_alive: float | None = 15.0,
        resume_secret: bytes | None = None,
        resume_token_ttl: float = 300.0,
        client_timeout: float | None = 10.0,
        upstreams: Mapping[str, Any] | None = None,
        takeover_sinks: Sequence[UsageSink] = (),
    ) -> None:
        _check_options(
            backend=backend,
            policy=policy,
            exclude_paths=exclude_paths,
            client_timeout=client_timeout,
            keep_alive=keep_alive,
            max_lag_bytes=max_lag_bytes,
            max_lag_seconds=max_lag_seconds,
            shutdown_timeout=shutdown_timeout,
            resume_prefix=resume_prefix,
            resume_token_ttl=resume_token_ttl,
            upstreams=upstreams,
            takeover_sinks=takeover_sinks,
        )
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
        self.exclude = (
            re.compile("|".join(f"(?:{p})" for p in exclude_paths)) if exclude_paths else None
        )
        self.max_lag_bytes = max_lag_bytes
        # A durable store gives back what memory released: a lagging client's backlog is
        # read there, so the producer never waits on its client (Generation.reads_back).
        # Memory keeps a client's last READ_BACK_PAST bytes only: a client a few events
        # behind reads them from memory, and a stalled one costs about a flush window.
        self.reads_back = (
            min(max_lag_bytes, READ_BACK_PAST) if self.backend.flush_interval is not None else 0
        )
        self.max_lag_seconds = max_lag_seconds
        self.lag_clock = LagClock(max_lag_seconds)
        self.shutdown_timeout = shutdown_timeout
        self.keep_alive = keep_alive
        self.client_timeout = client_timeout
        self.transport = (
            TransportMonitor(client_timeout)
            if client_timeout is not None and _TRANSPORT_SUPPORTED
            else None
        )
        # The local ports whose listeners carry the client timeout; None: not looked yet.
        self._tuned_ports: set[int] | None = None if self.transport is not None else set()
        self._listeners_found = self.transport is None
        self._scans: list[asyncio.TimerHandle] = []  # the listener scans after startup
        self.counters = Counters()
        # What each request's response side needs of the middleware, read once.
        self.options = ResponseOptions(
            backend=backend,
            chooses_policy=callable(self.policy),
            max_lag_bytes=max_lag_bytes,
            keep_alive=keep_alive,
            reads_back=self.reads_back,
            transport=self.transport,
            lag_clock=self.lag_clock,
        )
        self.supervisor = Supervisor()
        self.lifecycle: Lifecycle | None = None
        self._resume = ResumeEndpoints(
            backend, self.principal, secret=resume_secret, token_ttl=resume_token_ttl
        )
        if resume_prefix is not None:
            redact_tokens_in_access_logs()
        self._warned_no_lifespan = False
        # (method, path) -> whether that route can only cancel, learned after routing.
        self._cancel_only: dict[tuple[str, str], bool] = {}
        # Generation id -> its exchange, while it runs here: what a Stop reaches.
        self._running: dict[str, _Exchange] = {}
        backend.on_cancel = self._stop
        # Takeover: detached generations of a replica that died, continued here with the
        # upstream clients registered by name (open_stream's ``upstream=``).
        self._takeovers: dict[str, Takeover] = {}
        self._takeover_options = TakeoverOptions(
            upstreams or {}, takeover_sinks, observer=self._attempt_observer
        )
        # The records of generations whose process died before it wrote them.
        self._recording: set[asyncio.Task[None]] = set()
        if isinstance(backend, TakeoverStore):
            backend.on_fenced = self._fenced
            backend.on_swept = self._swept
            if upstreams:
                backend.upstreams = tuple(upstreams)
                backend.on_takeover = self._take_over
        elif upstreams:
            logger.warning(
                "upstreams= is for a durable backend shared by replicas (SQLite, PostgreSQL): "
                "on %s no generation outlives its process, so none is taken over",
                type(backend).__name__,
            )
        # Set while a drain waits for running work to end (see _until_quiet).
        self._quieter: asyncio.Future[None] | None = None
        self.supervisor.on_task_done = self._one_ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope_type = scope["type"]
        if scope_type == "http":
            path = scope["path"]
            prefix = self.resume_prefix
            if prefix is not None and path.startswith(prefix):
                rest = path[len(prefix) :]
                if self._resume.handles(rest):
                    await self._resume(scope, receive, send, rest)
                    return
            exclude = self.exclude
            if exclude is not None and exclude.match(path):
                await self.app(scope, receive, send)
                return
            try:  # each request: one app may serve asyncio, then trio
                asyncio.get_running_loop()
            except RuntimeError:
                _not_asyncio()
            if not self._listeners_found:
                self._find_listener(scope)
            state = scope.get(SCOPE_KEY)
            if state is None:
                state = scope[SCOPE_KEY] = RequestState(
                    new_generation_id(), self.principal(scope) or ""
                )
            elif state.handled:
                raise RuntimeError(_TWICE)
            state.handled = True
            if self.supervisor.stopping:
                await send_problem(
                    send,
                    503,
                    "shutting-down",
                    "Service Unavailable",
                    "This server is shutting down; retry on another.",
                    headers=[(b"retry-after", b"1"), (b"connection", b"close")],
                )
                return
            exchange = _Exchange(self, scope, receive, send, state)
            if self._cancel_only.get((scope["method"], path), False):
                await exchange.run_inline()
            else:
                await exchange.run_supervised()
            transport = self.transport
            if state.disconnect_reason == "silent" and transport is not None:
                # Cut by its TCP's silence, which the server hears of from its kernel a
                # moment later: return once it has, not as if abandoning a live response.
                hears = functools.partial(exchange.reader.until_heard, transport.kernel_behind)
                if state.hears_outside:
                    state.server_hears = hears
                else:
                    await hears()
        elif scope_type == "lifespan":
            lifecycle, owner = lifecycle_of(scope)
            self.lifecycle = lifecycle
            lifecycle.register(
                "DisconnectMiddleware",
                unique=True,
                startup=self._startup,
                stop_admitting=self._stop_admitting,
                finish=self._finish_generations,
                close=self._close,
                drain=self._drain,
            )
            await lifecycle.run(owner, self.app, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _startup(self) -> None:
        _check_asyncio()
        if self.resume_prefix is not None:
            redact_tokens_in_access_logs()  # again: a server may configure logging late
        await self.backend.open()
        self.supervisor.start()
        if isinstance(self.backend, TakeoverStore):
            await self._check_upstreams(self.backend)
        if self.client_timeout is not None and not _TRANSPORT_SUPPORTED:
            logger.warning(
                "silent clients (no FIN, no RST) are detected only by the lag rules on %s: "
                "client_timeout needs Linux",
                sys.platform,
            )
        if self.transport is not None:
            await self._tune_listeners()
            loop = asyncio.get_running_loop()
            self._scans = [
                loop.call_later(delay, self._tune_listeners) for delay in _LISTENER_SCANS
            ]

    async def _check_upstreams(self, store: TakeoverStore) -> None:
        """Say at startup which upstreams running detached generations would be continued
        with that this replica has no client for."""
        try:
            missing = await store.unregistered_upstreams()
        except Exception as exc:
            logger.debug("the upstreams of running generations could not be read: %s", exc)
            return
        if missing:
            logger.warning(
                "running detached generations are continued with upstream(s) %s, which this "
                "replica does not register (upstreams=): if their owners die, only a replica "
                "that does can finish them, else they stay interrupted",
                ", ".join(repr(name) for name in missing),
            )

    def _tune_listeners(self) -> asyncio.Future[set[int]]:
        """Give the process's listening sockets the client timeout (see _transport), in a
        worker thread: the scan reads /proc and a socket option per descriptor, which is
        no work for the event loop (and a blocking-call detector says so)."""
        assert self.client_timeout is not None
        loop = asyncio.get_running_loop()
        scan = loop.run_in_executor(None, tune_listeners, self.client_timeout)
        scan.add_done_callback(self._tuned)
        return scan

    def _tuned(self, scan: asyncio.Future[set[int]]) -> None:
        if scan.cancelled():
            return
        if scan.exception() is not None:
            logger.debug("the listening sockets could not be scanned", exc_info=scan.exception())
            return
        if self._tuned_ports is None:
            self._tuned_ports = set()
        self._tuned_ports |= scan.result()

    def _find_listener(self, scope: Scope) -> None:
        """At a request: once its listener carries the client timeout, stop looking. A
        connection accepted before (the first one, under uvicorn) is judged by the
        transport monitor alone."""
        server = scope.get("server")
        if not server:
            self._listeners_found = True  # a Unix socket: nothing to tune
            return
        try:
            port = int(server[1])  # granian's scope carries it as text
        except (TypeError, ValueError):
            self._listeners_found = True
            return
        self._listeners_found = True
        ports = self._tuned_ports
        if ports is None or port not in ports:
            # Scanned again, off the loop; a port still unknown then is a proxy's, or a
            # listener of another process.
            self._tune_listeners().add_done_callback(lambda _: self._unserved(port))

    def _unserved(self, port: int) -> None:
        ports = self._tuned_ports
        if ports is not None and port not in ports:
            logger.info(
                "no listening socket of this process serves port %s: connections are "
                "judged by the transport monitor only",
                port,
            )

    async def _close(self) -> None:
        for scan in self._scans:
            scan.cancel()
        self._scans = []
        self.lag_clock.close()
        if self.transport is not None:
            self.transport.close()
        if self._recording:
            await asyncio.wait(self._recording, timeout=_TEARDOWN_TIMEOUT)
        await self.backend.aclose()
        # Requests after the lifespan ended are served as before it began (one app used with
        # and without a lifespan, as tests do): their work ends with them.
        self.supervisor.admit()

    def _stop_taking_over(self) -> None:
        if isinstance(self.backend, TakeoverStore):
            self.backend.taking_over = False  # a process that drains takes nothing over

    def _stop_admitting(self) -> None:
        self.supervisor.stop_admitting()
        self._stop_taking_over()
        if self.transport is not None:
            self.transport.settle_all()

    async def _finish_generations(self) -> None:
        # Before the app's own shutdown, so its resources (upstream clients) are still open.
        if isinstance(self.backend, TakeoverStore):
            # Detached work another replica can finish is handed over at the deadline,
            # not interrupted.
            running = self.supervisor.tasks()
            if running:
                await asyncio.wait(running, timeout=self.shutdown_timeout)
            self.hand_over()
            # What is left is interrupted now, as without takeover; the handed-over work ends
            # at once too (cancelled), and its release is in the backend's last flush.
            await self.supervisor.drain(0.0)
            return
        await self.supervisor.drain(self.shutdown_timeout)

    async def _drain(self, deadline: float, retry_after: int) -> None:
        """A drain: let running work end until ``deadline`` (the loop's clock), then end
        what is left as interrupted, a stream its client still reads with an error frame
        that says to retry after ``retry_after`` seconds."""
        loop = asyncio.get_running_loop()
        # Also past the deadline, until the process exits: what it hands over stays handed.
        self._stop_taking_over()
        await self._until_quiet(deadline)
        handed = self.hand_over()
        if handed:
            logger.warning(
                "drain deadline reached: %d detached generation(s) handed over to another replica",
                handed,
            )
        interrupted = self.interrupt(retry_after)
        if interrupted:
            logger.warning(
                "drain deadline reached: %d running generation(s) interrupted", interrupted
            )
        await self._until_quiet(loop.time() + _TEARDOWN_TIMEOUT)

    @property
    def running(self) -> int:
        """How many generations run in this process now, detached ones included."""
        return max(len(self._running), len(self.supervisor))

    def interrupt(self, retry_after: int = 1) -> int:
        """End every generation running here now, as a drain's deadline does: each ends
        ``interrupted``, what it produced kept and resumable; a stream its client still reads
        gets an ``event: error`` frame saying to retry after ``retry_after`` seconds. Returns
        how many were running; a drain or a shutdown waiting on them then goes on at once."""
        tasks = self.supervisor.tasks()
        drained = [
            exchange for exchange in list(self._running.values()) if exchange.drain(retry_after)
        ]
        ended = {exchange.app_task for exchange in drained}
        tasks = [task for task in tasks if task not in ended and not task.done()]
        for task in tasks:
            task.cancel()  # detached work whose response never started
        return len(drained) + len(tasks)

    def hand_over(self) -> int:
        """Leave every detached generation running here that another replica can finish
        (its relay recorded a continuation) to the store, for a replica to take over; how
        many. On a backend that cannot, none."""
        if not isinstance(self.backend, TakeoverStore):
            return 0
        handed = [exchange for exchange in list(self._running.values()) if exchange.hand_over()]
        for takeover in list(self._takeovers.values()):
            if takeover.hand_over():
                handed.append(takeover)  # type: ignore[arg-type]
                self.counters.handed_over += 1
        return len(handed)

    def _take_over(self, adopted: Adopted) -> None:
        """The store chose this process to finish a generation whose owner is gone."""
        assert isinstance(self.backend, TakeoverStore)
        takeover = Takeover(
            adopted, self.backend, self._takeover_options, self.counters, self._takeover_ended
        )
        self._takeovers[adopted.id] = takeover
        self.counters.takeovers += 1
        takeover.task = self.supervisor.spawn(takeover.run())

    def _swept(self, ids: list[str]) -> None:
        """The store marked generations interrupted, their owner gone: their records."""
        assert isinstance(self.backend, TakeoverStore)
        sinks = self._takeover_options.sinks
        if sinks:
            task = asyncio.ensure_future(record_lost(self.backend, sinks, ids))
            self._recording.add(task)
            task.add_done_callback(self._recording.discard)

    def _attempt_observer(self) -> AttemptObserver | None:
        return None if self.lifecycle is None else self.lifecycle.attempts

    def _takeover_ended(self, takeover: Takeover) -> None:
        self._takeovers.pop(takeover.id, None)

    def _fenced(self, generation_id: str) -> None:
        """Another replica took over a generation running here: it stops here."""
        exchange = self._running.get(generation_id)
        if exchange is not None:
            exchange.fenced()
        takeover = self._takeovers.get(generation_id)
        if takeover is not None:
            self.counters.fenced += 1
            takeover.fenced()

    async def _until_quiet(self, until: float) -> None:
        """Until no exchange runs here and the supervisor holds no work, or the loop's clock
        reaches ``until``; woken by each one that ends, not by polling."""
        loop = asyncio.get_running_loop()
        while self._running or len(self.supervisor):
            remaining = until - loop.time()
            if remaining <= 0:
                return
            waiter = self._quieter = loop.create_future()
            try:
                await asyncio.wait((waiter,), timeout=remaining)
            finally:
                self._quieter = None

    def _one_ended(self) -> None:
        """An exchange or a supervised task ended: a drain waiting for quiet looks again."""
        waiter = self._quieter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def resume_token(self, generation_id: str, principal: str = "") -> str:
        """A signed token that reads ``generation_id`` of ``principal`` (``""``: an
        anonymous one) for ``resume_token_ttl`` seconds, for the app to hand to its client:
        the only way into an anonymous generation. ``POST {resume_prefix}/{id}/token`` makes
        the same for a generation's owner."""
        return self._resume.token(generation_id, principal)

    def _stop(self, generation_id: str) -> bool:
        """Stop a generation running here on its owner's request (``POST .../cancel``)."""
        exchange = self._running.get(generation_id)
        if exchange is not None:
            return exchange.stop()
        takeover = self._takeovers.get(generation_id)
        return takeover is not None and takeover.stop()

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
        ) is _POLICY_CANCEL

    def resolve(self, scope: Scope) -> Policy:
        """The route's policy for this request; one that cannot be resolved is cancel."""
        source = route_policy(scope)
        try:
            return resolve_policy(self.policy if source is None else source, scope)
        except Exception:
            self.counters.policy_errors += 1
            logger.error(
                "the disconnect policy of %s %s could not be resolved; cancelling instead",
                scope.get("method"),
                scope.get("path"),
                exc_info=True,
            )
            return _POLICY_CANCEL

    def declared(self, scope: Scope) -> Policy | None:
        """The route's policy when it is a constant (None for a callable, which is asked
        only when a client leaves): what the usage record says when nobody left."""
        source = route_policy(scope)
        if source is None:
            source = self.policy
        return source if isinstance(source, Policy) else None

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


_NO_LIFESPAN = (
    "interrupted with its request: the server runs without the lifespan protocol, so "
    "detached work cannot outlive the request that started it"
)
_TWICE = (
    "DisconnectMiddleware is installed twice on this app; each response would carry two "
    "generation ids. Add it once (install() adds it for you)."
)


def check_options(**options: Any) -> None:
    """Refuse options of ``DisconnectMiddleware`` that cannot work, now: ``install()`` calls
    this before the framework builds its middleware stack (at the first request)."""
    try:
        bound = inspect.signature(DisconnectMiddleware).bind(None, **options)
    except TypeError as exc:
        raise TypeError(f"DisconnectMiddleware: {exc}") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["app"]
    _check_options(**arguments)


def _sequence_of(name: str, value: object, what: str) -> None:
    # A bare string is a sequence too: "/healthz" would be seven patterns, "/" among them.
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} takes a sequence of {what}, not {value!r}: write [{value!r}]")


def _check_options(
    *,
    backend: Backend | None,
    policy: PolicySource,
    exclude_paths: Sequence[str],
    client_timeout: float | None,
    keep_alive: float | None,
    max_lag_bytes: int,
    max_lag_seconds: float,
    shutdown_timeout: float,
    resume_prefix: str | None,
    resume_token_ttl: float,
    upstreams: Mapping[str, Any] | None,
    takeover_sinks: Sequence[UsageSink],
    **unchecked: Any,
) -> None:
    """Refuse DisconnectMiddleware's options that cannot work, saying which and why."""
    if isinstance(backend, str):
        raise TypeError(
            f"backend takes a backend, not the URL {backend!r}: pass backend=connect({backend!r})"
            " (install() accepts the URL itself)"
        )
    if backend is not None and not callable(getattr(backend, "record_usage", None)):
        raise TypeError(
            f"backend must be a backend such as connect('sqlite:///app.db'), not {backend!r}"
        )
    check_source(policy)
    _sequence_of("exclude_paths", exclude_paths, "path patterns (regular expressions)")
    for pattern in exclude_paths:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ValueError(
                f"exclude_paths: {pattern!r} is not a regular expression ({exc})"
            ) from None
    if upstreams is not None and not isinstance(upstreams, Mapping):
        raise TypeError(
            f"upstreams takes a mapping of names to httpx clients, such as "
            f'{{"openai": client}}, not {upstreams!r}'
        )
    _sequence_of("takeover_sinks", takeover_sinks, "usage sinks")
    if client_timeout is not None and (isinstance(client_timeout, bool) or not client_timeout >= 1):
        raise ValueError("client_timeout must be at least 1 second, or None")
    if keep_alive is not None and not keep_alive > 0:
        raise ValueError("keep_alive must be a positive number of seconds, or None")
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
    if not resume_token_ttl > 0:
        raise ValueError("resume_token_ttl must be a positive number of seconds")


def _check_asyncio() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        _not_asyncio()


def _not_asyncio() -> NoReturn:
    import sniffio

    raise RuntimeError(
        "asgi_disconnect runs on asyncio only, and this server or test client runs "
        f"{sniffio.current_async_library()}; use anyio's asyncio backend"
    ) from None


async def _teardown(app_task: asyncio.Task[Any]) -> None:
    """Wait (up to the teardown timeout) for a cancelled app to run its finally blocks,
    though the request is cancelled: an anyio cancel scope around it cancels every await
    again until it returns."""
    with anyio.CancelScope(shield=True):
        await wait_bounded(app_task, _TEARDOWN_TIMEOUT)


def _has_body(scope: Scope) -> bool:
    """Whether the request says it has a body (a length above zero, or chunked)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip() not in (b"0", b"")
        if name == b"transfer-encoding":
            return True
    return False


class _Exchange:
    """One HTTP request: the receive reader, the app task and the client writer."""

    __slots__ = (
        "app_error",
        "app_run",
        "app_task",
        "client",
        "decider",
        "mw",
        "out",
        "outcome",
        "reader",
        "reason",
        "request_task",
        "scope",
        "stage",
        "state",
        "waiter",
    )

    def __init__(
        self,
        mw: DisconnectMiddleware,
        scope: Scope,
        receive: Receive,
        send: Send,
        state: RequestState,
    ) -> None:
        self.mw = mw
        self.scope = scope
        self.state = state
        reader = self.reader = RequestReader(receive, self)
        # The response, as the app sends it: its log, its writer, its delivery.
        self.out = Outbound(mw.options, self, scope, send, state, reader)
        self.request_task: asyncio.Task[Any] | None = None
        self.app_task: asyncio.Task[None] | None = None
        self.app_run: _AppRun | None = None  # the app in a task of its own (supervised)
        self.app_error: BaseException | None = None
        # The first reason to act on the client (see ``signal``), and who waits for it: the
        # request's task (supervised), or a task of the exchange's own (inline).
        self.reason: str | None = None
        self.waiter: asyncio.Future[str] | None = None
        self.decider: asyncio.Task[None] | None = None
        # How the app ended, and what that makes of its generation.
        self.outcome = Outcome(self.out, state, mw.counters)
        self.stage = _STAGE_RUNNING
        self.client = _CLIENT_CONNECTED

    def move(self, to: Stage) -> None:
        """Move the exchange on; a move ``MOVES`` does not allow raises, naming both."""
        if to not in MOVES[self.stage]:
            moved(MOVES, self.stage, to)  # raises, naming both
        self.stage = to

    def _finish(self) -> None:
        """The exchange is over: the app ended and nothing more is delivered."""
        state = self.state
        if (
            self.out.delivery is _DELIVERY_DONE
            and self.out.writer is None
            and self.outcome.app is _APP_RETURNED
            and not state.detached
        ):
            self._end(_ENDING_DELIVERED)  # a response sent in one piece
            return
        stage = self.stage
        if stage is _STAGE_SETTLING or stage is _STAGE_ENDED:
            return
        self.out.stop_keep_alive()
        generation = self.out.generation
        if state.detached and generation is not None and generation.status is _STATUS_COMPLETE:
            self.mw.counters.detach_completed += 1
        self._end(self.outcome.ending())
        writer = self.out.writer
        if writer is not None and writer.task.done():
            # The writer refers back to the exchange: unlink them, for reference counting.
            writer.unlink()

    def _end(self, ending: Ending) -> None:
        """Record how the exchange ended; a Stop no longer reaches it. A watched response
        ends once its client's TCP acknowledged what it was handed (or died, or closed)."""
        stage = self.stage
        if stage is _STAGE_SETTLING or stage is _STAGE_ENDED:
            return
        watched = self.out.watched
        if watched is not None and watched.settle(lambda: self._ended(ending)):
            self.move(_STAGE_SETTLING)
            return
        self._ended(ending)

    def _ended(self, ending: Ending) -> None:
        self.move(_STAGE_ENDED)
        mw = self.mw
        if mw._running.pop(self.state.generation_id, None) is not None:
            mw._one_ended()
        self.reader.unlink()
        self.out.unlink()
        self.app_run = None  # it refers back to the exchange: reference counting frees both
        state = self.state
        if state.policy is None and self.out.generation is not None:
            state.policy = mw.declared(self.scope)  # nobody left: the route's, for the record
        state.finish(ending)

    # -- inline: a route that can only cancel runs in the request's own task -----------

    async def run_inline(self) -> None:
        state = self.state
        current_state.set(state)
        send = state.app_send = self.out.app_send
        self.request_task = asyncio.current_task()
        # The client is watched from the app's first turn of the event loop on: an app that
        # never waits needs no watcher.
        watch = asyncio.get_running_loop().call_soon(self.reader.start_watch)
        # Whether the app raised; not the exception, which this frame would keep in a
        # reference cycle with its own traceback.
        failed = False
        try:
            try:
                await self.mw.app(self.scope, self.reader.take, send)
            finally:
                watch.cancel()
        except asyncio.CancelledError as exc:
            failed = True
            ours = self._cancelled_by_us()  # before app_ended, which reads whose it was
            self.outcome.app_ended(exc)
            if not ours:
                raise
        except BaseException as exc:
            failed = True
            self.outcome.app_ended(exc)
            if not await self.outcome.answer_failure(exc):
                raise
        else:
            self.outcome.app_ended(None)
        finally:
            writer = self.out.writer
            await self._end_inline(writer)
        refused = writer.error if writer is not None else None
        if refused is not None and (not failed or self.outcome.cancelled_by_policy):
            raise refused

    def _cancelled_by_us(self) -> bool:
        """Whether the cancellation that reached the app was our policy's alone (then the
        request returns); one from outside goes on."""
        task = asyncio.current_task()
        assert task is not None
        if not self.outcome.cancelled_by_policy or task.uncancel() > 0:
            self.outcome.cancelled_by_policy = False
            return False
        return True

    async def _end_inline(self, writer: ClientWriter | None) -> None:
        """The inline app is over: stop watching, and end the exchange once the writer
        handed over what it still holds and the policy's decision (if one was taken) is
        carried out."""
        try:
            if writer is not None:
                await self._join_writer()
            decider = self.decider
            if decider is not None:
                await join(decider)
        finally:
            if not self.state.detached:
                # Cancelled, not waited for: a cancel scope around the request may be
                # cancelling every await of it now, and the exchange must end regardless.
                self.reader.halt()
            self._finish()

    # -- supervised: the app runs in the supervisor's task, the request task watches ---

    async def run_supervised(self) -> None:
        mw = self.mw
        reader = self.reader
        self.request_task = asyncio.current_task()
        if _has_body(self.scope):
            reader.hold_body()
        self.app_run = _AppRun(self)
        app_task = self.app_task = mw.supervisor.spawn(self.app_run.run())
        # A drain reaches it before its response starts too (then it answers 503).
        mw._running[self.state.generation_id] = self
        app_task.add_done_callback(self.part_done)
        reader.start_watch()
        try:
            reason = self.reason
            if reason is None:
                waiter = self.waiter = asyncio.get_running_loop().create_future()
                reason = await waiter
        except asyncio.CancelledError:
            # The server cancelled the request (shutdown, a disconnect under hypercorn, an
            # outer timeout): for this response the client is gone.
            reader.halt()
            await self._request_cancelled()
            error = self.app_error
            if error is not None and not isinstance(error, asyncio.CancelledError):
                # The app raised while it was being cancelled (a cleanup that fails): the
                # server hears of that error, as it would bare, not of the cancellation.
                self.app_error = None
                raise error  # noqa: B904 (its own context, as bare: the cancellation)
            raise
        finally:
            self.waiter = None
            mw.learn_route(self.scope)
        reader.halt()  # not waited for, as inline
        if reason == "complete":
            await self._join_writer()
            await join(app_task)
        elif reason != "done":
            await self.client_lost(reason)
            if not app_task.done():
                return
        self._finish()
        drained = self.outcome.drained
        if drained is not None and self.out.generation is None and self.client is _CLIENT_CONNECTED:
            # A drain's deadline came before the app started its response: retry elsewhere.
            await send_problem(
                self.out.send,
                503,
                "draining",
                "Service Unavailable",
                "This server is draining for a restart; retry, another replica will answer.",
                headers=[(b"retry-after", b"%d" % drained), (b"connection", b"close")],
            )
            return
        error = self.app_error or (self.out.writer.error if self.out.writer is not None else None)
        if error is not None and not self.state.detached:
            self.app_error = None
            raise error

    async def _request_cancelled(self) -> None:
        app_task = self.app_task
        assert app_task is not None
        # Cancelled by an anyio cancel scope around the request (a test client's, a
        # framework's), not once by the server.
        by_scope = anyio.current_effective_deadline() == -math.inf
        self.client_left("client", heard=False)
        if app_task.done():
            return
        stage = self.stage
        if stage is _STAGE_DETACHED:
            if not self.mw.supervisor.started:
                # Without the lifespan protocol the work ends with its request.
                self.move(_STAGE_CANCELLING)
                app_task.cancel()
                await _teardown(app_task)
            return
        if stage is _STAGE_RUNNING:
            policy = self.mw.resolve(self.scope) if self.outcome.app is None else _POLICY_CANCEL
            if (
                policy is _POLICY_DETACH
                and self.mw.owns_detached()
                and not self.mw.supervisor.stopping
            ):
                self._detach(policy)
                return
            self.move(_STAGE_CANCELLING)
        # Not detached: stop the app and let its finally blocks run before we return.
        if by_scope and self.app_run is not None:
            # As bare, the app's awaits are cancelled until it returns, but for the ones
            # under a shield of its own (a dependency's cleanup, say).
            self.app_run.scope.cancel()
        else:
            app_task.cancel()  # once, as the server cancelled the request
        await _teardown(app_task)

    def part_done(self, _: asyncio.Task[Any]) -> None:
        app_task = self.app_task
        writer = self.out.writer
        if app_task is not None and app_task.done() and (writer is None or writer.task.done()):
            self.signal("complete" if self.handed() else "done")
            self._finish()

    def handed(self) -> bool:
        """The whole response went to the server."""
        return self.out.handed()

    def client_left(self, reason: str, *, heard: bool = True) -> None:
        """The one place where the client's state moves: it left (``client``), went silent,
        lags (``lag``), or the server refused a send (``error``); reported by the watch, the
        writer, the transport watch, the lag clock or the server's ``send``. What comes after
        the first report changes nothing. Nothing more is sent to it, and the request's
        state says it disconnected (``heard``; not when the server cancelled the request)."""
        if self.client is not _CLIENT_CONNECTED:
            return
        self.client = moved(CLIENT_MOVES, self.client, CLIENT_OF_REASON[reason])
        self.out.client_left(reason)
        if heard and reason != "error":
            state = self.state
            state.disconnect_reason = reason
            state.disconnected.set()
            state.note("client_disconnect")
            self.mw.counters.disconnects += 1
        self.signal(reason)

    def disconnected(self) -> None:
        """The watch read ``http.disconnect``: the normal end once the response was handed
        over, else a client that left."""
        if self.handed():
            self.signal("complete")
        else:
            self.client_left("client")

    def signal(self, reason: str) -> None:
        """Why the exchange must act now, the first of: the client disconnected
        (``client``; ``complete`` once its response was handed over), went silent
        (``silent``), lags (``lag``), the server refused a send (``error``), or the app and
        the writer are done (``done``, ``complete``). Supervised, the request's task waits
        for it; inline (the app runs in the request's task), a task of the exchange's own
        applies the policy to a client that left."""
        if self.reason is not None:
            return
        self.reason = reason
        if self.app_task is not None:
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(reason)
        elif reason != "complete" and reason != "done" and self.outcome.app is None:
            self.decider = asyncio.get_running_loop().create_task(self.client_lost(reason))

    def running_as(self, generation_id: str) -> None:
        self.mw._running[generation_id] = self

    def declared_policy(self) -> Policy | None:
        return self.mw.declared(self.scope)

    def hears_disconnect(self) -> bool:
        """The app's next ``receive`` answers ``http.disconnect``: its response went whole,
        or its client left and it did not detach."""
        return self.handed() or (self.client is not _CLIENT_CONNECTED and not self.state.detached)

    async def _join_writer(self) -> None:
        """Wait for the writer to hand over the rest, within the lag deadline."""
        writer = self.out.writer
        if writer is not None and not await writer.join(self.mw.max_lag_seconds):
            logger.warning(
                "the server's send for generation %s did not return after cancellation",
                self.state.generation_id,
            )

    async def client_lost(self, reason: str) -> None:
        """The client left (``client``, ``silent``), lags, or the server refused a send
        (``error``): the route's policy applies, once."""
        mw = self.mw
        state = self.state
        runner = self.app_task or self.request_task
        assert runner is not None
        if (
            runner.done()
            or self.outcome.app is not None
            or self.handed()
            or self.stage is not _STAGE_RUNNING
        ):
            return  # over, or detached or cancelled already
        # A server that refused a send broke the response: the work stops as under cancel.
        policy = _POLICY_CANCEL if reason == "error" else mw.resolve(self.scope)
        if policy is _POLICY_DETACH:
            self._detach(policy)
            if runner is not self.app_task:
                # Predicted cancel-only, yet it detached: it stays tied to this request, and
                # its path is learned again (a route that detaches runs supervised).
                mw.learn_route(self.scope)
            elif not mw.owns_detached():
                # Without the lifespan protocol nothing but this request owns the work.
                self.outcome.interrupt_reason = _NO_LIFESPAN
                await join(runner)
            return
        if reason != "error":  # a refused send: the route's policy stays what it is
            state.policy = policy
            generation = self.out.generation
            if generation is not None:
                generation.policy = policy.value
            mw.counters.cancelled += 1
        state.note("cancelled")
        self.move(_STAGE_CANCELLING)
        self.outcome.cancelled_by_policy = True
        self._cancel(runner)
        if state.upstreams:
            await shielded(state.close_upstreams())
        if runner is self.app_task:
            await wait_bounded(runner, _TEARDOWN_TIMEOUT)

    def _cancel(self, runner: asyncio.Task[Any]) -> None:
        """Cancel the app's task, waking it if it waits for the request's body."""
        runner.cancel()
        self.reader.release()

    def stop(self) -> bool:
        """Stop the work on its owner's request: as a disconnect under the cancel policy,
        whether the client is still reading or the work detached. True if it was running."""
        runner = self._cancellable()
        if runner is None:
            return False
        self.move(_STAGE_CANCELLING)
        outcome = self.outcome
        outcome.stopped = outcome.cancelled_by_policy = True
        state = self.state
        # Cancelled, but the route's policy stays what it is: ``stopped_by`` says why.
        if state.policy is None:
            state.policy = self.mw.declared(self.scope)
        state.stopped_by = "owner"
        generation = self.out.generation
        if generation is not None and state.policy is not None:
            generation.policy = state.policy.value
        self.mw.counters.stopped += 1
        self._cancel_now(runner, "stopped")
        return True

    def drain(self, retry_after: int) -> bool:
        """End the work at a drain's deadline, as interrupted; True if it was running."""
        runner = self._cancellable()
        if runner is None:
            return False
        self.move(_STAGE_CANCELLING)
        self.outcome.drained = retry_after
        self.outcome.interrupt_reason = DRAINED
        self.state.stopped_by = "drain"
        self.mw.counters.drained += 1
        self._cancel_now(runner, "drained")
        return True

    def hand_over(self) -> bool:
        """Leave detached work to another replica (a drain or shutdown whose deadline came):
        it stops here without an error frame and without cancelling at the provider, and its
        store row loses its owner, for a replica to take over. True if it was handed over."""
        generation = self.out.generation
        runner = self._cancellable()
        if (
            runner is None
            or self.stage is not _STAGE_DETACHED
            or generation is None
            or generation.continuation is None
        ):
            return False
        self.move(_STAGE_CANCELLING)
        generation.handed_over = True
        self.outcome.interrupt_reason = HANDED_OVER
        self.state.stopped_by = "handover"
        self.state.note("handed_over")
        self.mw.counters.handed_over += 1
        self._cancel(runner)
        return True

    def fenced(self) -> None:
        """Another replica took the generation over (this one was partitioned or frozen):
        stop the work here; nothing more of it is written from this process."""
        runner = self._cancellable()
        if runner is None:
            return
        self.move(_STAGE_CANCELLING)
        self.outcome.interrupt_reason = TAKEN_OVER
        self.state.note("fenced")
        self.mw.counters.fenced += 1
        self._cancel(runner)

    def _cancellable(self) -> asyncio.Task[Any] | None:
        """The task that runs the app, if a Stop or a drain can still cancel it."""
        runner = self.app_task or self.request_task
        stage = self.stage
        if (
            (stage is not _STAGE_RUNNING and stage is not _STAGE_DETACHED)
            or self.outcome.app is not None
            or runner is None
            or runner.done()
        ):
            return None
        return runner

    def _cancel_now(self, runner: asyncio.Task[Any], event: str) -> None:
        """Cancel the app for a Stop or a drain; its upstreams close meanwhile."""
        state = self.state
        state.note(event)
        self._cancel(runner)
        if state.upstreams:
            self.mw.supervisor.spawn(state.close_upstreams())

    def _detach(self, policy: Policy) -> None:
        self.move(_STAGE_DETACHED)
        state = self.state
        state.policy = policy
        state.detached = True
        state.note("detached")
        self.mw.counters.detached += 1
        generation = self.out.generation
        if generation is not None:
            generation.policy = policy.value
            generation.detached = True


class _AppRun:
    """The app in a task of its own (supervised), inside a cancel scope of its own: a
    cancellation of the request by an anyio cancel scope reaches the app through it, as it
    would reach the app bare (the app's shields hold); every other cancellation is one
    ``Task.cancel()``, as a server's. How the app ended goes to the exchange's Outcome."""

    __slots__ = ("exchange", "scope")

    def __init__(self, exchange: _Exchange) -> None:
        self.exchange = exchange
        self.scope = anyio.CancelScope()

    async def run(self) -> None:
        exchange = self.exchange
        state, outcome = exchange.state, exchange.outcome
        current_state.set(state)
        send = state.app_send = exchange.out.app_send
        try:
            with self.scope:
                await exchange.mw.app(exchange.scope, exchange.reader.take, send)
        except asyncio.CancelledError as exc:
            outcome.app_ended(exc)
            task = asyncio.current_task()
            if task is not None and not task.cancelling() and not state.detached:
                # Nobody cancelled it: the app raised it itself. The server hears of it in
                # the request's task, as without this middleware.
                exchange.app_error = exc
                return
            raise
        except BaseException as exc:
            outcome.app_ended(exc)
            if await outcome.answer_failure(exc):
                return
            if state.detached:
                logger.error("detached generation %s failed", state.generation_id, exc_info=exc)
            else:
                exchange.app_error = exc
        else:
            if self.scope.cancelled_caught:
                # Its request's cancel scope was cancelled: it ends cancelled, as bare.
                cancelled = asyncio.CancelledError()
                outcome.app_ended(cancelled)
                raise cancelled
            outcome.app_ended(None)
