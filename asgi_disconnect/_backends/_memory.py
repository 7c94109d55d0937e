"""In-memory backend: one process, not durable; for tests and development."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any

from .._records import Claim, ClaimState, StoredResponse

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Callable

    from .._contract import LiveLog
    from .._records import GenerationInfo, UsageRecord

__all__ = ["MemoryBackend"]

logger = logging.getLogger("asgi_disconnect")

# What a kept chunk costs beyond its bytes: the bytes object's header, its slot in the
# list and its offset, so that many small chunks are not undercounted.
_CHUNK_COST = 64
# How often claims are scanned for expiry beyond the oldest completed ones.
_CLAIM_SWEEP = 60.0


def _cost(size: int, chunks: int) -> int:
    return size + _CHUNK_COST * chunks


class _MemoryClaim:
    __slots__ = (
        "completed_at",
        "expires_at",
        "fingerprint",
        "generation_id",
        "lease_until",
        "owner",
        "response",
    )

    def __init__(self, fingerprint: bytes, owner: str, lease_until: float, expires_at: float):
        self.fingerprint = fingerprint
        self.owner = owner
        self.lease_until = lease_until
        self.expires_at = expires_at
        self.response: StoredResponse | None = None
        self.generation_id: str | None = None
        self.completed_at = 0.0  # Unix seconds, to order it among finished generations

    def dead(self, now: float) -> bool:
        """Past its expiry, and not running under a live lease."""
        return self.expires_at < now and (self.response is not None or self.lease_until < now)


class MemoryBackend:
    """Keeps generations and claims in this process, within bounds.

    What finished work keeps is bounded by ``max_bytes`` (default 64 MiB): the bodies of
    finished generations and the responses stored by completed claims, each counted as its
    bytes plus 64 per chunk (``kept_bytes``). Past it, the oldest finished work is evicted
    first; a generation larger than ``max_bytes`` alone is not kept once it ends, and evicts
    nothing (a warning says so, once). At most ``max_generations`` generations and
    ``max_claims`` claims are kept, the oldest finished (completed) evicted first. Finished
    generations expire ``ttl`` seconds after they end; claims at the ``ttl`` their
    middleware gives them.

    Running generations are never evicted and not counted: their log is what their clients
    are reading. When running ones alone hold more than ``max_bytes``, the process holds
    that much until they end; each then counts as finished work and evicts the oldest.
    A reader already following an evicted generation reads it to the end. A running claim
    is never evicted while its lease is live.
    """

    # Not shared with another process: nothing of it is ever behind.
    flush_interval: float | None = None

    url = "memory://"
    on_cancel: Callable[[str], bool] | None = None

    def __init__(
        self,
        *,
        ttl: float = 3600.0,
        max_generations: int = 10_000,
        max_bytes: int = 64 << 20,
        max_claims: int = 10_000,
        max_pins: int = 100_000,
    ) -> None:
        for name, value in (
            ("ttl", ttl),
            ("max_generations", max_generations),
            ("max_bytes", max_bytes),
            ("max_claims", max_claims),
            ("max_pins", max_pins),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be positive")
        self._ttl = ttl
        self._max = max_generations
        self.max_bytes = max_bytes
        self._max_claims = max_claims
        self._generations: dict[str, LiveLog] = {}
        self.usage: deque[UsageRecord] = deque(maxlen=max_generations)
        self._claims: dict[tuple[str, str], _MemoryClaim] = {}
        # (principal, session) -> [provider, expires at (monotonic)]
        self._pins: dict[tuple[str, str], list[Any]] = {}
        self._max_pins = max_pins
        # Finished work, oldest first, and what each costs: generations, completed claims.
        self._finished: OrderedDict[str, int] = OrderedDict()
        self._completed: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._kept_bytes = 0
        self._next_claim_sweep = 0.0
        self._next_expiry = 0.0
        self._warned_oversize = False
        # Bound once: register() hands it to every generation.
        self._on_finish = self._generation_finished

    def __repr__(self) -> str:
        return (
            f"<MemoryBackend memory://: {len(self._generations)} generation(s), "
            f"{len(self._claims)} claim(s), {self._kept_bytes} of {self.max_bytes} bytes kept, "
            f"ttl={self._ttl:g}s>"
        )

    @property
    def kept_bytes(self) -> int:
        """What finished generations and completed claims keep now, by this backend's count."""
        return self._kept_bytes

    @property
    def claim_count(self) -> int:
        """The claims kept now, running and completed."""
        return len(self._claims)

    async def open(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    # -- claims (the monotonic clock stands in for a database's) --------------------

    async def claim(
        self, principal: str, key: str, fingerprint: bytes, *, owner: str, lease: float, ttl: float
    ) -> Claim:
        now = time.monotonic()
        self._expire_claims(now)
        held = self._claims.get((principal, key))
        if held is not None and held.expires_at >= now:
            if held.fingerprint != fingerprint:
                return Claim(state=ClaimState.MISMATCH)
            if held.response is not None:
                return Claim(
                    state=ClaimState.COMPLETED,
                    response=held.response,
                    generation_id=held.response.generation_id,
                )
            if held.lease_until >= now:
                return Claim(
                    state=ClaimState.RUNNING,
                    retry_after=held.lease_until - now,
                    generation_id=held.generation_id,
                )
        if held is not None:
            self._drop_claim((principal, key))
        self._claims[(principal, key)] = _MemoryClaim(fingerprint, owner, now + lease, now + ttl)
        if len(self._claims) > self._max_claims:
            self._evict_claims()
        return Claim(state=ClaimState.ACQUIRED)

    async def renew_claims(self, owner: str, lease: float) -> None:
        deadline = time.monotonic() + lease
        for held in self._claims.values():
            if held.response is None and held.owner == owner:
                held.lease_until = deadline

    async def complete_claim(
        self, principal: str, key: str, *, owner: str, response: StoredResponse, ttl: float
    ) -> bool:
        held = self._claims.get((principal, key))
        if held is None or held.owner != owner or held.response is not None:
            return False
        held.response = response
        held.expires_at = time.monotonic() + ttl
        held.completed_at = time.time()
        cost = _cost(sum(map(len, response.chunks)), len(response.chunks))
        self._completed[(principal, key)] = cost
        self._kept_bytes += cost
        if self._kept_bytes > self.max_bytes:
            self._shrink()
        return True

    async def note_generation(
        self, principal: str, key: str, *, owner: str, generation_id: str
    ) -> None:
        held = self._claims.get((principal, key))
        if held is not None and held.owner == owner:
            held.generation_id = generation_id

    async def release_claim(self, principal: str, key: str, *, owner: str) -> bool:
        held = self._claims.get((principal, key))
        if held is None or held.owner != owner or held.response is not None:
            return False
        self._drop_claim((principal, key))
        return True

    def _drop_claim(self, key: tuple[str, str]) -> None:
        self._claims.pop(key, None)
        self._kept_bytes -= self._completed.pop(key, 0)

    def _expire_claims(self, now: float) -> None:
        claims, completed = self._claims, self._completed
        # Completed claims expire about in the order they completed: look at the oldest.
        while completed:
            key = next(iter(completed))
            if not claims[key].dead(now):
                break
            self._drop_claim(key)
        if now >= self._next_claim_sweep:
            # Now and then, the rest: other ttls, and running claims nobody renews.
            self._next_claim_sweep = now + _CLAIM_SWEEP
            for key in [key for key, held in claims.items() if held.dead(now)]:
                self._drop_claim(key)

    def _evict_claims(self) -> None:
        # Expired ones went first (claim() expires before it inserts); then the oldest done.
        completed = self._completed
        while len(self._claims) > self._max_claims and completed:
            self._drop_claim(next(iter(completed)))

    # -- usage ------------------------------------------------------------------------

    def record_usage(self, record: UsageRecord) -> None:
        """A usage sink: keeps the newest ``max_generations`` records in ``usage``."""
        self.usage.append(record)

    async def usage_of(self, generation_id: str) -> list[UsageRecord]:
        return [record for record in self.usage if record.generation_id == generation_id]

    # -- generations --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._generations)

    def register(self, generation: LiveLog) -> None:
        generations = self._generations
        generations[generation.id] = generation
        generation.on_finish = self._on_finish
        if not generation.running:
            self._generation_finished(generation)
        if len(generations) > self._max:
            self._evict()

    def _evict(self) -> None:
        """The oldest finished generations, down to an eighth below ``max_generations``, so
        that a full store evicts once every so many requests, not at each."""
        generations, finished = self._generations, self._finished
        target = self._max - (self._max >> 3)
        kept = self._kept_bytes
        while len(generations) > target and finished:
            generation_id, cost = finished.popitem(last=False)
            generations.pop(generation_id, None)
            kept -= cost
        self._kept_bytes = kept

    def _generation_finished(self, generation: LiveLog) -> None:
        # Once per request: a running generation is never dropped, so this one is kept.
        cost = generation.size + _CHUNK_COST * generation.chunk_count
        max_bytes = self.max_bytes
        if cost > max_bytes:
            self._oversize(generation)
            return
        self._finished[generation.id] = cost
        kept = self._kept_bytes = self._kept_bytes + cost
        ended: float = generation.finished_at  # type: ignore[assignment]
        if ended >= self._next_expiry:
            # Reads drop an expired generation anyway; this returns its memory, now and then.
            self._next_expiry = ended + min(self._ttl, 1.0)
            self._expire_generations(ended)
            kept = self._kept_bytes
        if kept > max_bytes:
            self._shrink()

    def _oversize(self, generation: LiveLog) -> None:
        # It could never fit: drop it alone rather than evict everything else first.
        self._generations.pop(generation.id, None)
        if not self._warned_oversize:
            self._warned_oversize = True
            logger.warning(
                "generation %s (%d bytes) is larger than max_bytes (%d) of the memory "
                "backend: it is not kept once it ended, and later ones that size neither "
                "(this is said once); raise max_bytes or use a durable backend",
                generation.id,
                generation.size,
                self.max_bytes,
            )

    def _drop_generation(self, generation_id: str) -> None:
        self._generations.pop(generation_id, None)
        self._kept_bytes -= self._finished.pop(generation_id, 0)

    def _expire_generations(self, now: float) -> None:
        finished = self._finished
        # Every generation has the same ttl, so they expire in the order they finished.
        deadline = now - self._ttl
        while finished:
            generation_id = next(iter(finished))
            ended = self._generations[generation_id].finished_at
            if ended is not None and ended > deadline:
                break
            self._drop_generation(generation_id)

    def _shrink(self) -> None:
        """Evict the oldest finished work, generations and claims alike, to ``max_bytes``."""
        finished, completed = self._finished, self._completed
        while self._kept_bytes > self.max_bytes and (finished or completed):
            generation_id = next(iter(finished), None)
            key = next(iter(completed), None)
            if key is None or (
                generation_id is not None
                and self._generations[generation_id].finished_at  # type: ignore[operator]
                <= self._claims[key].completed_at
            ):
                assert generation_id is not None
                self._drop_generation(generation_id)
            else:
                self._drop_claim(key)

    def _live(self, generation_id: str) -> LiveLog | None:
        generation = self._generations.get(generation_id)
        if generation is None:
            return None
        finished = generation.finished_at
        if finished is not None and time.time() - finished > self._ttl:
            self._drop_generation(generation_id)
            return None
        return generation

    def produces(self, generation_id: str) -> bool:
        """Whether this process produces the generation: every one kept here is."""
        return generation_id in self._generations

    async def pin_session(self, principal: str, session_id: str, provider: str, ttl: float) -> str:
        now = time.monotonic()
        pins = self._pins
        key = (principal, session_id)
        pin = pins.get(key)
        if pin is None or pin[1] <= now:
            if pin is None and len(pins) >= self._max_pins:
                self._evict_pins(now)
            pin = pins[key] = [provider, 0.0]
        pin[1] = now + ttl
        return str(pin[0])

    def _evict_pins(self, now: float) -> None:
        """Drop the expired pins; if none was, the one closest to expiry."""
        pins = self._pins
        expired = [key for key, (_, expires) in pins.items() if expires <= now]
        for key in expired:
            del pins[key]
        if not expired:
            del pins[min(pins, key=lambda key: pins[key][1])]

    async def end_session(self, principal: str, session_id: str) -> bool:
        pin = self._pins.pop((principal, session_id), None)
        return pin is not None and pin[1] > time.monotonic()

    async def request_cancel(self, generation_id: str) -> bool:
        generation = self._generations.get(generation_id)
        on_cancel = self.on_cancel
        if generation is None or not generation.running or on_cancel is None:
            return False
        return on_cancel(generation_id)

    async def recent(self, limit: int = 20, status: str | None = None) -> list[GenerationInfo]:
        """The newest generations kept here (``status``: only those)."""
        infos = [generation.info() for generation in self._generations.values()]
        infos = [info for info in infos if status is None or info.status == status]
        infos.sort(key=lambda info: info.created_at, reverse=True)
        return infos[:limit]

    async def get(self, generation_id: str) -> GenerationInfo | None:
        generation = self._live(generation_id)
        return None if generation is None else generation.info()

    async def wait_for_size(
        self, info: GenerationInfo, size: int, timeout: float
    ) -> GenerationInfo:
        """No other process writes here: the generation as it is, at once."""
        generation = self._live(info.id)
        return info if generation is None else generation.info()

    async def principal_of(self, generation_id: str) -> str | None:
        generation = self._live(generation_id)
        return None if generation is None else generation.principal

    async def follow(self, generation_id: str, offset: int) -> AsyncGenerator[bytes, None]:
        generation = self._live(generation_id)
        if generation is None:
            return
        async for data in generation.follow(offset):
            yield data
