"""IdempotencyMiddleware: an ``Idempotency-Key`` is claimed by one conditional insert."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import hmac
import inspect
import logging
import math
import random
import re
import secrets
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Literal, TypeVar
from urllib.parse import parse_qsl

from ._aio import shielded
from ._contract import (
    SCOPE_KEY,
    GenerationReader,
    Outcome,
    RequestState,
    default_principal,
    request_state,
)
from ._errors import IdempotencyKeyRequired
from ._lifecycle import lifecycle_of
from ._problem import problem_body, send_problem
from ._records import Claim, ClaimState, Status, StoredResponse

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ._contract import ClaimStore, GenerationOutput, LogStore

__all__ = ["IdempotencyMiddleware", "idempotent", "parse_key"]

logger = logging.getLogger("asgi_disconnect")

_HEADER = b"idempotency-key"
_MAX_KEY = 255
_TOKEN = re.compile(r"[!#-+\--~]+")  # printable ASCII but space, '"' and ','
_REPLAYED = (b"idempotent-replayed", b"true")
_REPLAY_HEADERS = frozenset(
    {
        "content-type",
        "content-length",  # the original's framing: replayed with the stored body's size
        "content-encoding",
        "content-language",
        "cache-control",
        "location",
        "etag",
        "x-generation-id",
    }
)
_F = TypeVar("_F", bound="Callable[..., Any]")

# "claimed", "replayed", "missing" or None outside the middleware.
_key_state: ContextVar[str | None] = ContextVar("asgi_disconnect_idempotency", default=None)


class _Refusal(Exception):
    def __init__(self, status: int, slug: str, title: str, detail: str, retry_after: int = 0):
        self.status = status
        self.slug = slug
        self.title = title
        self.detail = detail
        self.retry_after = retry_after


# What a refusal tells an observer of the request (RequestState.idempotency).
_REFUSED = {
    "idempotency-key-reused": "mismatch",
    "idempotency-request-in-progress": "in_flight",
    "idempotency-store-unavailable": "unavailable",
}


def _outcome(scope: Scope, outcome: str, status: int | None = None) -> None:
    """Tell an observer of the request how its key was handled, and the status of the
    answer this middleware sent itself (a replay, a refusal)."""
    state = scope.get(SCOPE_KEY)
    if isinstance(state, RequestState):
        state.idempotency = outcome
        if status is not None:
            state.response_status = status


def parse_key(values: list[bytes]) -> str:
    """The key from the ``Idempotency-Key`` header values, as the IETF draft defines it.

    An RFC 8941 sf-string (``"abc"``) or, as many clients send, a bare token (a UUID);
    printable ASCII, 1 to 255 characters, one header. Raises ``ValueError`` otherwise.
    """
    if len(values) != 1:
        raise ValueError("send exactly one Idempotency-Key header")
    try:
        raw = values[0].decode("ascii").strip(" \t")
    except UnicodeDecodeError:
        raise ValueError("the Idempotency-Key must be printable ASCII") from None
    if raw.startswith('"'):
        key = _sf_string(raw)
    elif _TOKEN.fullmatch(raw):
        key = raw
    else:
        raise ValueError("the Idempotency-Key must be a quoted string or a token")
    if not key:
        raise ValueError("the Idempotency-Key is empty")
    if len(key) > _MAX_KEY:
        raise ValueError(f"the Idempotency-Key is longer than {_MAX_KEY} characters")
    return key


def _sf_string(raw: str) -> str:
    out: list[str] = []
    i = 1
    while i < len(raw):
        char = raw[i]
        if char == "\\":
            if i + 1 >= len(raw) or raw[i + 1] not in '"\\':
                raise ValueError("a quoted Idempotency-Key may only escape '\"' and '\\'")
            out.append(raw[i + 1])
            i += 2
            continue
        if char == '"':
            if i != len(raw) - 1:
                raise ValueError("the quoted Idempotency-Key has characters after its end")
            return "".join(out)
        if not " " <= char <= "~":
            raise ValueError("the Idempotency-Key must be printable ASCII")
        out.append(char)
        i += 1
    raise ValueError("the quoted Idempotency-Key is not closed")


def idempotent(*, required: bool = True, ttl: float | None = None) -> Callable[[_F], _F]:
    """Mark an endpoint idempotent; ``required`` refuses requests without a key (400)."""

    def decorate(endpoint: _F) -> _F:
        wrapper: Any
        if not required:
            wrapper = endpoint
        elif inspect.isasyncgenfunction(endpoint):

            @functools.wraps(endpoint)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                if _key_missing():
                    raise IdempotencyKeyRequired(_MISSING)
                async for item in endpoint(*args, **kwargs):
                    yield item

        elif inspect.iscoroutinefunction(endpoint):

            @functools.wraps(endpoint)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                if _key_missing():
                    return _missing_response()
                return await endpoint(*args, **kwargs)

        else:

            @functools.wraps(endpoint)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if _key_missing():
                    return _missing_response()
                return endpoint(*args, **kwargs)

        wrapper.__asgi_disconnect_idempotent__ = ttl
        return wrapper  # type: ignore[no-any-return]

    return decorate


_MISSING = "This endpoint requires an Idempotency-Key header."


def _key_missing() -> bool:
    return _key_state.get() not in ("claimed", "replayed")


def _missing_response() -> Any:
    from starlette.responses import Response

    body = problem_body(400, "idempotency-key-missing", "Idempotency-Key Missing", _MISSING)
    return Response(body, status_code=400, media_type="application/problem+json")


class _Settle:
    """How one claim ends: its response stored, or (``response`` None) the claim released."""

    __slots__ = ("key", "owner", "principal", "response", "size", "trying", "ttl")

    def __init__(
        self, principal: str, key: str, owner: str, response: StoredResponse | None, ttl: float
    ) -> None:
        self.principal = principal
        self.key = key
        self.owner = owner
        self.response = response
        self.ttl = ttl
        self.size = 0 if response is None else sum(map(len, response.chunks))
        self.trying: asyncio.Future[bool] | None = None


class PendingSettles:
    """Settles the store could not take, retried with backoff until it takes them.

    A response may reach its client while the store is down; its claim must still end
    stored, or a retry after the lease would run the request again. So a settle that
    fails is kept here, in memory and bounded (``max_count`` settles, ``max_bytes`` of
    stored bodies), and one task retries them oldest first, backing off from 50 ms to
    2 s while the store stays down, for as long as the process lives. Nothing renews a
    pending claim: if the process dies, its key expires at its lease.
    """

    _FIRST_DELAY = 0.05
    _MAX_DELAY = 2.0

    def __init__(self, store: ClaimStore, *, max_count: int, max_bytes: int) -> None:
        self.store = store
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._pending: dict[tuple[str, str], _Settle] = {}
        self._bytes = 0
        self._retrying: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._pending)

    async def settle(self, settle: _Settle) -> None:
        """Store or release the claim now; if the store fails, keep it and retry later."""
        try:
            await self._apply(settle)
        except Exception as exc:
            if self.keep(settle, exc):
                logger.warning(
                    "settling the idempotency claim %r failed (%s); retrying until the store "
                    "is back",
                    settle.key,
                    exc,
                )

    def start(self, settle: Awaitable[_Settle]) -> None:
        """``settle`` the settle ``settle`` gives, in a task of its own, which
        ``drain`` waits for."""
        task = asyncio.ensure_future(self._settle_when(settle))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _settle_when(self, settle: Awaitable[_Settle]) -> None:
        await self.settle(await settle)

    async def retry_now(self, principal: str, key: str) -> None:
        """One more try for the key's pending settle, if it has one (a retry came in)."""
        settle = self._pending.get((principal, key))
        if settle is not None:
            await self._attempt(settle)

    async def drain(self, timeout: float = 5.0) -> None:
        """At shutdown: finish the settles under way and retry the pending ones, for up
        to ``timeout`` seconds; what is left expires at its lease."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._running:
            await asyncio.wait(set(self._running), timeout=timeout)
        self._stop_retrying()
        delay = self._FIRST_DELAY
        while self._pending and loop.time() < deadline:
            if not await self._attempt(next(iter(self._pending.values()))):
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, self._MAX_DELAY)
        self._stop_retrying()
        if self._pending:
            logger.error(
                "%d idempotency claim(s) could not be settled before shutdown: the store is "
                "unreachable; their keys run again once their lease ends",
                len(self._pending),
            )

    def _stop_retrying(self) -> None:
        retrying, self._retrying = self._retrying, None
        if retrying is not None:
            retrying.cancel()

    async def _apply(self, settle: _Settle) -> bool:
        if settle.response is not None:
            return await self.store.complete_claim(
                settle.principal,
                settle.key,
                owner=settle.owner,
                response=settle.response,
                ttl=settle.ttl,
            )
        return await self.store.release_claim(settle.principal, settle.key, owner=settle.owner)

    def keep(self, settle: _Settle, exc: Exception, *, replace: bool = True) -> bool:
        """Retry ``settle``, which failed with ``exc``, until the store takes it; False if
        it was not kept (``max_count`` or ``max_bytes`` reached: logged as an error).

        A settle of a request that ran replaces an older one of its key (whose owner lost
        the claim, so it would be fenced anyway); with ``replace=False`` (a release after a
        claim that may not have landed) an older one is kept: it may hold a response.
        """
        where = (settle.principal, settle.key)
        if where in self._pending and not replace:
            return False
        self._forget(where)
        if len(self._pending) >= self.max_count or self._bytes + settle.size > self.max_bytes:
            logger.error(
                "settling the idempotency claim %r failed (%s) and %d settles (%d bytes) are "
                "pending already; dropped: the key runs again once its lease ends",
                settle.key,
                exc,
                len(self._pending),
                self._bytes,
            )
            return False
        self._pending[where] = settle
        self._bytes += settle.size
        retrying = self._retrying
        loop = asyncio.get_running_loop()
        if retrying is None or retrying.done() or retrying.get_loop() is not loop:
            # A context of its own: it outlives the request that happened to start it.
            self._retrying = loop.create_task(self._retry(), context=contextvars.Context())
        return True

    def _forget(self, where: tuple[str, str]) -> None:
        old = self._pending.pop(where, None)
        if old is not None:
            self._bytes -= old.size

    async def _attempt(self, settle: _Settle) -> bool:
        """One try, shared by everyone who asks while it is under way; True if it is done."""
        trying = settle.trying
        if trying is None or trying.done():
            trying = settle.trying = asyncio.ensure_future(self._apply(settle))
            trying.add_done_callback(_retrieve)
        try:
            held = await asyncio.shield(trying)
        except Exception:
            return False
        where = (settle.principal, settle.key)
        if self._pending.get(where) is settle:
            self._forget(where)
            if not held and settle.response is not None:
                # Its lease ended and a retry took the key over, or an earlier try landed.
                logger.warning(
                    "the idempotency claim %r was no longer held when its settle was retried",
                    settle.key,
                )
        return True

    async def _retry(self) -> None:
        delay = self._FIRST_DELAY
        settled = 0
        while self._pending:
            settle = next(iter(self._pending.values()))
            if await self._attempt(settle):
                settled += 1
                delay = self._FIRST_DELAY
                continue
            where = (settle.principal, settle.key)
            if self._pending.get(where) is settle:
                # To the back: one settle that keeps failing must not hold up the others.
                del self._pending[where]
                self._pending[where] = settle
            # Jitter, so that replicas that lost the store together do not retry in step.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self._MAX_DELAY)
        if settled:
            logger.warning("the idempotency store is back: %d pending claim(s) settled", settled)


def _retrieve(future: asyncio.Future[bool]) -> None:
    if not future.cancelled():
        future.exception()


# Statuses that tell the client to retry later: never a key's stored result.
_COME_BACK_LATER = frozenset({408, 425, 429, 503})


def _retry_after(headers: Any) -> bool:
    return any(bytes(name).lower() == b"retry-after" for name, _ in headers)


class IdempotencyMiddleware:
    """Runs each (principal, key) once; retries get the stored response or a clear refusal.

    - claim: one conditional insert in ``backend`` (``ClaimStore``), leased by the
      store's clock and renewed by the request while it runs, never after;
    - completed, same fingerprint: the stored status, allow-listed headers and body,
      chunk by chunk, with ``Idempotent-Replayed: true``;
    - still running: 409 with ``Retry-After``; another body under the key: 422;
    - 2xx and 4xx are stored (5xx too with ``store_server_errors``, as Stripe does);
      other 5xx, exceptions and cancellation release the claim so a retry runs again, and
      so does a response that says to come back later (408, 425, 429, 503, or any error
      with ``Retry-After``);
    - store unreachable: 503 with ``Retry-After`` (``fail_open=True`` runs the request);
      a settle it refuses is kept and retried until it lands (``PendingSettles``,
      bounded by ``max_pending_settles`` and ``max_pending_bytes``).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        backend: ClaimStore,
        methods: Sequence[str] = ("POST", "PATCH"),
        paths: Sequence[str] | None = None,
        principal: Callable[[Scope], str | None] | None = None,
        allow_anonymous: bool = False,
        max_body: int = 1 << 20,
        max_stored: int = 8 << 20,
        lease: float = 30.0,
        ttl: float = 24 * 3600.0,
        fail_open: bool = False,
        secret: bytes = b"asgi-disconnect idempotency",
        fingerprint_headers: Sequence[str] = (),
        replay_headers: Sequence[str] = (),
        in_flight: Literal["conflict", "attach"] = "conflict",
        store_server_errors: bool = False,
        max_pending_settles: int = 10_000,
        max_pending_bytes: int = 64 << 20,
    ) -> None:
        if in_flight not in ("conflict", "attach"):
            raise ValueError("in_flight must be 'conflict' or 'attach'")
        if max_body <= 0 or max_stored <= 0 or lease <= 0 or ttl <= 0:
            raise ValueError("max_body, max_stored, lease and ttl must be positive")
        if max_pending_settles < 0 or max_pending_bytes < 0:
            raise ValueError("max_pending_settles and max_pending_bytes must not be negative")
        self.app = app
        self.backend = backend
        self.methods = frozenset(m.upper() for m in methods)
        self.paths = re.compile("|".join(f"(?:{p})" for p in paths)) if paths else None
        self.principal = principal or default_principal
        self.allow_anonymous = allow_anonymous
        self.max_body = max_body
        self.max_stored = max_stored
        self.lease = lease
        self.ttl = ttl
        self.fail_open = fail_open
        self.secret = secret
        self.fingerprint_headers = tuple(h.lower().encode("latin-1") for h in fingerprint_headers)
        self.replay_headers = _REPLAY_HEADERS | {h.lower() for h in replay_headers}
        self.store_below = 600 if store_server_errors else 500
        # Attaching tails the live generation: the store must read generations too.
        self._generations = backend if isinstance(backend, GenerationReader) else None
        self.attach = in_flight == "attach" and self._generations is not None
        self._noting: set[asyncio.Task[None]] = set()
        self.pending_settles = PendingSettles(
            backend, max_count=max_pending_settles, max_bytes=max_pending_bytes
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        if self.paths is not None and not self.paths.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        values = [value for name, value in scope["headers"] if name == _HEADER]
        if not values:
            token = _key_state.set("missing")
            try:
                await self._run_unclaimed(scope, receive, send)
            finally:
                _key_state.reset(token)
            return
        try:
            await self._idempotent(scope, receive, send, values)
        except _Refusal as refusal:
            _outcome(scope, _REFUSED.get(refusal.slug, "invalid"), refusal.status)
            headers = []
            if refusal.retry_after:
                headers.append((b"retry-after", str(refusal.retry_after).encode()))
            await send_problem(
                send, refusal.status, refusal.slug, refusal.title, refusal.detail, headers=headers
            )

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle, owner = lifecycle_of(scope)
        lifecycle.register(
            "IdempotencyMiddleware",
            unique=True,
            startup=self.backend.open,
            # Before the backend closes: settles the store refused get a last chance.
            flush=self.pending_settles.drain,
            close=self.backend.aclose,
        )
        await lifecycle.run(owner, self.app, scope, receive, send)

    async def _run_unclaimed(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except IdempotencyKeyRequired as exc:
            if started:
                raise
            await send_problem(
                send, 400, "idempotency-key-missing", "Idempotency-Key Missing", str(exc)
            )

    async def _idempotent(
        self, scope: Scope, receive: Receive, send: Send, values: list[bytes]
    ) -> None:
        try:
            key = parse_key(values)
        except ValueError as exc:
            slug = "idempotency-key-duplicated" if len(values) > 1 else "idempotency-key-malformed"
            raise _Refusal(400, slug, "Bad Idempotency-Key", str(exc)) from None
        principal = request_state(scope, self.principal).principal
        if not principal:
            if not self.allow_anonymous:
                raise _Refusal(
                    401,
                    "idempotency-principal-required",
                    "Caller Unknown",
                    "Idempotency keys are scoped to the caller: send credentials.",
                )
            principal = "anonymous"
        body = await self._read_body(scope, receive)
        fingerprint = self._fingerprint(scope, body)
        owner = secrets.token_hex(12)
        if self.pending_settles:
            # This key's earlier request may have answered while the store was down: store
            # that answer first, so the claim below replays it instead of running again.
            await self.pending_settles.retry_now(principal, key)
        try:
            claim = await self.backend.claim(
                principal, key, fingerprint, owner=owner, lease=self.lease, ttl=self.ttl
            )
        except Exception as exc:
            # The insert may have committed before the store failed: release what it may
            # hold once the store is back, so a retry runs then instead of waiting a lease.
            self.pending_settles.keep(
                _Settle(principal, key, owner, None, self.ttl), exc, replace=False
            )
            if self.fail_open:
                logger.warning("idempotency store unreachable (%s); running unclaimed", exc)
                _outcome(scope, "unclaimed")
                await self.app(scope, _replay_receive(body, receive), send)
                return
            raise _Refusal(
                503,
                "idempotency-store-unavailable",
                "Service Unavailable",
                "The idempotency store cannot be reached; retry later.",
                retry_after=5,
            ) from exc
        if claim.state is ClaimState.MISMATCH:
            raise _Refusal(
                422,
                "idempotency-key-reused",
                "Idempotency-Key Reused",
                "This key was used with another request; use a new key for a new request.",
            )
        if claim.state is ClaimState.RUNNING and self.attach and claim.generation_id:
            _outcome(scope, "attached")
            await self._attach(claim.generation_id, send)
            return
        if claim.state is ClaimState.RUNNING:
            raise _Refusal(
                409,
                "idempotency-request-in-progress",
                "Request In Progress",
                "A request with this key is still running; retry after the delay.",
                retry_after=max(1, math.ceil(claim.retry_after or 1)),
            )
        if claim.state is ClaimState.COMPLETED:
            _outcome(scope, "replayed", claim.response.status if claim.response else None)
            await self._replay(claim, send)
            return
        _outcome(scope, "fresh")
        claimed = _ClaimedRequest(self, scope, principal, key, owner)
        # Renewed while the request runs (for detached work, until the generation ends),
        # never after: a claim whose settle is pending expires at its lease if we die.
        heartbeat = asyncio.ensure_future(self._heartbeat(owner))
        await claimed.run(_replay_receive(body, receive), send, heartbeat)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                raise _Refusal(
                    413,
                    "idempotency-body-too-large",
                    "Content Too Large",
                    f"Idempotent requests are limited to {self.max_body} bytes.",
                )
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                raise _Refusal(400, "request-incomplete", "Bad Request", "The client went away.")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise _Refusal(
                    413,
                    "idempotency-body-too-large",
                    "Content Too Large",
                    f"Idempotent requests are limited to {self.max_body} bytes.",
                )
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    def _fingerprint(self, scope: Scope, body: bytes) -> bytes:
        mac = hmac.new(self.secret, digestmod=hashlib.sha256)
        query = sorted(parse_qsl(scope.get("query_string", b"").decode("latin-1"), True))
        mac.update(scope["method"].encode() + b"\n" + scope["path"].encode("utf-8") + b"\n")
        mac.update(repr(query).encode("utf-8") + b"\n")
        for wanted in self.fingerprint_headers:
            for name, value in scope["headers"]:
                if name == wanted:
                    mac.update(name + b":" + value + b"\n")
        mac.update(b"\n" + body)
        return mac.digest()

    async def _attach(self, generation_id: str, send: Send) -> None:
        generations = self._generations
        assert generations is not None  # self.attach, or a claim settled by a takeover
        info = await generations.get(generation_id)
        if info is None:
            raise _Refusal(
                409,
                "idempotency-request-in-progress",
                "Request In Progress",
                "A request with this key is still running; retry after the delay.",
                retry_after=1,
            )
        headers = [
            (b"content-type", (info.content_type or "application/octet-stream").encode("latin-1")),
            (b"x-generation-id", generation_id.encode()),
            _REPLAYED,
        ]
        await send({"type": "http.response.start", "status": info.status_code, "headers": headers})
        async for data in generations.follow(generation_id, 0):
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _replay(self, claim: Claim, send: Send) -> None:
        stored = claim.response
        assert stored is not None
        if not stored.chunks and stored.generation_id and self._generations is not None:
            # Settled by the replica that took the generation over: the answer is its log.
            await self._attach(stored.generation_id, send)
            return
        chunks = stored.chunks or [b""]
        size = str(sum(map(len, chunks))).encode()
        headers = [
            (name, size if name == b"content-length" else v.encode("latin-1"))
            for name, v in ((k.lower().encode("latin-1"), v) for k, v in stored.headers)
        ]
        headers.append(_REPLAYED)
        await send({"type": "http.response.start", "status": stored.status, "headers": headers})
        for index, chunk in enumerate(chunks):
            last = index == len(chunks) - 1
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})

    def _note_generation(self, principal: str, key: str, owner: str, generation_id: str) -> None:
        """Name the generation that answers the claim, for retries that attach to it."""
        noting = asyncio.ensure_future(
            self.backend.note_generation(principal, key, owner=owner, generation_id=generation_id)
        )
        self._noting.add(noting)
        noting.add_done_callback(self._noting.discard)

    async def _heartbeat(self, owner: str) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            try:
                await self.backend.renew_claims(owner, self.lease)
            except Exception as exc:
                logger.warning("renewing idempotency leases failed: %s", exc)


class _ClaimedRequest:
    """One request that holds its key's claim: what the app answered, as far as it may be
    stored, and how the claim ends (the response stored, or the claim released)."""

    __slots__ = (
        "chunks",
        "headers",
        "key",
        "later",
        "middleware",
        "owner",
        "principal",
        "scope",
        "settled",
        "size",
        "status",
    )

    def __init__(
        self, middleware: IdempotencyMiddleware, scope: Scope, principal: str, key: str, owner: str
    ) -> None:
        self.middleware = middleware
        self.scope = scope
        self.principal = principal
        self.key = key
        self.owner = owner
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] | None = []  # None: too large to store, kept no longer
        self.size = 0
        self.later = False  # the answer says "come back later": no result to store
        self.settled = False

    def route_ttl(self) -> float:
        ttl = getattr(self.scope.get("endpoint"), "__asgi_disconnect_idempotent__", None)
        return self.middleware.ttl if ttl is None else float(ttl)

    async def run(self, receive: Receive, send: Send, heartbeat: asyncio.Future[None]) -> None:
        """Run the app; settle the claim when the response ends, or when the work does."""
        middleware = self.middleware

        async def tee(message: Message) -> None:
            await self.record(message)
            await send(message)

        token = _key_state.set("claimed")
        failure: BaseException | None = None
        state = self.scope.get(SCOPE_KEY)
        if isinstance(state, RequestState):
            state.hears_outside = True  # the claim settles first (see the end)
        try:
            await middleware.app(self.scope, receive, tee)
        except IdempotencyKeyRequired:
            raise
        except BaseException as exc:
            failure = exc
            raise
        finally:
            _key_state.reset(token)
            ttl = self.route_ttl()
            detached = isinstance(state, RequestState) and state.progress().detached
            if self.settled:
                heartbeat.cancel()
            elif isinstance(state, RequestState) and ((detached and not failure) or _whole(state)):
                # The generation outlives this request, or it ended whole while its client
                # could not take it all (a phone gone silent, then cut): the generation is
                # the answer, stored once it has ended, so a retry never pays twice.
                def ended(outcome: Outcome) -> None:
                    heartbeat.cancel()
                    middleware.pending_settles.start(self.detached_ending(state, ttl))

                state.on_end(ended)
                if detached and not middleware.attach:
                    # Known with the claim, a replica that takes the generation over (its
                    # process died) settles the claim with it, so a retry never pays twice.
                    middleware._note_generation(
                        self.principal, self.key, self.owner, state.generation_id
                    )
            else:
                heartbeat.cancel()
                # The response never reached its end (the client left, the app failed or
                # was cancelled): nothing complete to replay, so a retry runs again.
                incomplete = failure or _INCOMPLETE
                await shielded(
                    middleware.pending_settles.settle(self.ending(None, incomplete, ttl))
                )
        # A client cut for its silence: the claim is settled (a retry finds it so), and the
        # request returns once the server heard of the cut.
        if isinstance(state, RequestState) and state.server_hears is not None:
            await state.server_hears()

    async def record(self, message: Message) -> None:
        """Keep what the app sends; at the response's end, settle the claim before the
        last byte leaves."""
        middleware = self.middleware
        kind = message["type"]
        if kind == "http.response.start":
            status = self.status = message["status"]
            # "Come back later" (a rate limit, an overload, a timeout) is no result: a
            # client that waits and retries must reach the work again.
            self.later = status in _COME_BACK_LATER or (
                status >= 400 and _retry_after(message.get("headers", ()))
            )
            state = self.scope.get("asgi_disconnect")
            if middleware.attach and isinstance(state, RequestState):
                middleware._note_generation(
                    self.principal, self.key, self.owner, state.generation_id
                )
            self.headers = [
                (bytes(k).decode("latin-1"), bytes(v).decode("latin-1"))
                for k, v in message.get("headers", ())
                if bytes(k).decode("latin-1").lower() in middleware.replay_headers
            ]
        elif kind == "http.response.body":
            chunk = message.get("body", b"")
            if chunk:
                self.size += len(chunk)
                if self.size <= middleware.max_stored:
                    if self.chunks is not None:
                        self.chunks.append(chunk)
                else:
                    self.chunks = None
            if not message.get("more_body", False):
                self.settled = True
                state = self.scope.get("asgi_disconnect")
                generation = state.generation if isinstance(state, RequestState) else None
                # A stream the app ended short (its protocol said so) is as an upstream
                # failure: not stored, so a retry runs again.
                short = (
                    generation is not None
                    and generation.status != Status.COMPLETE
                    and generation.status_code < 400  # an error answer is whole
                )
                # Stored before the last byte leaves: a client that retries the moment
                # it has the response gets the replay, not a 409.
                failure = _INCOMPLETE if short else None
                await shielded(
                    middleware.pending_settles.settle(self.ending(None, failure, self.route_ttl()))
                )

    def ending(
        self,
        generation: GenerationOutput | None,
        failure: BaseException | None,
        ttl: float,
        chunks: list[bytes] | None = None,
    ) -> _Settle:
        """How the claim ends: the response to store, or a release so that a retry runs.
        ``chunks``: the body, when it is not what the client was sent (detached work)."""
        middleware = self.middleware
        status = self.status
        if chunks is None:
            chunks = self.chunks
        if (
            generation is not None
            and generation.status != Status.COMPLETE
            and generation.status_code < 400
        ):
            status = None
        keep = (
            failure is None
            and status is not None
            and status < middleware.store_below
            and not self.later
            and chunks is not None
            and sum(map(len, chunks)) <= middleware.max_stored
        )
        stored = None
        if keep:
            assert chunks is not None
            assert status is not None
            stored = StoredResponse(
                status=status,
                headers=self.headers,
                chunks=list(chunks),
                generation_id=generation.id if generation is not None else None,
            )
        return _Settle(self.principal, self.key, self.owner, stored, ttl)

    async def detached_ending(self, state: RequestState, ttl: float) -> _Settle:
        """How the claim ends when the generation is the answer (its work detached, or it
        ended whole while its client could not take it all): the whole generation, read back
        from the store that logs it (the request's ``log_store``) where memory released it,
        is the response to store."""
        generation = state.generation
        chunks: list[bytes] | None = None
        if generation is not None and generation.status == Status.COMPLETE:
            store = state.log_store
            if generation.size > self.middleware.max_stored:
                chunks = None
            elif not generation.base:
                chunks = generation.chunks_from(0)
            elif store is None:
                chunks = None  # released, and nowhere to read it back: not stored
            else:
                chunks = await _read_back(store, generation, self.key)
                if sum(map(len, chunks)) != generation.size:
                    logger.error(
                        "generation %s read back short from the store; the idempotency "
                        "claim %r is released, so the key runs again",
                        generation.id,
                        self.key,
                    )
                    chunks = None
        return self.ending(generation, None, ttl, chunks)


async def _read_back(store: LogStore, generation: GenerationOutput, key: str) -> list[bytes]:
    """The generation's bytes from ``store``, retried with backoff while it is down
    (as a pending settle is, for as long as the process lives)."""
    delay = 0.05
    failures = 0
    while True:
        try:
            return [data async for data in store.follow(generation.id, 0)]
        except Exception as exc:
            failures += 1
            if failures == 1:
                logger.warning(
                    "settling the idempotency claim %r waits for the store: reading "
                    "generation %s back failed (%s)",
                    key,
                    generation.id,
                    exc,
                )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


def _whole(state: RequestState) -> bool:
    """Whether the request's generation reached its protocol's end (whatever its client
    received of it)."""
    generation = state.generation
    return generation is not None and generation.status == Status.COMPLETE


def _replay_receive(body: bytes, receive: Receive) -> Receive:
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


_INCOMPLETE = RuntimeError("the response did not reach its end")
