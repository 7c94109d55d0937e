"""What the SQLite and PostgreSQL backends share: batched flushes, leases, sweeps, tails."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from .._errors import BackendUnavailable
from .._records import Claim, ClaimState, GenerationInfo, Status, StoredResponse, UsageRecord

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable

    from .._contract import LiveLog


__all__ = ["DurableBackend", "FlushBatch", "SQLStore"]

logger = logging.getLogger("asgi_disconnect")


@dataclass
class FlushBatch:
    """Everything one flush writes, in one transaction."""

    owner: str
    lease: float
    ttl: float
    # (id, principal, status_code, content_type, policy, detached, created_at)
    created: list[tuple[str, str, int, str | None, str | None, bool, float]] = field(
        default_factory=list
    )
    # (generation_id, start, data, sizes): the chunks one generation produced since the
    # last flush, joined into one row; ``sizes`` keeps their boundaries (uint32 array).
    chunks: list[tuple[str, int, bytes, bytes]] = field(default_factory=list)
    # (id, policy, detached)
    changed: list[tuple[str, str | None, bool]] = field(default_factory=list)
    # (id, status, size, error, finished_at)
    finished: list[tuple[str, str, int, str | None, float]] = field(default_factory=list)
    # (generation_id, principal, route, outcome, input_tokens, output_tokens, usage_source,
    #  the whole record as JSON, request id): a flush that may have committed is sent again,
    #  and the request id keeps its record once
    usage: list[UsageRow] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.created or self.chunks or self.changed or self.finished or self.usage)

    def touched(self) -> set[str]:
        ids = {row[0] for row in self.chunks}
        ids.update(row[0] for row in self.finished)
        ids.update(row[0] for row in self.changed)
        return ids


UsageRow = tuple[str | None, str | None, str, str, int | None, int | None, str, bytes, str]


def usage_row(record: UsageRecord) -> UsageRow:
    return (
        record.generation_id,
        record.principal,
        record.route,
        record.outcome,
        record.input_tokens,
        record.output_tokens,
        record.usage_source,
        msgspec.json.encode(record),
        # One record per request: its generation id, or (metering alone) an id of its own.
        record.generation_id or "req_" + secrets.token_hex(12),
    )


def encode_response(response: StoredResponse) -> bytes:
    return msgspec.msgpack.encode(response)


def info_from_row(row: Any) -> tuple[GenerationInfo, str]:
    """A generation row (id, status, policy, size, status_code, content_type, created_at,
    finished_at, detached, error, principal) as its info and its principal."""
    return (
        GenerationInfo(
            id=row[0],
            status=Status(row[1]),
            policy=row[2],
            size=row[3],
            status_code=row[4],
            content_type=row[5],
            created_at=row[6],
            finished_at=row[7],
            detached=bool(row[8]),
            error=row[9],
        ),
        row[10],
    )


def join_from(rows: Any, offset: int, limit: int) -> bytes:
    """Chunk rows (start, data), in order, joined from byte ``offset``; about ``limit`` bytes."""
    parts: list[bytes] = []
    total = 0
    for start, data in rows:
        data = bytes(data)
        if start < offset:
            data = data[offset - start :]
        if not data:
            continue
        parts.append(data)
        total += len(data)
        if total >= limit:
            break
    return b"".join(parts)


def claim_from_row(row: Any, fingerprint: bytes) -> Claim:
    """Read a claim someone else holds: (status, fingerprint, seconds left, response, gen)."""
    if row is None:
        # Released between our insert and our read: the next attempt may take it.
        return Claim(state=ClaimState.RUNNING, retry_after=0.0)
    status, stored_fingerprint, left, response, generation_id = row
    if bytes(stored_fingerprint) != fingerprint:
        return Claim(state=ClaimState.MISMATCH)
    if status == "completed":
        stored = msgspec.msgpack.decode(bytes(response), type=StoredResponse)
        return Claim(state=ClaimState.COMPLETED, response=stored, generation_id=generation_id)
    return Claim(
        state=ClaimState.RUNNING,
        retry_after=max(0.0, float(left or 0.0)),
        generation_id=generation_id,
    )


class SQLStore(Protocol):
    """The database half of a durable backend."""

    url: str
    poll_interval: float

    @property
    def failure(self) -> str | None:
        """Why the store refuses every write from now on (its file was deleted), or None."""

    async def open(self) -> None: ...
    async def aclose(self) -> None: ...
    async def flush(self, batch: FlushBatch) -> None: ...
    async def heartbeat(self, owner: str, lease: float) -> None: ...
    async def renew_claims(self, owner: str, lease: float) -> None: ...
    async def sweep(self, ttl: float) -> list[str]: ...
    async def reap(self, limit: int) -> int: ...
    async def info(self, generation_id: str) -> tuple[GenerationInfo, str] | None: ...
    async def recent(self, limit: int, status: str | None) -> list[GenerationInfo]: ...
    async def read(self, generation_id: str, offset: int, limit: int) -> bytes: ...
    async def usage(self, generation_id: str) -> list[bytes]: ...
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
    async def complete_claim(
        self, principal: str, key: str, *, owner: str, response: StoredResponse, ttl: float
    ) -> bool: ...
    async def release_claim(self, principal: str, key: str, *, owner: str) -> bool: ...
    async def note_generation(
        self, principal: str, key: str, *, owner: str, generation_id: str
    ) -> None: ...
    async def changed(self, generation_id: str, timeout: float) -> None: ...
    async def request_cancel(self, generation_id: str) -> bool: ...
    async def cancel_requests(self, owner: str) -> list[str]: ...
    async def pin_session(
        self, principal: str, session_id: str, provider: str, ttl: float
    ) -> str: ...
    async def end_session(self, principal: str, session_id: str) -> bool: ...


@runtime_checkable
class ChangeNotices(Protocol):
    """A store whose one poller tells each live tail when its generation moved on (SQLite)."""

    async def changed_from(
        self, generation_id: str, seen: tuple[str, int], timeout: float
    ) -> tuple[str, int] | None:
        """Wait until (status, size) moved on from ``seen``; what it is now, or None."""


# With change notices, a tail asks the store again unprompted only as a safety net.
_NOTICE_TIMEOUT = 1.0
# How often a process asks the store whether an owner wants one of its generations stopped.
_CANCEL_POLL = 0.25


class _Tail:
    """A generation produced elsewhere, followed once for every reader in this process.

    One task looks at the store when it changed and reads what it gained; the latest piece
    read stays here, so readers that kept up take it without a query. A reader behind the
    piece reads the store on its own until it catches up.
    """

    __slots__ = ("end", "error", "final", "gone", "piece", "readers", "ready", "start", "waiters")

    def __init__(self) -> None:
        self.start = 0  # the latest piece spans [start, end)
        self.end = 0
        self.piece = b""
        self.ready = False  # the first look at the store is done
        self.final = False  # it ended and every byte of it was read
        self.gone = False  # unknown or expired
        self.error: BaseException | None = None
        self.readers = 0
        self.waiters: list[asyncio.Future[None]] = []

    def changed(self) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        return waiter

    def wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class _Tracked:
    """A live generation and how much of it is already durable."""

    __slots__ = ("chunks", "created", "generation", "meta", "size", "unsure")

    def __init__(self, generation: LiveLog) -> None:
        self.generation = generation
        self.created = False
        self.chunks = 0
        self.size = 0
        self.meta: tuple[str | None, bool] = (generation.policy, generation.detached)
        # Chunk rows (start, data, sizes) of a flush that failed or was cancelled, which
        # may have committed all the same: sent again exactly as they were, so that ``on
        # conflict do nothing`` keeps them once and a longer row never replaces them.
        self.unsure: list[tuple[int, bytes, bytes]] = []


class DurableBackend:
    """Persists live generations chunk by chunk, at most ``flush_interval`` behind.

    Writes are batched: every ``flush_interval`` seconds (and at once again while more than
    ``flush_max_bytes`` are pending) one transaction inserts new generations, their new
    chunks and their final status. A ``kill -9`` loses at most the output of the last
    flush interval plus the flush then under way. Each running generation holds a lease
    that a heartbeat renews, judged by the database's clock; a sweep marks generations
    whose owner stopped renewing as ``interrupted``. Finished generations expire ``ttl``
    seconds after they end and a reaper deletes them in batches.
    """

    def __init__(
        self,
        store: SQLStore,
        *,
        flush_interval: float = 0.05,
        flush_max_bytes: int = 1 << 20,
        lease: float = 15.0,
        sweep_interval: float = 5.0,
        ttl: float = 24 * 3600.0,
        reap_interval: float = 60.0,
        max_pending_usage: int = 100_000,
    ) -> None:
        if not 0 < flush_interval <= 5:
            raise ValueError("flush_interval must be in (0, 5] seconds")
        if flush_max_bytes <= 0:
            raise ValueError("flush_max_bytes must be positive")
        if lease <= 3 * flush_interval:
            raise ValueError("lease must be longer than three flush intervals")
        if ttl <= 0 or sweep_interval <= 0 or reap_interval <= 0 or max_pending_usage <= 0:
            raise ValueError(
                "ttl, sweep_interval, reap_interval and max_pending_usage must be positive"
            )
        self.max_pending_usage = max_pending_usage
        self.usage_dropped = 0
        self.store = store
        self.url = store.url
        self.flush_interval = flush_interval
        self.flush_max_bytes = flush_max_bytes
        self.lease = lease
        self.sweep_interval = sweep_interval
        self.ttl = ttl
        self.reap_interval = reap_interval
        self.owner = secrets.token_hex(8)
        self._live: dict[str, _Tracked] = {}
        self._opened = False
        self._opening: asyncio.Task[None] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._flush_lock: asyncio.Lock | None = None
        self._failures = 0
        self._usage: list[UsageRow] = []
        self._tails: dict[str, tuple[_Tail, asyncio.Task[None]]] = {}
        self._notices = store if isinstance(store, ChangeNotices) else None
        self.on_cancel: Callable[[str], bool] | None = None

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
            interrupted = await self.store.sweep(self.ttl)
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
        await self._stop_tails()
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
        self._usage.append(usage_row(record))
        if len(self._usage) > self.max_pending_usage:
            self._drop_usage()

    def _drop_usage(self) -> None:
        over = len(self._usage) - self.max_pending_usage
        if over <= 0:
            return
        del self._usage[:over]
        if (
            not self.usage_dropped
            or self.usage_dropped // 1000 < (self.usage_dropped + over) // 1000
        ):
            logger.error(
                "%s is unreachable and %d usage records wait in memory: dropped the oldest "
                "(%d so far); they are still in every other sink",
                self.url,
                self.max_pending_usage,
                self.usage_dropped + over,
            )
        self.usage_dropped += over

    async def usage_of(self, generation_id: str) -> list[UsageRecord]:
        """The usage records stored for a generation (normally one)."""

        await self._ensure_open()
        rows = await self.store.usage(generation_id)
        pending = [row[7] for row in self._usage if row[0] == generation_id]
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
        self._live[generation.id] = _Tracked(generation)
        if not self._opened and self._opening is None:
            # No lifespan ran: open on first use.
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(_log_open_failure)

    # -- the background worker ----------------------------------------------------------

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        next_heartbeat = next_sweep = next_cancel = loop.time()
        next_reap = loop.time() + self.reap_interval
        while True:
            started = loop.time()
            try:
                while await self.flush():
                    pass
                if started >= next_cancel:
                    if self._live and self.on_cancel is not None:
                        for generation_id in await self.store.cancel_requests(self.owner):
                            if generation_id in self._live:
                                self.on_cancel(generation_id)
                    next_cancel = started + _CANCEL_POLL
                if started >= next_heartbeat:
                    await self.store.heartbeat(self.owner, self.lease)
                    next_heartbeat = started + self.lease / 3
                if started >= next_sweep:
                    for generation_id in await self.store.sweep(self.ttl):
                        logger.warning(
                            "generation %s interrupted: its owner is gone", generation_id
                        )
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
                if self.failure is not None:
                    pass  # said once, loudly, where it was found
                elif self._failures == 1 or self._failures % 100 == 0:
                    logger.warning(
                        "writing to %s failed (%s); output is kept in memory and retried",
                        self.url,
                        exc,
                    )
            delay = self.flush_interval if not self._failures else min(1.0, self.flush_interval * 4)
            await asyncio.sleep(max(0.0, started + delay - loop.time()))

    async def flush(self) -> bool:
        """Write what is pending; True if it stopped at ``flush_max_bytes`` with more left."""
        lock = self._flush_lock
        assert lock is not None
        async with lock:
            batch, more, done = self._collect()
            usage, self._usage = self._usage, []
            batch.usage = usage
            if batch:
                try:
                    await self.store.flush(batch)
                except BaseException:
                    self._usage[:0] = usage
                    self._drop_usage()
                    self._unsure(batch)
                    raise
                self._committed(batch, done)
            return more

    def _unsure(self, batch: FlushBatch) -> None:
        for generation_id, start, data, sizes in batch.chunks:
            tracked = self._live.get(generation_id)
            if tracked is None:
                continue
            unsure = tracked.unsure
            if not unsure or start >= unsure[-1][0] + len(unsure[-1][1]):
                unsure.append((start, data, sizes))

    def _collect(self) -> tuple[FlushBatch, bool, list[_Tracked]]:
        batch = FlushBatch(owner=self.owner, lease=self.lease, ttl=self.ttl)
        budget = self.flush_max_bytes
        more = False
        done: list[_Tracked] = []
        for tracked in list(self._live.values()):
            generation = tracked.generation
            # Read the status first: a generation that ends meanwhile is flushed next time.
            running = generation.running
            if not tracked.created:
                info = generation.info()
                batch.created.append(
                    (
                        info.id,
                        generation.principal,
                        info.status_code,
                        info.content_type,
                        info.policy,
                        info.detached,
                        info.created_at,
                    )
                )
            count = generation.chunk_count
            start = tracked.size
            taken = tracked.chunks
            for row in tracked.unsure:
                batch.chunks.append((generation.id, *row))
                budget -= len(row[1])
                start = row[0] + len(row[1])
                taken += len(row[2]) // 4
            pending = generation.chunks_from(taken)[: count - taken]
            if pending and budget > 0:
                taken_chunks = pending
                size = 0
                for index, chunk in enumerate(pending):
                    size += len(chunk)
                    if size >= budget:
                        taken_chunks = pending[: index + 1]
                        break
                budget -= size
                data = taken_chunks[0] if len(taken_chunks) == 1 else b"".join(taken_chunks)
                sizes = array("I", [len(chunk) for chunk in taken_chunks]).tobytes()
                batch.chunks.append((generation.id, start, data, sizes))
                start += len(data)
                pending = pending[len(taken_chunks) :]
            if pending:
                more = True
            complete = not pending
            meta = (generation.policy, generation.detached)
            if tracked.created and meta != tracked.meta:
                batch.changed.append((generation.id, meta[0], meta[1]))
            if not running and complete:
                info = generation.info()
                assert info.finished_at is not None
                batch.finished.append(
                    (info.id, info.status.value, start, info.error, info.finished_at)
                )
                done.append(tracked)
        return batch, more, done

    def _committed(self, batch: FlushBatch, done: list[_Tracked]) -> None:
        ends: dict[str, tuple[int, int]] = {}
        for generation_id, start, data, sizes in batch.chunks:
            count, _ = ends.get(generation_id, (0, 0))
            ends[generation_id] = (count + len(sizes) // 4, start + len(data))
        for row in batch.created:
            tracked = self._live.get(row[0])
            if tracked is not None:
                tracked.created = True
                tracked.meta = (row[4], row[5])
        for generation_id, (count, end) in ends.items():
            tracked = self._live.get(generation_id)
            if tracked is not None:
                tracked.chunks += count
                tracked.size = end
                tracked.unsure = []
                # Memory lets go of what is durable and its own client no longer needs.
                tracked.generation.stored(end)
        for generation_id, policy, detached in batch.changed:
            tracked = self._live.get(generation_id)
            if tracked is not None:
                tracked.meta = (policy, detached)
        for tracked in done:
            self._live.pop(tracked.generation.id, None)

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
        tracked = self._live.get(generation_id)
        if tracked is not None:
            on_cancel = self.on_cancel
            return on_cancel is not None and tracked.generation.running and on_cancel(generation_id)
        await self._ensure_open()
        return await self.store.request_cancel(generation_id)

    def produces(self, generation_id: str) -> bool:
        """Whether this process produces the generation: its live log is ahead of the store."""
        return generation_id in self._live

    async def get(self, generation_id: str) -> GenerationInfo | None:
        tracked = self._live.get(generation_id)
        if tracked is not None:
            return tracked.generation.info()
        await self._ensure_open()
        found = await self.store.info(generation_id)
        return None if found is None else found[0]

    async def recent(self, limit: int = 20, status: str | None = None) -> list[GenerationInfo]:
        """The newest generations (``status``: only those), as the store has them."""
        await self._ensure_open()
        return await self.store.recent(limit, status)

    async def principal_of(self, generation_id: str) -> str | None:
        tracked = self._live.get(generation_id)
        if tracked is not None:
            return tracked.generation.principal
        await self._ensure_open()
        found = await self.store.info(generation_id)
        return None if found is None else found[1]

    async def follow(self, generation_id: str, offset: int) -> AsyncGenerator[bytes, None]:
        tracked = self._live.get(generation_id)
        if tracked is not None:
            # Produced here: read the live log, which is ahead of the database; what it
            # released is in the database.

            async def released(start: int) -> bytes:
                data = await self.store.read(generation_id, start, 1 << 20)
                if not data:
                    raise BackendUnavailable(
                        f"{self.url} lost bytes {start}.. of generation {generation_id}"
                    )
                return data

            async for data in tracked.generation.follow(offset, released):
                yield data
            return
        await self._ensure_open()
        entry = self._tails.get(generation_id)
        if entry is None or entry[0].error is not None:
            tail = _Tail()
            task = asyncio.ensure_future(self._poll_tail(generation_id, tail))
            entry = self._tails[generation_id] = (tail, task)
        tail, task = entry
        tail.readers += 1
        try:
            while True:
                if tail.error is not None:
                    raise BackendUnavailable(
                        f"following {generation_id} in {self.url} failed: {tail.error}"
                    ) from tail.error
                if not tail.ready:
                    data = b""
                elif tail.start <= offset < tail.end:
                    data = tail.piece[offset - tail.start :]
                elif offset < tail.start:
                    # Behind the shared piece: catch up on its own.
                    data = await self.store.read(generation_id, offset, 1 << 20)
                    if not data:
                        return  # its rows are gone: expired and reaped
                else:
                    data = b""
                if data:
                    offset += len(data)
                    yield data
                    continue
                if tail.gone or (tail.final and offset >= tail.end):
                    return
                await tail.changed()
        finally:
            tail.readers -= 1
            if not tail.readers and self._tails.get(generation_id) is entry:
                del self._tails[generation_id]
                task.cancel()

    async def _poll_tail(self, generation_id: str, tail: _Tail) -> None:
        """Look at the store for ``tail`` each time it changed; read what it gained, once."""
        store = self.store
        # (status, size) as a change notice gave it; None: ask the store.
        state: tuple[str, int] | None = None
        try:
            while True:
                if state is None:
                    found = await store.info(generation_id)
                    if found is None:
                        tail.gone = True
                        return
                    state = (found[0].status.value, found[0].size)
                status, size = state
                if not tail.ready:
                    # Readers read what is stored so far themselves, from their own offsets.
                    tail.start = tail.end = size
                    tail.ready = True
                    tail.wake()
                while tail.end < size:
                    data = await store.read(generation_id, tail.end, 1 << 20)
                    if not data:
                        break  # expired meanwhile, or rows short of the size
                    tail.start, tail.piece = tail.end, data
                    tail.end += len(data)
                    tail.wake()
                # The final status and the last rows are written in one transaction.
                if status != Status.RUNNING:
                    if tail.end < size:
                        logger.warning(
                            "generation %s is stored as %d bytes but its rows end at %d",
                            generation_id,
                            size,
                            tail.end,
                        )
                    tail.final = True
                    return
                if self._notices is not None:
                    state = await self._notices.changed_from(generation_id, state, _NOTICE_TIMEOUT)
                else:
                    await store.changed(generation_id, store.poll_interval)
                    state = None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            tail.error = exc
        finally:
            tail.wake()

    async def _stop_tails(self) -> None:
        tails, self._tails = self._tails, {}
        for tail, task in tails.values():
            task.cancel()
            tail.error = BackendUnavailable(f"{self.url} was closed")
        await asyncio.gather(*(task for _, task in tails.values()), return_exceptions=True)
        for tail, _ in tails.values():
            tail.wake()

    @property
    def failure(self) -> str | None:
        """Why the store refuses every write from now on (its file was deleted), or None."""
        return self.store.failure

    @property
    def healthy(self) -> bool:
        """False once the store refuses writes for good: generations stay in this process's
        memory, and claims and other writes raise :class:`BackendUnavailable`."""
        return self.failure is None

    def pending_bytes(self) -> int:
        """Bytes produced in this process and not yet durable."""
        return sum(t.generation.size - t.size for t in self._live.values())


def _log_open_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("opening the backend failed: %s", task.exception())
