"""What the SQLite and PostgreSQL backends share: batched flushes, leases, sweeps, claims.

What waits for the next flush is in ``_pending``; generations followed in the store, ``_tails``;
the rows the SQL stores read back, ``_rows``. The database half (``SQLStore``) is split by what
each part of the backend asks of it, as the stores of ``_contract`` are split by their callers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import TYPE_CHECKING, Protocol

import msgspec

from .._errors import BackendUnavailable
from .._records import Adopted, GenerationInfo, Status, UsageRecord
from ._bound import PendingBound
from ._pending import PendingWrites
from ._rows import encode_response
from ._tails import StoreTails, TailSource
from ._window import FlushWindow, default_ceiling

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable

    from .._contract import LiveLog
    from .._records import Claim, StoredResponse
    from ._pending import FlushBatch


__all__ = [
    "DurableBackend",
    "SQLClaims",
    "SQLGenerations",
    "SQLLifecycle",
    "SQLPins",
    "SQLStore",
    "SQLUsage",
    "SQLWrites",
]

logger = logging.getLogger("asgi_disconnect")


class SQLLifecycle(Protocol):
    """The database half's life: opened before use, closed at shutdown, and why it refuses
    every write for good (DurableBackend's ``open``, ``aclose`` and ``failure``)."""

    url: str

    @property
    def failure(self) -> str | None:
        """Why the store refuses every write from now on (its file was deleted), or None."""

    async def open(self) -> None: ...
    async def aclose(self) -> None: ...


class SQLWrites(Protocol):
    """What the flush worker writes and asks: each flush's batch, the leases, the sweep of
    generations whose owner is gone, the reaper, and the Stops asked of this process."""

    async def flush(self, batch: FlushBatch) -> list[str]:
        """Write ``batch``; the ids whose chunks it refused, another process owning them."""

    async def heartbeat(self, owner: str, lease: float) -> None: ...
    async def sweep(self, ttl: float, max_attempts: int = 1, grace: float = 0.0) -> list[str]:
        """Mark lapsed generations ``interrupted``: at once those no replica can take over,
        the others once ``grace`` seconds passed or their ``max_attempts`` ran out."""

    async def settle_generation_claims(
        self, generation_id: str, response: bytes | None, ttl: float
    ) -> int:
        """Complete (``response``) or release (None) the running idempotency claims of a
        generation: the replica that took it over settles them when it ends."""

    async def continued_upstreams(self) -> list[str]:
        """The upstream names the running detached generations' continuations need."""

    async def lost(self, ids: list[str]) -> list[Adopted]:
        """The rows of generations a sweep interrupted (their continuation b"" if none)."""

    async def claim_owed(self, lease: float, limit: int) -> list[str]:
        """Hold for ``lease`` seconds up to ``limit`` ended generations whose usage record
        was owed when their lease lapsed (their process died waiting to write it), for the
        caller to write. Each keeps its owner: no heartbeat of the caller renews the hold,
        so a mark its record's flush has not cleared by then goes to the next sweep."""

    async def take_over(
        self, owner: str, lease: float, limit: int, upstreams: list[str], max_attempts: int
    ) -> list[Adopted]:
        """Make ``owner`` the owner of up to ``limit`` detached generations whose lease
        lapsed, whose continuation names one of ``upstreams``; each goes to one caller."""

    async def reap(self, limit: int) -> int: ...
    async def cancel_requests(self, owner: str) -> list[str]: ...


class SQLGenerations(Protocol):
    """The generations as their readers see them (DurableBackend as a ``GenerationLog``),
    and a Stop asked of the process that runs one."""

    async def info(self, generation_id: str) -> tuple[GenerationInfo, str] | None: ...
    async def read(self, generation_id: str, offset: int, limit: int) -> bytes: ...
    async def recent(self, limit: int, status: str | None) -> list[GenerationInfo]: ...
    async def request_cancel(self, generation_id: str) -> bool: ...


class SQLClaims(Protocol):
    """The claims (DurableBackend as a ``ClaimStore``): each one statement, never batched."""

    async def claim(
        self,
        principal: str,
        key: str,
        fingerprint: bytes,
        *,
        owner: str,
        process: str,
        lease: float,
        ttl: float,
    ) -> Claim: ...
    async def renew_claims(self, owner: str, lease: float) -> None: ...
    async def complete_claim(
        self, principal: str, key: str, *, owner: str, response: StoredResponse, ttl: float
    ) -> bool: ...
    async def release_claim(self, principal: str, key: str, *, owner: str) -> bool: ...
    async def note_generation(
        self, principal: str, key: str, *, owner: str, generation_id: str
    ) -> None: ...


class SQLUsage(Protocol):
    """The usage records stored (DurableBackend as a ``UsageStore``); they are written with
    the flushes."""

    async def usage(self, generation_id: str) -> list[bytes]: ...


class SQLPins(Protocol):
    """The session pins (DurableBackend as a ``PinStore``): one statement each."""

    async def pin_session(
        self, principal: str, session_id: str, provider: str, ttl: float
    ) -> str: ...
    async def end_session(self, principal: str, session_id: str) -> bool: ...


class SQLStore(
    SQLLifecycle, SQLWrites, SQLGenerations, TailSource, SQLClaims, SQLUsage, SQLPins, Protocol
):
    """The database half of a durable backend: every part above, and what its tails ask
    (``TailSource``), as ``connect`` hands it to ``DurableBackend`` (``SQLiteStore``,
    ``PostgresStore``)."""


# How often a process asks the store whether an owner wants one of its generations stopped.
_CANCEL_POLL = 0.25
# Records owed by dead processes written per sweep: the rest wait for the next one.
_OWED_AT_ONCE = 100


class DurableBackend:
    """Persists live generations chunk by chunk, at most one flush window behind.

    Writes are batched: once per flush window (and at once again while more than
    ``flush_max_bytes`` are pending) one transaction inserts new generations, their new
    chunks and their final status. The window is ``flush_interval`` while flushes take
    less than a quarter of it; when they take longer it grows (more chunks per transaction,
    fewer transactions), up to ``max_flush_interval`` (default four flush intervals, at
    most 1 s), and it shrinks back when they are quick again (``FlushWindow``). A
    ``kill -9`` loses at most the output of the current window plus the flush then under
    way. Each running generation holds a lease that a heartbeat renews, judged by the
    database's clock; a sweep marks generations whose owner stopped renewing as
    ``interrupted``. Finished generations expire ``ttl`` seconds after they end and a
    reaper deletes them in batches.
    """

    def __init__(
        self,
        store: SQLStore,
        *,
        flush_interval: float = 0.05,
        max_flush_interval: float | None = None,
        flush_max_bytes: int = 1 << 20,
        lease: float = 15.0,
        sweep_interval: float = 5.0,
        ttl: float = 24 * 3600.0,
        reap_interval: float = 60.0,
        max_pending_usage: int = 100_000,
        max_pending_bytes: int = 64 << 20,
        takeover_interval: float = 1.0,
        max_takeovers: int = 16,
        max_attempts: int = 3,
        takeover_grace: float = 60.0,
    ) -> None:
        if not 0 < flush_interval <= 5:
            raise ValueError("flush_interval must be in (0, 5] seconds")
        if lease <= 3 * flush_interval:
            raise ValueError("lease must be longer than three flush intervals")
        if max_flush_interval is None:
            # The window never grows past what a short lease allows (see below).
            max_flush_interval = max(
                flush_interval, min(default_ceiling(flush_interval), lease / 4)
            )
        if not flush_interval <= max_flush_interval <= 5:
            raise ValueError("max_flush_interval must be in [flush_interval, 5] seconds")
        if flush_max_bytes <= 0:
            raise ValueError("flush_max_bytes must be positive")
        if lease <= 3 * max_flush_interval:
            raise ValueError(
                f"lease must be longer than three flush windows at their ceiling "
                f"(max_flush_interval, here {max_flush_interval} s)"
            )
        if ttl <= 0 or sweep_interval <= 0 or reap_interval <= 0 or max_pending_usage <= 0:
            raise ValueError(
                "ttl, sweep_interval, reap_interval and max_pending_usage must be positive"
            )
        if takeover_interval <= 0 or takeover_grace < 0:
            raise ValueError("takeover_interval must be positive and takeover_grace not negative")
        if max_takeovers < 0 or max_attempts < 1:
            raise ValueError("max_takeovers must be 0 or more and max_attempts 1 or more")
        self.max_pending_usage = max_pending_usage
        self.store = store
        self.url = store.url
        self.flush_interval = flush_interval
        self.max_flush_interval = max_flush_interval
        self._window = FlushWindow(flush_interval, max_flush_interval)
        self.flush_max_bytes = flush_max_bytes
        self.lease = lease
        self.sweep_interval = sweep_interval
        self.ttl = ttl
        self.reap_interval = reap_interval
        self.owner = secrets.token_hex(8)
        self._pending = PendingWrites(
            owner=self.owner, lease=lease, ttl=ttl, max_usage=max_pending_usage, url=self.url
        )
        self._opened = False
        self._opening: asyncio.Task[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._flush_lock: asyncio.Lock | None = None
        self._failures = 0
        self._tails = StoreTails(store, self.url)
        self.on_cancel: Callable[[str], bool] | None = None
        # Takeover: DisconnectMiddleware sets what it can continue (the upstreams registered
        # here) and the hooks; every ``takeover_interval`` the worker asks the database for
        # lapsed detached generations, up to ``max_takeovers`` running here at once.
        self.takeover_interval = takeover_interval
        self.max_takeovers = max_takeovers
        self.max_attempts = max_attempts
        self.takeover_grace = takeover_grace
        self.upstreams: tuple[str, ...] = ()
        self.on_takeover: Callable[[Adopted], None] | None = None
        self.on_fenced: Callable[[str], None] | None = None
        # Told the ids of the generations each sweep interrupted: their owner died with them.
        self.on_swept: Callable[[list[str]], None] | None = None
        self.adopted: set[str] = set()  # taken over and running here
        self.taking_over = True  # False once this process drains
        # Output produced here and not durable yet, across every generation, is bounded:
        # past ``max_pending_bytes`` the producers wait on the store, never on their clients.
        self.output = PendingBound(self._pending.pending_bytes, max_pending_bytes, self.url)

    def __repr__(self) -> str:
        # The store's URL, its password masked: a repr ends up in logs and tracebacks.
        state = "open" if self._opened else "not open"
        return (
            f"<DurableBackend {self.url} ({state}): flush_interval={self.flush_interval:g}s "
            f"lease={self.lease:g}s ttl={self.ttl:g}s>"
        )

    # -- life cycle -------------------------------------------------------------------

    async def open(self) -> None:
        if self._opened:
            return
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        await asyncio.shield(self._opening)

    async def _open(self) -> None:
        try:
            await self.store.open()
        except BaseException:
            self._opening = None
            raise
        try:
            interrupted = await self.store.sweep(self.ttl, self.max_attempts, self.takeover_grace)
        except BaseException as exc:
            self._opening = None
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.aclose())
            if isinstance(exc, Exception) and not isinstance(exc, BackendUnavailable):
                raise BackendUnavailable(
                    f"cannot prepare {self.url}: the first sweep failed ({exc}); retry"
                ) from exc
            raise
        self._flush_lock = asyncio.Lock()
        if interrupted:
            logger.warning(
                "marked %d generation(s) interrupted: their owner stopped renewing its lease",
                len(interrupted),
            )
            self._swept(interrupted)
        self._opened = True
        self._worker = asyncio.ensure_future(self._work())

    async def aclose(self) -> None:
        if self._opening is not None and not self._opened:
            try:
                await self._opening
            except BackendUnavailable:
                return
        if not self._opened:
            return
        worker, self._worker = self._worker, None
        if worker is not None:
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
        self.output.release()  # none waits on a store that is closed
        await self._tails.aclose()
        try:
            while await self.flush():
                pass
        except Exception:
            logger.exception("final flush to %s failed; recent output is lost", self.url)
        self._opened = False
        self._opening = None
        await self.store.aclose()

    async def __aenter__(self) -> DurableBackend:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def record_usage(self, record: UsageRecord) -> None:
        """A usage sink: the record is written with the next flush. While the store is
        down, at most ``max_pending_usage`` records wait in memory; past that the oldest
        are dropped (``usage_dropped`` counts them, and an error says so)."""
        self._pending.add_usage(record)

    @property
    def usage_dropped(self) -> int:
        """Usage records dropped while the store was unreachable."""
        return self._pending.usage_dropped

    async def usage_of(self, generation_id: str) -> list[UsageRecord]:
        """The usage records stored for a generation (normally one)."""

        await self._ensure_open()
        rows = await self.store.usage(generation_id)
        pending = self._pending.usage_of(generation_id)
        return [msgspec.json.decode(raw, type=UsageRecord) for raw in [*rows, *pending]]

    # -- claims: straight to the store, never batched ----------------------------------

    async def claim(
        self, principal: str, key: str, fingerprint: bytes, *, owner: str, lease: float, ttl: float
    ) -> Claim:
        await self._ensure_open()
        return await self.store.claim(
            principal, key, fingerprint, owner=owner, process=self.owner, lease=lease, ttl=ttl
        )

    async def renew_claims(self, owner: str, lease: float) -> None:
        """Extend the lease of the claim ``owner`` (one request's token) holds, and no other.

        The process's heartbeat renews only its generations: a claim whose request ended
        (its settle still pending, or its process gone) expires at its own lease.
        """
        await self._ensure_open()
        await self.store.renew_claims(owner, lease)

    async def complete_claim(
        self, principal: str, key: str, *, owner: str, response: StoredResponse, ttl: float
    ) -> bool:
        await self._ensure_open()
        return await self.store.complete_claim(
            principal, key, owner=owner, response=response, ttl=ttl
        )

    async def release_claim(self, principal: str, key: str, *, owner: str) -> bool:
        await self._ensure_open()
        return await self.store.release_claim(principal, key, owner=owner)

    async def note_generation(
        self, principal: str, key: str, *, owner: str, generation_id: str
    ) -> None:
        await self._ensure_open()
        await self.store.note_generation(principal, key, owner=owner, generation_id=generation_id)

    def register(self, generation: LiveLog) -> None:
        self._pending.track(generation)
        generation.hold = self.output  # its producer asks once its log holds a lot
        if not self._opened and self._opening is None:
            # No lifespan ran: open on first use.
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(_log_open_failure)

    # -- the background worker ----------------------------------------------------------

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        next_heartbeat = next_sweep = next_cancel = next_takeover = loop.time()
        next_reap = loop.time() + self.reap_interval
        while True:
            started = loop.time()
            try:
                rows, more = await self._write_pending()
                while more:
                    self.output.written()  # producers may be outrunning the store
                    written, more = await self._write_pending()
                    rows += written
                self._window.observe(loop.time() - started, rows)
                self.output.written()
                if self._failures:
                    # Back after the store failed (a database restart): every live owner's
                    # lease may have lapsed while nobody could renew it. Take nothing as
                    # lost until each has had its retry (a second at most) and a heartbeat.
                    back = started + self.lease + 1.0
                    next_takeover, next_sweep = max(next_takeover, back), max(next_sweep, back)
                if started >= next_cancel:
                    if self._pending and self.on_cancel is not None:
                        for generation_id in await self.store.cancel_requests(self.owner):
                            if self._pending.live(generation_id) is not None:
                                self.on_cancel(generation_id)
                    next_cancel = started + _CANCEL_POLL
                if started >= next_heartbeat:
                    await self.store.heartbeat(self.owner, self.lease)
                    next_heartbeat = started + self.lease / 3
                if started >= next_takeover:
                    await self._take_over()
                    next_takeover = started + self.takeover_interval
                if started >= next_sweep:
                    swept = await self.store.sweep(self.ttl, self.max_attempts, self.takeover_grace)
                    for generation_id in swept:
                        logger.warning(
                            "generation %s interrupted: its owner is gone", generation_id
                        )
                    owed = await self.store.claim_owed(self.lease, _OWED_AT_ONCE)
                    for generation_id in owed:
                        logger.warning(
                            "generation %s: its owner died before writing its usage record; "
                            "an estimated one is written here",
                            generation_id,
                        )
                    if swept or owed:
                        self._swept(swept + owed)
                    next_sweep = started + self.sweep_interval
                if started >= next_reap:
                    while await self.store.reap(1000) == 1000:
                        pass
                    next_reap = started + self.reap_interval
                if self._failures:
                    logger.warning("%s is reachable again; pending output was written", self.url)
                self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._failures += 1
                self.output.written()
                if self.failure is not None:
                    pass  # said once, loudly, where it was found
                elif self._failures == 1 or self._failures % 100 == 0:
                    logger.warning(
                        "writing to %s failed (%s); output is kept in memory and retried",
                        self.url,
                        exc,
                    )
            retry = min(1.0, self.flush_interval * 4)
            delay = retry if self._failures else self._window.current
            await asyncio.sleep(max(0.0, started + delay - loop.time()))

    @property
    def flush_window(self) -> float:
        """The wait between two flushes as chosen last: ``flush_interval`` while the store
        keeps up, up to ``max_flush_interval`` under load."""
        return self._window.current

    async def flush(self) -> bool:
        """Write what is pending; True if it stopped at ``flush_max_bytes`` with more left."""
        _, more = await self._write_pending()
        return more

    async def _write_pending(self) -> tuple[int, bool]:
        """Write what is pending: the rows written, and whether more is left."""
        lock = self._flush_lock
        assert lock is not None
        async with lock:
            batch, more, done = self._pending.take(self.flush_max_bytes)
            if batch:
                try:
                    fenced = await self.store.flush(batch)
                except BaseException:
                    self._pending.failed(batch)
                    raise
                self._pending.committed(batch, done)
                for generation_id in fenced:
                    self._fenced(generation_id)
            return batch.rows(), more

    # -- takeover -------------------------------------------------------------------------

    async def _take_over(self) -> None:
        """Take over lapsed detached generations this process can continue, if it has room."""
        on_takeover = self.on_takeover
        room = self.max_takeovers - len(self.adopted)
        if on_takeover is None or not self.upstreams or not self.taking_over or room <= 0:
            return
        taken = await self.store.take_over(
            self.owner, self.lease, room, list(self.upstreams), self.max_attempts
        )
        for adopted in taken:
            logger.warning(
                "generation %s: its owner is gone; taken over here as attempt %d",
                adopted.id,
                adopted.attempt,
            )
            self.adopted.add(adopted.id)
            on_takeover(adopted)

    def _swept(self, ids: list[str]) -> None:
        on_swept = self.on_swept
        if on_swept is not None:
            try:
                on_swept(ids)
            except Exception:
                logger.exception("reporting interrupted generations failed")

    async def lost(self, ids: list[str]) -> list[Adopted]:
        """The store's rows of generations a sweep interrupted, or whose owed usage record
        their process died before writing: what that record is made of."""
        return await self.store.lost(ids)

    def paid(self, ids: list[str]) -> None:
        """The usage records ``ids`` owed are written (the next flush carries them), or
        were already: their marks are cleared with that flush."""
        self._pending.pay(ids)

    async def unregistered_upstreams(self) -> list[str]:
        """The upstreams running detached generations would be continued with that this
        process has no client for (``upstreams``): if their owners die, only a replica
        that has one can finish them."""
        await self._ensure_open()
        needed = await self.store.continued_upstreams()
        return sorted(set(needed) - set(self.upstreams))

    def adopt(self, generation: LiveLog, size: int) -> None:
        """Write what a taken-over ``generation`` appends after its stored ``size`` bytes."""
        self._pending.adopt(generation, size)
        generation.hold = self.output

    def adopted_ended(self, generation_id: str) -> None:
        self.adopted.discard(generation_id)

    async def settle_claims(self, generation_id: str, response: StoredResponse | None) -> None:
        """Settle the idempotency claims of a generation taken over here, once it ended:
        completed (a retry with the key replays its whole log) or released (it runs again)."""
        await self._ensure_open()
        encoded = None if response is None else encode_response(response)
        await self.store.settle_generation_claims(generation_id, encoded, self.ttl)

    def _fenced(self, generation_id: str) -> None:
        """Another process owns the generation now: nothing more of it is written from here,
        and its work here stops."""
        self._pending.drop(generation_id)
        logger.warning(
            "generation %s: another replica took it over; stopped here, nothing more of it "
            "is written from this process",
            generation_id,
        )
        on_fenced = self.on_fenced
        if on_fenced is not None:
            on_fenced(generation_id)

    async def read_all(self, generation_id: str, size: int) -> bytes:
        """The first ``size`` bytes of a generation, as the store holds them."""
        await self._ensure_open()
        parts: list[bytes] = []
        offset = 0
        while offset < size:
            data = await self.store.read(generation_id, offset, 1 << 20)
            if not data:
                raise BackendUnavailable(
                    f"{self.url} holds {offset} of the {size} bytes of generation {generation_id}"
                )
            parts.append(data)
            offset += len(data)
        return b"".join(parts)[:size]

    # -- reads --------------------------------------------------------------------------

    async def _ensure_open(self) -> None:
        if not self._opened:
            await self.open()

    # -- session pins: straight to the store, one statement each -----------------------

    async def pin_session(self, principal: str, session_id: str, provider: str, ttl: float) -> str:
        await self._ensure_open()
        try:
            return await self.store.pin_session(principal, session_id, provider, ttl)
        except Exception as exc:
            raise BackendUnavailable(f"session pins at {self.url}: {exc}") from exc

    async def end_session(self, principal: str, session_id: str) -> bool:
        await self._ensure_open()
        try:
            return await self.store.end_session(principal, session_id)
        except Exception as exc:
            raise BackendUnavailable(f"session pins at {self.url}: {exc}") from exc

    async def request_cancel(self, generation_id: str) -> bool:
        generation = self._pending.live(generation_id)
        if generation is not None:
            on_cancel = self.on_cancel
            return on_cancel is not None and generation.running and on_cancel(generation_id)
        await self._ensure_open()
        return await self.store.request_cancel(generation_id)

    def produces(self, generation_id: str) -> bool:
        """Whether this process produces the generation: its live log is ahead of the store."""
        return self._pending.live(generation_id) is not None

    async def get(self, generation_id: str) -> GenerationInfo | None:
        generation = self._pending.live(generation_id)
        if generation is not None:
            return generation.info()
        await self._ensure_open()
        found = await self.store.info(generation_id)
        return None if found is None else found[0]

    async def recent(self, limit: int = 20, status: str | None = None) -> list[GenerationInfo]:
        """The newest generations (``status``: only those), as the store has them."""
        await self._ensure_open()
        return await self.store.recent(limit, status)

    async def principal_of(self, generation_id: str) -> str | None:
        generation = self._pending.live(generation_id)
        if generation is not None:
            return generation.principal
        await self._ensure_open()
        found = await self.store.info(generation_id)
        return None if found is None else found[1]

    async def follow(self, generation_id: str, offset: int) -> AsyncGenerator[bytes, None]:
        generation = self._pending.live(generation_id)
        if generation is not None:
            # Produced here: read the live log, which is ahead of the database; what it
            # released is in the database.

            async def released(start: int) -> bytes:
                data = await self.store.read(generation_id, start, 1 << 20)
                if not data:
                    raise BackendUnavailable(
                        f"{self.url} lost bytes {start}.. of generation {generation_id}"
                    )
                return data

            async for data in generation.follow(offset, released):
                yield data
            return
        await self._ensure_open()
        async for data in self._tails.follow(generation_id, offset):
            yield data

    async def wait_for_size(
        self, info: GenerationInfo, size: int, timeout: float
    ) -> GenerationInfo:
        generation = self._pending.live(info.id)
        if generation is not None:
            return generation.info()
        await self._ensure_open()
        # The generation's tail, shared with its other readers, watches the store for it.
        state = await self._tails.wait_for_size(info.id, size, timeout)
        if state is None:
            return info
        return msgspec.structs.replace(info, status=Status(state[0]), size=state[1])

    @property
    def failure(self) -> str | None:
        """Why the store refuses every write from now on (its file was deleted), or None."""
        return self.store.failure

    @property
    def healthy(self) -> bool:
        """False once the store refuses writes for good: generations stay in this process's
        memory, and claims and other writes raise ``BackendUnavailable``."""
        return self.failure is None

    def pending_bytes(self) -> int:
        """Bytes produced in this process and not yet durable."""
        return self._pending.pending_bytes()


def _log_open_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("opening the backend failed: %s", task.exception())
