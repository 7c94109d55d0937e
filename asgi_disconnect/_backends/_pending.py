"""What a durable backend has not written yet, and the batch one flush writes of it."""

from __future__ import annotations

import logging
import secrets
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from .._records import UsageRecord

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .._contract import LiveLog

__all__ = ["FlushBatch", "PendingWrites", "UsageRow", "usage_row"]

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
    # (id, upstream, continuation): what another replica needs to finish it (a detached
    # relay opened with ``open_stream(..., continuation=...)``)
    continued: list[tuple[str, str, bytes]] = field(default_factory=list)
    # ids handed over (a drain): their rows lose their owner, for another replica to take
    released: list[str] = field(default_factory=list)
    # (id, status, size, error, finished_at, record owed): a generation that ends before
    # its usage record is written (it waits on the client's TCP) keeps its lease, renewed
    # by the heartbeat, until ``paid`` says the record is written or none is due; a sweep
    # writes an estimated one for a mark whose lease lapsed (its process died).
    finished: list[tuple[str, str, int, str | None, float, bool]] = field(default_factory=list)
    # ids whose owed usage record is written, or not due
    paid: list[str] = field(default_factory=list)
    # (generation_id, principal, route, outcome, input_tokens, output_tokens, usage_source,
    #  the whole record as JSON, request id): a flush that may have committed is sent again,
    #  and the request id keeps its record once
    usage: list[UsageRow] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.created
            or self.chunks
            or self.changed
            or self.continued
            or self.released
            or self.finished
            or self.usage
            or self.paid
        )

    def rows(self) -> int:
        """How many rows the flush writes."""
        return (
            len(self.created)
            + len(self.chunks)
            + len(self.changed)
            + len(self.continued)
            + len(self.released)
            + len(self.finished)
            + len(self.usage)
            + len(self.paid)
        )

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
        # One record per request: its generation id (and attempt, after a takeover), or
        # (metering alone) an id of its own.
        _request_id(record),
    )


def _request_id(record: UsageRecord) -> str:
    generation_id = record.generation_id
    if generation_id is None:
        return "req_" + secrets.token_hex(12)
    return generation_id if record.attempt == 1 else f"{generation_id}#{record.attempt}"


class _Tracked:
    """A live generation and how much of it is already durable."""

    __slots__ = ("chunks", "continued", "created", "generation", "meta", "size", "unsure")

    def __init__(self, generation: LiveLog, *, size: int = 0, chunks: int = 0) -> None:
        self.generation = generation
        # An adopted generation (taken over) exists in the store with ``size`` bytes.
        self.created = size > 0 or chunks > 0
        self.chunks = chunks
        self.size = size
        self.continued = False
        self.meta: tuple[str | None, bool] = (generation.policy, generation.detached)
        # Chunk rows (start, data, sizes) of a flush that failed or was cancelled, which
        # may have committed all the same: sent again exactly as they were, so that ``on
        # conflict do nothing`` keeps them once and a longer row never replaces them.
        self.unsure: list[tuple[int, bytes, bytes]] = []


class PendingWrites:
    """What this process produced and the store does not hold yet: each live generation
    (and how much of it is durable) and the usage records. ``take`` makes the batch of
    one flush; ``committed`` and ``failed`` say how that flush went.

    ``len()`` is the number of live generations not yet written to their end. While the
    store is down, at most ``max_usage`` usage records wait; past that the oldest are
    dropped, and ``usage_dropped`` counts them.
    """

    def __init__(self, *, owner: str, lease: float, ttl: float, max_usage: int, url: str) -> None:
        self.owner = owner
        self.lease = lease
        self.ttl = ttl
        self.max_usage = max_usage
        self.usage_dropped = 0
        self._url = url
        self._live: dict[str, _Tracked] = {}
        self._usage: list[UsageRow] = []
        # Written to their end with their usage record still owed (see FlushBatch.finished),
        # and the ids whose owed record is written or not due, for the next flush.
        self._owing: dict[str, LiveLog] = {}
        self._paid: list[str] = []

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[LiveLog]:
        """The live generations not yet written to their end."""
        return (tracked.generation for tracked in list(self._live.values()))

    def track(self, generation: LiveLog) -> None:
        self._live[generation.id] = _Tracked(generation)

    def adopt(self, generation: LiveLog, size: int) -> None:
        """Track a generation taken over: its row and its first ``size`` bytes are stored
        (its log's first slot stands for them), so only what it appends is written."""
        tracked = _Tracked(generation, size=size, chunks=1)
        tracked.created = True
        tracked.continued = True
        self._live[generation.id] = tracked

    def drop(self, generation_id: str) -> LiveLog | None:
        """Forget a generation another process now owns (fenced): nothing of it is written."""
        tracked = self._live.pop(generation_id, None)
        return None if tracked is None else tracked.generation

    def live(self, generation_id: str) -> LiveLog | None:
        """The generation, if this process produces it and it is not all written yet."""
        tracked = self._live.get(generation_id)
        return None if tracked is None else tracked.generation

    def pay(self, generation_ids: list[str]) -> None:
        """The usage records owed for ``generation_ids`` are written (with the next flush,
        which carries them), or none is due: their marks are cleared with it."""
        self._paid.extend(generation_ids)

    def pending_bytes(self) -> int:
        return sum(t.generation.size - t.size for t in self._live.values())

    def add_usage(self, record: UsageRecord) -> None:
        self._usage.append(usage_row(record))
        if len(self._usage) > self.max_usage:
            self._drop_usage()

    def usage_of(self, generation_id: str) -> list[bytes]:
        """The generation's usage records not written yet, as JSON."""
        return [row[7] for row in self._usage if row[0] == generation_id]

    def _drop_usage(self) -> None:
        over = len(self._usage) - self.max_usage
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
                self._url,
                self.max_usage,
                self.usage_dropped + over,
            )
        self.usage_dropped += over

    def take(self, budget: int) -> tuple[FlushBatch, bool, list[_Tracked]]:
        """What the next flush writes: the usage records, and about ``budget`` bytes of new
        chunks; whether more chunks are left; the generations it writes to their end."""
        batch = FlushBatch(owner=self.owner, lease=self.lease, ttl=self.ttl)
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
            if not tracked.continued and generation.continuation is not None:
                upstream, continuation = generation.continuation
                batch.continued.append((generation.id, upstream, continuation))
            if not running and complete:
                if generation.handed_over:
                    batch.released.append(generation.id)
                else:
                    info = generation.info()
                    assert info.finished_at is not None
                    batch.finished.append(
                        (
                            info.id,
                            info.status.value,
                            start,
                            info.error,
                            info.finished_at,
                            generation.record_owed,
                        )
                    )
                done.append(tracked)
        for generation_id, generation in list(self._owing.items()):
            if not generation.record_owed:
                self._paid.append(generation_id)
                del self._owing[generation_id]
        batch.usage, self._usage = self._usage, []
        batch.paid, self._paid = self._paid, []
        return batch, more, done

    def committed(self, batch: FlushBatch, done: list[_Tracked]) -> None:
        """``batch`` is durable: count it, and forget the generations it ``done``."""
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
        for generation_id, _, _ in batch.continued:
            tracked = self._live.get(generation_id)
            if tracked is not None:
                tracked.continued = True
        owed = {row[0] for row in batch.finished if row[5]}
        for tracked in done:
            generation = self._live.pop(tracked.generation.id, tracked).generation
            if generation.id in owed:
                self._owing[generation.id] = generation

    def failed(self, batch: FlushBatch) -> None:
        """Writing ``batch`` failed, or was cancelled, and may have committed all the same:
        its usage records wait again, and its chunk rows are sent again as they were."""
        self._usage[:0] = batch.usage
        self._drop_usage()
        self._paid[:0] = batch.paid
        for generation_id, start, data, sizes in batch.chunks:
            tracked = self._live.get(generation_id)
            if tracked is None:
                continue
            unsure = tracked.unsure
            if not unsure or start >= unsure[-1][0] + len(unsure[-1][1]):
                unsure.append((start, data, sizes))
