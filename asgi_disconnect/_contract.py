"""The contract between the middlewares: what one request shares, and what a store offers.

Every middleware of the package reads and hooks a request only through what is here:

- ``RequestState`` at ``scope["asgi_disconnect"]``: created once per request by the
  outermost of the package's middlewares (``request_state``), with the caller's
  principal resolved once; the generation id; the policy;
- ``Outcome``: how the exchange went (whether the work detached, produced and
  delivered bytes, how it ended), the one thing the other middlewares read of what
  DisconnectMiddleware writes: so far with ``RequestState.progress``, and once, frozen,
  through ``RequestState.on_end`` when the exchange is over (the app returned and
  nothing more will be delivered; for detached work, when it ended);
- the stores, split by what their callers need: ``GenerationLog`` (and its read half,
  ``GenerationReader``), ``ClaimStore``, ``UsageStore``, ``PinStore``;
  ``Backend`` is all of them, the one object that serves every store;
- what a live generation is to the others, never the log itself: ``GenerationOutput``
  (``RequestState.generation``, for the middlewares) and ``LiveLog`` (what a store
  reads of a generation logged in this process).

Who writes what in ``RequestState``:

=====================  ======================================================
field                  written by
=====================  ======================================================
``generation_id``      ``request_state``, once (read-only: the identity)
``principal``          ``request_state``, once (read-only: the identity)
``generation``         DisconnectMiddleware, at the response start
``log_store``          DisconnectMiddleware, with ``generation``: where its bytes are
                       read back (``follow``), those the log let go included
``policy``             DisconnectMiddleware, when the client left or its owner stopped
                       the work, else when a generation's exchange ends: the route's
                       policy (a callable one only if it was asked)
``detached``           DisconnectMiddleware, when the policy detached the work
``disconnected``       DisconnectMiddleware, when the client left or lagged
``disconnect_reason``  DisconnectMiddleware, then: ``client`` (the server said it left),
                       ``lag`` (no progress for ``max_lag_seconds``) or ``silent`` (its
                       TCP acknowledged nothing for ``client_timeout``)
``stopped_by``         DisconnectMiddleware, when something other than its client stopped
                       the work: ``owner`` (a Stop), ``drain`` (a drain's deadline) or
                       ``handover`` (left to another replica at a deadline)
``delivered_bytes``    DisconnectMiddleware's client writer: what it handed to the
                       server; when the exchange ends, what the client's TCP
                       acknowledged where the kernel tells (``delivery``)
``delivery``           DisconnectMiddleware, when the exchange ends: ``"acked"`` if
                       ``delivered_bytes`` is what the client's TCP acknowledged,
                       ``"sent"`` if it is what was handed to the server
``ending``             DisconnectMiddleware, once, when the exchange is over
``outcome``            ``RequestState.finish`` (DisconnectMiddleware), once, when the
                       exchange is over: the frozen ``Outcome`` of the fields above
                       that the other middlewares read (never the fields themselves)
``stream_ending``      MeteringMiddleware, at an event stream's start: a callable that
                       says how it ended by its protocol (``complete``, ``error``,
                       ``truncated``; None unknown), asked when the final body arrives
``upstreams``          the upstream helpers (``asgi_disconnect.upstream``)
``app_send``           DisconnectMiddleware, before the app runs: the send it gives
                       the app
``message_hook``       MeteringMiddleware, through ``RequestState.on_message`` when
                       the send it was given is ``app_send`` (nothing in between): it
                       sees each message the app sends, before DisconnectMiddleware
                       handles it, instead of a wrapped send
``marks``              an observer (TelemetryMiddleware) that wants the moments of the
                       exchange, at the start; then ``RequestState.note`` by the
                       middleware that sees each moment (DisconnectMiddleware: client
                       disconnect, cancelled, detached, stopped, interrupted;
                       MeteringMiddleware: first event)
``usage_pending``      MeteringMiddleware, at the request's start
                       (``RequestState.expect_usage``): a usage record (or its
                       absence) will be settled for this request
``usage``              MeteringMiddleware, through ``RequestState.settle_usage``;
                       an observer registers for it with ``RequestState.on_usage``
``request_model``      the upstream helpers, from the request they send (when marked)
``request_body``       the upstream helpers: the body of the first request they send
                       upstream, for metering's input estimate
``upstream_usage``     ``open_stream(..., ask_for_usage=True)``: the provider's usage
                       (a ``StreamReport``) that the client did not see
``provider_name``      the upstream helpers, from the provider's host (when marked)
``idempotency``        IdempotencyMiddleware: ``fresh``, ``replayed``, ``attached``,
                       ``in_flight``, ``mismatch``, ``invalid``, ``unavailable`` or
                       ``unclaimed`` (the store was down and the request ran unclaimed)
``response_status``    a middleware that answers the request itself (``answered``:
                       IdempotencyMiddleware's replays and refusals, DrainMiddleware's
                       refusals); a generation's response has its own
=====================  ======================================================

No middleware imports another; the stores import only this module and the records. This
module imports neither the log (``_log``) nor a policy module: it names them by what the
others read of them.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import logging
import os
import time
from base64 import urlsafe_b64encode
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, AsyncIterator, Iterator

    from starlette.types import Scope

    from ._records import Adopted, Claim, GenerationInfo, Status, StoredResponse, UsageRecord

__all__ = [
    "CREDENTIAL_HEADERS",
    "SCOPE_KEY",
    "Backend",
    "ClaimStore",
    "ClientReader",
    "Closable",
    "Ending",
    "GenerationLog",
    "GenerationOutput",
    "GenerationReader",
    "LiveLog",
    "LogStore",
    "Outcome",
    "PinStore",
    "Policy",
    "Principal",
    "RequestState",
    "Reservations",
    "StoreLifecycle",
    "StoreRoom",
    "UsageSink",
    "UsageStore",
    "answered",
    "current_state",
    "default_principal",
    "new_generation_id",
    "request_state",
]

logger = logging.getLogger("asgi_disconnect")

SCOPE_KEY = "asgi_disconnect"
# What @metered() sets on an endpoint (MeteringMiddleware's), read by DisconnectMiddleware too:
# a metered route's response is a generation.
METERED_ATTRIBUTE = "__asgi_disconnect_metered__"

# A response's content-type value -> what it is; an app has few, so they are remembered
# (a lower-cased copy and two prefix tests per response cost more than the lookup).
_CONTENT_KINDS: dict[bytes, str] = {}


def content_kind(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """What a response's content-type says it is: ``event-stream``, ``json``, ``other``,
    or ``""`` when it has none."""
    for name, value in headers:
        if name == b"content-type":  # ASGI header names are lower case
            kinds = _CONTENT_KINDS
            if type(value) is bytes and value in kinds:
                return kinds[value]
            lowered = bytes(value).lower()
            if lowered.startswith(b"text/event-stream"):
                kind = "event-stream"
            elif lowered.startswith(b"application/json"):
                kind = "json"
            else:
                kind = "other"
            if type(value) is bytes and len(kinds) < 64:
                kinds[value] = kind
            return kind
    return ""


Principal = Callable[["Scope"], "str | None"]
UsageSink = Callable[["UsageRecord"], Awaitable[None] | None]


# The headers that carry a caller's credentials to an LLM API: OpenAI and most gateways
# (Authorization), Anthropic (x-api-key), Azure OpenAI (api-key), Gemini (x-goog-api-key).
CREDENTIAL_HEADERS = (b"authorization", b"x-api-key", b"api-key", b"x-goog-api-key")
_CREDENTIALS = frozenset(CREDENTIAL_HEADERS)


def default_principal(scope: Scope) -> str:
    """A digest over every credential header the request carries (``CREDENTIAL_HEADERS``),
    names and values, in any order; ``""`` (anonymous) if it carries none.

    A request with one credential header has the digest of ``name:value`` alone, as before
    this digest covered them all, so its generations stay its own across an upgrade.
    """
    found = [name + b":" + value for name, value in scope["headers"] if name in _CREDENTIALS]
    if not found:
        return ""
    if len(found) > 1:
        found.sort()
    return hashlib.sha256(b"\n".join(found)).hexdigest()[:32]


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


new_generation_id = _IdSource()


class Ending(enum.StrEnum):
    """How an exchange ended, for the client that made the request."""

    DELIVERED = "delivered"
    """The whole response was handed to the server."""
    CUT = "cut"
    """The client left, or lagged too far, before the response was complete."""
    CANCELLED = "cancelled"
    """The client left and the policy cancelled the work."""
    FAILED = "failed"
    """The app raised, or returned before its response was complete."""
    INTERRUPTED = "interrupted"
    """The server or the process stopped the work (shutdown, a cancelled request)."""


class Policy(enum.StrEnum):
    """What happens to a request's work when its client goes away."""

    CANCEL = "cancel"
    """Cancel the work at once: upstream sockets close, the provider stops billing."""

    DETACH = "detach"
    """Keep generating, owned by the process; the output stays resumable by id."""


class Outcome(msgspec.Struct, frozen=True, gc=False):
    """How one exchange went, frozen: published once when it ends
    (``RequestState.outcome``, ``RequestState.on_end``), or read so far
    (``RequestState.progress``, whose ``ending`` is None)."""

    ending: Ending | None
    """How the exchange ended; None while it goes on."""
    policy: Policy | None
    """The route's policy: the one applied when the client left, else (a Stop, nobody
    left) the route's constant one; None for a callable policy never asked, or a request
    that is no generation. A Stop cancels whatever the policy (``stopped_by``)."""
    detached: bool
    """The policy detached the work when its client left."""
    delivered_bytes: int
    """What reached the client: what its TCP acknowledged where the kernel tells
    (``delivery == "acked"``), else what was handed to the server (``"sent"``)."""
    delivery: str
    produced_bytes: int
    """What the app produced of its generation's body (0 with no generation)."""
    disconnect_reason: str | None
    """``client`` (the server said it left), ``lag`` (no progress for
    ``max_lag_seconds``), ``silent`` (its TCP acknowledged nothing for
    ``client_timeout``); None if it stayed."""
    status: int | None
    """The response's status: its generation's, or the one a middleware answered with."""
    idempotency: str | None
    """How IdempotencyMiddleware handled the request's key (``fresh``, ``replayed``, ...;
    see ``RequestState.idempotency``); None without one."""
    stopped_by: str | None = None
    """What stopped the work, if not its client: ``owner`` (a Stop, ``POST .../cancel``;
    ``ending`` is ``cancelled``), ``drain`` (a drain's deadline; ``interrupted``) or
    ``handover`` (detached work left to another replica at a drain's or shutdown's
    deadline; ``interrupted`` here, finished there)."""


class Closable(Protocol):
    async def aclose(self) -> None: ...


class LogStore(Protocol):
    """Where a generation's bytes are read back, from any offset."""

    def follow(self, generation_id: str, offset: int) -> AsyncGenerator[bytes, None]:
        """Its bytes from ``offset``, then live until it ends; a reader that stops early
        closes it (``aclose``)."""


class ClientReader(Protocol):
    """The request whose client reads a generation as it is produced."""

    delivered_bytes: int


class GenerationOutput(Protocol):
    """The request's generation as the middlewares read it (``RequestState.generation``):
    its status and the bytes the app produced, while it runs and once it ended. Bytes
    before ``base`` were released from memory; the request's ``log_store`` has them."""

    @property
    def id(self) -> str: ...
    @property
    def status(self) -> Status: ...
    @property
    def status_code(self) -> int: ...
    @property
    def size(self) -> int:
        """The bytes logged, the exchange's own frames included."""

    @property
    def output_size(self) -> int:
        """The bytes the app produced."""

    @property
    def base(self) -> int: ...
    @property
    def frames_at(self) -> int | None:
        """Where the exchange's own frames began, if it added any."""

    # The request whose client reads the log as it is produced; None once it reads no more.
    reader: ClientReader | None
    # What another replica needs to finish it: (upstream name, encoded continuation).
    continuation: tuple[str, bytes] | None
    # Its request's usage record is still to be written (see ``LiveLog.record_owed``).
    record_owed: bool

    def chunks_from(self, index: int) -> list[bytes]:
        """The chunks from ``index`` on, as the app produced them."""

    def tail_start(self) -> int:
        """Where an event stream's end, kept in memory while it runs, starts."""

    def read_back(self, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end``, found from the log's end; ``start`` >= ``base``."""

    def pieces(self, count: int = 128) -> Iterator[bytes]:
        """The bytes in order, ``count`` chunks at a time; all in memory (``base`` is 0)."""


class StoreRoom(Protocol):
    """A store whose producers wait for it once too much output waits to be written."""

    async def room(self) -> None:
        """Return at once, or once the output waiting for the store is back under its
        bound."""


class LiveLog(Protocol):
    """A generation logged in this process, as the store that keeps it reads it: its
    record (``info``), its bytes (``chunks_from``) and how the store keeps up with it.

    Appends and the final status are made on it without awaiting anything: a durable store
    pulls them in batches of its own choosing, and says what it has (``stored``).
    """

    @property
    def id(self) -> str: ...
    @property
    def principal(self) -> str: ...
    @property
    def running(self) -> bool: ...
    @property
    def size(self) -> int: ...
    @property
    def chunk_count(self) -> int: ...
    @property
    def policy(self) -> str | None: ...
    @property
    def detached(self) -> bool: ...
    @property
    def finished_at(self) -> float | None: ...
    @property
    def continuation(self) -> tuple[str, bytes] | None:
        """The upstream's name and what another replica needs to finish the generation
        after this process is gone (``open_stream(..., continuation=...)``), or None."""

    @property
    def handed_over(self) -> bool:
        """It ended here only to be finished by another replica (a drain handed it over):
        its store row loses its owner instead of taking a final status."""

    @property
    def record_owed(self) -> bool:
        """Its request's usage record is still to be written: a store that keeps the mark
        lets another process write an estimated one if this process dies first."""

    # Called once when the generation ends: the store that keeps it accounts for it then.
    on_finish: Callable[[LiveLog], None] | None
    # Set by a store that bounds the output waiting for it: a producer whose log holds more
    # than a couple of MiB awaits ``hold.room()`` (None: it never waits on the store).
    hold: StoreRoom | None

    def info(self) -> GenerationInfo: ...
    def chunks_from(self, index: int) -> list[bytes]:
        """The chunks from ``index`` on (a released chunk is ``b""``, its index kept)."""

    def stored(self, offset: int) -> None:
        """A store has the bytes before ``offset``: free those no reader here needs."""

    def follow(
        self, offset: int, released: Callable[[int], Awaitable[bytes]] | None = None
    ) -> AsyncIterator[bytes]:
        """The bytes from ``offset``, then live until it ends; ``released`` reads from the
        store what memory let go."""


class RequestState:
    """What the middlewares know about one request; read it, don't replace it."""

    __slots__ = (
        "_disconnected",
        "_finalizers",
        "_id",
        "_principal",
        "_usage_hooks",
        "app_send",
        "continuation",
        "delivered_bytes",
        "delivery",
        "detached",
        "disconnect_reason",
        "ending",
        "generation",
        "handled",
        "hears_outside",
        "idempotency",
        "log_store",
        "marks",
        "message_hook",
        "outcome",
        "policy",
        "provider_name",
        "request_body",
        "request_model",
        "response_status",
        "server_hears",
        "stopped_by",
        "stream_ending",
        "upstream_usage",
        "upstreams",
        "usage",
        "usage_pending",
    )

    def __init__(self, generation_id: str, principal: str = "") -> None:
        self._id = generation_id
        self._principal = principal
        self.generation: GenerationOutput | None = None
        self.log_store: LogStore | None = None
        self.policy: Policy | None = None
        self.detached = False
        self.ending: Ending | None = None
        self.stream_ending: Callable[[], str | None] | None = None
        self._disconnected: asyncio.Event | None = None
        self.disconnect_reason: str | None = None
        self.stopped_by: str | None = None
        self.delivered_bytes = 0
        self.delivery = "sent"
        # Set by a DisconnectMiddleware that runs this request, so a second one refuses it.
        self.handled = False
        self.upstreams: list[Closable] = []
        self._finalizers: list[Callable[[Outcome], object]] | None = []
        # Published once, when the exchange ends (``finish``).
        self.outcome: Outcome | None = None
        self.app_send: Callable[[Any], Awaitable[None]] | None = None
        # Set through on_message: the hook that sees each message the app sends.
        self.message_hook: Callable[[Any], bool | None] | None = None
        # None unless an observer wants them: (moment, Unix time in ns), in order.
        self.marks: list[tuple[str, int]] | None = None
        self.usage: UsageRecord | None = None
        self.usage_pending = False
        self._usage_hooks: list[Callable[[UsageRecord | None], object]] | None = None
        self.request_model: str | None = None
        self.request_body: bytes | None = None
        self.upstream_usage: Any = None
        self.provider_name: str | None = None
        self.idempotency: str | None = None
        self.response_status: int | None = None
        # (upstream name, encoded continuation): set by ``open_stream(continuation=...)``.
        self.continuation: tuple[str, bytes] | None = None
        # A client cut for its silence is cut before its server hears of it: the request
        # returns once the server has (``server_hears``, set by DisconnectMiddleware). An
        # outer layer that settles something as the request returns (idempotency) says it
        # waits after that (``hears_outside``); else DisconnectMiddleware waits itself.
        self.hears_outside = False
        self.server_hears: Callable[[], Awaitable[None]] | None = None

    def continue_with(self, continuation: tuple[str, bytes]) -> None:
        """Record how another replica would continue this request's generation: kept here
        until the generation opens, written to it when it is open already."""
        self.continuation = continuation
        if self.generation is not None:
            self.generation.continuation = continuation

    @property
    def generation_id(self) -> str:
        """The request's generation id, given once: its identity, with ``principal``."""
        return self._id

    @property
    def principal(self) -> str:
        """Who made the request, resolved once by the outermost middleware of the package."""
        return self._principal

    @property
    def disconnected(self) -> asyncio.Event:
        """Set when the client went away (or lagged too far behind)."""
        event = self._disconnected
        if event is None:
            event = self._disconnected = asyncio.Event()
        return event

    @property
    def produced_bytes(self) -> int:
        generation = self.generation
        return 0 if generation is None else generation.size

    @property
    def finished(self) -> bool:
        """True once the exchange is over: the app returned and nothing more is delivered."""
        return self._finalizers is None

    def progress(self) -> Outcome:
        """How the exchange goes so far (``ending`` None until it ends): what a middleware
        reads of it before ``on_end``, never the fields DisconnectMiddleware writes."""
        outcome = self.outcome
        return self._outcome(None) if outcome is None else outcome

    def _outcome(self, ending: Ending | None) -> Outcome:
        generation = self.generation
        return Outcome(
            ending,
            self.policy,
            self.detached,
            self.delivered_bytes,
            self.delivery,
            0 if generation is None else generation.size,
            self.disconnect_reason,
            self.response_status if generation is None else generation.status_code,
            self.idempotency,
            self.stopped_by,
        )

    def on_end(self, callback: Callable[[Outcome], object]) -> None:
        """Call ``callback`` with the ``Outcome`` once the exchange is over (the app
        returned and nothing more will be delivered; for detached work, when it ended), at
        once if it already is. An exception in it is logged, never raised."""
        if self._finalizers is None:
            assert self.outcome is not None
            _call(callback, self.outcome)
        else:
            self._finalizers.append(callback)

    def finish(self, ending: Ending) -> None:
        """End the exchange: publish its outcome, then run the hooks; later calls do
        nothing. Called by DisconnectMiddleware alone."""
        callbacks = self._finalizers
        if callbacks is None:
            return
        self._finalizers = None
        self.ending = ending
        outcome = self.outcome = self._outcome(ending)
        generation = self.generation
        # No reference cycle outlives the request (the garbage collector would have to find
        # it): the generation's reader, DisconnectMiddleware's send, metering's observer and
        # its stream's ending.
        self.app_send = self.message_hook = self.stream_ending = None
        if generation is not None:
            generation.reader = None  # its client reads no more
        for callback in callbacks:
            _call(callback, outcome)
        if self._usage_hooks is not None and not self.usage_pending:
            self._usage_known()  # settled already, or no metering ran the request

    def note(self, moment: str) -> None:
        """Mark ``moment`` (``client_disconnect``, ``first_event``, ...) now, if wanted."""
        marks = self.marks
        if marks is not None:
            marks.append((moment, time.time_ns()))

    def on_message(self, send: Any, hook: Callable[[Any], bool | None]) -> bool:
        """Have ``hook`` see each message the app sends, where DisconnectMiddleware handles
        it, instead of a send wrapped around ``send``: only if ``send`` is the one
        DisconnectMiddleware gives the app (nothing in between changes the messages). True
        if it will. ``hook`` answers True once it needs no more of them."""
        if send is None or send is not self.app_send:
            return False
        self.message_hook = hook
        return True

    def off_message(self, hook: Callable[[Any], bool | None]) -> None:
        """``hook`` needs no more messages (a response its middleware does not read)."""
        if self.message_hook == hook:
            self.message_hook = None

    def expect_usage(self) -> None:
        """Metering runs this request: it will settle its usage record, or its absence."""
        self.usage_pending = True

    def settle_usage(self, record: UsageRecord | None) -> None:
        """Metering is done with this request: ``record`` is its usage record, or None if it
        gets none. Runs the usage hooks once; later calls do nothing."""
        if not self.usage_pending:
            return
        self.usage_pending = False
        self.usage = record
        generation = self.generation
        if generation is not None:
            generation.record_owed = False
        if self._usage_hooks is not None:
            self._usage_known()

    def _usage_known(self) -> None:
        hooks, self._usage_hooks = self._usage_hooks, None
        for hook in hooks or ():
            _call_with(hook, self.usage)

    @property
    def usage_settled(self) -> bool:
        """Once the app was called: whether the request's usage is known (``usage``),
        settled by metering, or none comes (no metering ran the request, and its exchange
        is over, or no DisconnectMiddleware ran it)."""
        return not self.usage_pending and (self.finished or not self.handled)

    def on_usage(self, callback: Callable[[UsageRecord | None], object]) -> None:
        """Call ``callback`` once with the request's usage record, or None: when metering
        settles it, or when the exchange ends if no metering runs the request; at once if
        that happened already. An exception in it is logged, never raised. Asked before the
        app is called, it waits for one of the two (a request neither DisconnectMiddleware
        nor metering runs settles nothing: ask ``usage_settled`` once the app returned)."""
        if not self.usage_pending and self.finished:
            _call_with(callback, self.usage)  # settled, or over without metering
        elif self._usage_hooks is None:
            self._usage_hooks = [callback]
        else:
            self._usage_hooks.append(callback)

    def track(self, upstream: Closable) -> None:
        self.upstreams.append(upstream)

    async def close_upstreams(self) -> None:
        """Close every tracked upstream response; errors are logged, never raised."""
        upstreams, self.upstreams = self.upstreams, []
        for upstream in upstreams:
            try:
                await upstream.aclose()
            except Exception:
                logger.warning("closing an upstream response failed", exc_info=True)


def _call_with(
    callback: Callable[[UsageRecord | None], object], record: UsageRecord | None
) -> None:
    try:
        callback(record)
    except Exception:
        logger.exception("a usage hook failed")


def _call(callback: Callable[[Outcome], object], outcome: Outcome) -> None:
    try:
        callback(outcome)
    except Exception:
        logger.exception("a callback at the end of a request failed")


def request_state(scope: Scope, principal: Principal) -> RequestState:
    """The request's state: the one already in ``scope``, or a new one.

    The outermost middleware of the package creates it, so ``principal`` is resolved once
    per request, by the first middleware's ``principal`` option, for every middleware.
    """
    state = scope.get(SCOPE_KEY)
    if state is None:
        state = scope[SCOPE_KEY] = RequestState(new_generation_id(), principal(scope) or "")
    return state


def answered(scope: Scope, status: int) -> None:
    """A middleware answered the request itself with ``status``: tell an observer."""
    state = scope.get(SCOPE_KEY)
    if isinstance(state, RequestState):
        state.response_status = status


current_state: ContextVar[RequestState | None] = ContextVar("asgi_disconnect_state", default=None)


class Reservations(Protocol):
    """Reserve credits before the app runs; settle them with the record, always."""

    async def reserve(self, scope: Scope) -> Any: ...
    async def settle(self, reservation: Any, record: UsageRecord) -> None: ...


# -- the stores, split by what their callers need ---------------------------------------
#
# One backend object serves them all (``Backend``); each caller types what it is given by
# the part it uses, and never probes for a member.


class StoreLifecycle(Protocol):
    """A store that is opened before use and closed at shutdown (in the lifespan)."""

    async def open(self) -> None:
        """Connect and prepare the store; idempotent. Raises ``BackendUnavailable``."""

    async def aclose(self) -> None:
        """Persist what is pending and release connections; idempotent."""


class ClaimStore(StoreLifecycle, Protocol):
    """The claim half of a backend (IdempotencyMiddleware, ``once``). Leases and
    expiry are judged by the store's clock."""

    async def claim(
        self, principal: str, key: str, fingerprint: bytes, *, owner: str, lease: float, ttl: float
    ) -> Claim:
        """Take the claim, or report who holds it; a fresh claim is one round trip.

        A running claim whose lease expired is taken over (same fingerprint only); a
        claim past its expiry is taken afresh.
        """

    async def renew_claims(self, owner: str, lease: float) -> None:
        """Extend the lease of every running claim of ``owner``."""

    async def complete_claim(
        self, principal: str, key: str, *, owner: str, response: StoredResponse, ttl: float
    ) -> bool:
        """Store the response; False if ``owner`` no longer holds the claim (fenced)."""

    async def release_claim(self, principal: str, key: str, *, owner: str) -> bool:
        """Give the claim up so a retry runs again; False if not held (fenced)."""

    async def note_generation(
        self, principal: str, key: str, *, owner: str, generation_id: str
    ) -> None:
        """Record which generation the running claim produces, so retries can attach."""


@runtime_checkable
class GenerationReader(LogStore, Protocol):
    """Where generations are read, from any process that shares the store (a retry that
    attaches to its running generation, the command line)."""

    async def get(self, generation_id: str) -> GenerationInfo | None:
        """The generation's status, or None if it is unknown or expired."""

    async def principal_of(self, generation_id: str) -> str | None:
        """The principal that created the generation, or None if it is unknown."""

    async def recent(self, limit: int = 20, status: str | None = None) -> list[GenerationInfo]:
        """The newest generations (``status``: only those)."""


class GenerationLog(GenerationReader, Protocol):
    """Where generations are logged (DisconnectMiddleware), read, resumed and stopped
    (its resume endpoints).

    The middleware hands each generation it produces to ``register`` (a ``LiveLog``);
    appends and the final status are recorded on that object without awaiting anything,
    and a durable store persists them in batches of its own choosing (it pulls from the
    object). Readers go through ``get``, ``principal_of`` and ``follow``, which work from
    any process that shares the store.
    """

    @property
    def flush_interval(self) -> float | None:
        """How long a durable store is behind the process that produces a generation
        while it keeps up (under load its flush window grows, up to its own ceiling); None
        for one that is not shared (memory)."""

    def register(self, generation: LiveLog) -> None:
        """Take a new generation; called once, without awaiting, at response start."""

    def produces(self, generation_id: str) -> bool:
        """Whether this process produces the generation (its live log is the truth)."""

    async def wait_for_size(
        self, info: GenerationInfo, size: int, timeout: float
    ) -> GenerationInfo:
        """``info`` as the store has it once it holds ``size`` bytes of the generation, once
        the generation ended, or after ``timeout`` seconds; ``info`` itself if it vanished.
        For a generation another process produces: the waiters of one generation in this
        process share one wake-up (a notification, a change poll), never a query each."""

    # Called with a running generation's id, in the process that produces it, when its
    # owner asked to stop it; True if it was running here. Set by DisconnectMiddleware.
    on_cancel: Callable[[str], bool] | None

    async def request_cancel(self, generation_id: str) -> bool:
        """Ask the process that produces the running generation to stop it (here through
        ``on_cancel``, on another replica through the store); False if it is not running."""


class AttemptObserver(Protocol):
    """Sees each upstream call a replica makes to finish a generation it took over: a span
    per attempt, linked to the first attempt's (TelemetryMiddleware, through the lifecycle)."""

    def attempt_started(
        self, generation_id: str, attempt: int, kind: str, trace: str | None
    ) -> object:
        """The attempt began (``trace``: the first attempt's ``traceparent``); returns a
        token for ``attempt_ended``."""

    def attempt_ended(self, token: object, outcome: str, error: str | None) -> None: ...


@runtime_checkable
class TakeoverStore(Protocol):
    """A store shared by replicas (``DurableBackend``) through which one of them takes over
    a detached generation whose owner is gone: it asks the database for lapsed ones this
    process can continue (``upstreams``) and hands each to ``on_takeover``; it tells
    ``on_fenced`` when another replica took over one that runs here."""

    upstreams: tuple[str, ...]
    on_takeover: Callable[[Adopted], None] | None
    on_fenced: Callable[[str], None] | None
    on_swept: Callable[[list[str]], None] | None
    taking_over: bool

    def adopt(self, generation: LiveLog, size: int) -> None:
        """Write what a taken-over generation appends after its ``size`` stored bytes."""

    def adopted_ended(self, generation_id: str) -> None:
        """A taken-over generation ended here: room for another."""

    async def unregistered_upstreams(self) -> list[str]:
        """Upstreams that running detached generations need and this process lacks."""

    async def read_all(self, generation_id: str, size: int) -> bytes:
        """The first ``size`` bytes of a generation, as the store holds them."""

    async def lost(self, ids: list[str]) -> list[Adopted]:
        """The rows of generations a sweep interrupted, their owner gone, or whose usage
        record their owner died before writing."""

    def paid(self, ids: list[str]) -> None:
        """The records owed for ``ids`` are written, or were already: clear their marks."""

    async def usage_of(self, generation_id: str) -> list[UsageRecord]:
        """The usage records stored for a generation (one per attempt)."""

    async def settle_claims(self, generation_id: str, response: StoredResponse | None) -> None:
        """Complete (a replay of its log) or release the generation's idempotency claims."""


class UsageStore(Protocol):
    """Where usage records are kept (``install(store_usage=True)``, the command line)."""

    def record_usage(self, record: UsageRecord) -> None:
        """Store a usage record (a sink for ``MeteringMiddleware``); never awaits."""

    async def usage_of(self, generation_id: str) -> list[UsageRecord]:
        """The usage records stored for a generation."""


class PinStore(Protocol):
    """Where sessions are bound to providers (``SessionPins``)."""

    async def pin_session(self, principal: str, session_id: str, provider: str, ttl: float) -> str:
        """The provider the session is bound to: its live binding, renewed for ``ttl``
        seconds, or else a new binding to ``provider``; one statement, by the store's clock.
        Raises ``BackendUnavailable`` when the store cannot answer."""

    async def end_session(self, principal: str, session_id: str) -> bool:
        """End the session's binding; True if a live one was there."""


@runtime_checkable
class Backend(GenerationLog, ClaimStore, UsageStore, PinStore, Protocol):
    """Where generations, claims, usage records and session pins live: one object that is
    every store (``connect`` returns one). A store of your own implements the parts its
    callers need; DisconnectMiddleware takes a whole ``Backend``."""

    url: str
