"""In-memory backend: one process, not durable; for tests and development."""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

from .._records import Claim, ClaimState, StoredResponse

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .._log import Generation
    from .._records import GenerationInfo, UsageRecord

__all__ = ["MemoryBackend"]


class _MemoryClaim:
    __slots__ = ("expires_at", "fingerprint", "generation_id", "lease_until", "owner", "response")

    def __init__(self, fingerprint: bytes, owner: str, lease_until: float, expires_at: float):
        self.fingerprint = fingerprint
        self.owner = owner
        self.lease_until = lease_until
        self.expires_at = expires_at
        self.response: StoredResponse | None = None
        self.generation_id: str | None = None


class MemoryBackend:
    """Keeps generations in this process until ``ttl`` seconds after they end.

    At most ``max_generations`` are kept: past that, finished ones are evicted oldest
    first. Running generations are never evicted.
    """

    url = "memory://"

    def __init__(self, *, ttl: float = 3600.0, max_generations: int = 10_000) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if max_generations <= 0:
            raise ValueError("max_generations must be positive")
        self._ttl = ttl
        self._max = max_generations
        self._generations: dict[str, Generation] = {}  # oldest first
        self.usage: deque[UsageRecord] = deque(maxlen=max_generations)
        self._claims: dict[tuple[str, str], _MemoryClaim] = {}

    async def open(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    # -- claims (the monotonic clock stands in for a database's) --------------------

    async def claim(
        self, principal: str, key: str, fingerprint: bytes, *, owner: str, lease: float, ttl: float
    ) -> Claim:
        now = time.monotonic()
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
        self._claims[(principal, key)] = _MemoryClaim(fingerprint, owner, now + lease, now + ttl)
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
        del self._claims[(principal, key)]
        return True

    def record_usage(self, record: UsageRecord) -> None:
        """A usage sink: keeps the newest ``max_generations`` records in ``usage``."""
        self.usage.append(record)

    async def usage_of(self, generation_id: str) -> list[UsageRecord]:
        return [record for record in self.usage if record.generation_id == generation_id]

    def __len__(self) -> int:
        return len(self._generations)

    def register(self, generation: Generation) -> None:
        generations = self._generations
        generations[generation.id] = generation
        # Evict in batches of an eighth, so a full store costs O(1) per request.
        if len(generations) > self._max + (self._max >> 3):
            self._evict()

    def _evict(self) -> None:
        generations = self._generations
        deadline = time.time() - self._ttl
        excess = len(generations) - self._max
        doomed = []
        # Oldest first; running generations are skipped, never evicted.
        for generation_id, generation in generations.items():
            finished = generation.finished_at
            if finished is None:
                continue
            if excess <= 0 and finished > deadline:
                break
            doomed.append(generation_id)
            excess -= 1
        for generation_id in doomed:
            del generations[generation_id]

    def _live(self, generation_id: str) -> Generation | None:
        generation = self._generations.get(generation_id)
        if generation is None:
            return None
        finished = generation.finished_at
        if finished is not None and time.time() - finished > self._ttl:
            del self._generations[generation_id]
            return None
        return generation

    async def get(self, generation_id: str) -> GenerationInfo | None:
        generation = self._live(generation_id)
        return None if generation is None else generation.info()

    async def principal_of(self, generation_id: str) -> str | None:
        generation = self._live(generation_id)
        return None if generation is None else generation.principal

    async def follow(self, generation_id: str, offset: int) -> AsyncIterator[bytes]:
        generation = self._live(generation_id)
        if generation is None:
            return
        async for data in generation.follow(offset):
            yield data
