"""In-memory backend: one process, not durable; for tests and development."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .._log import Generation, GenerationInfo

__all__ = ["MemoryBackend"]


class MemoryBackend:
    """Keeps generations in this process until ``ttl`` after they end.

    Finished generations are also evicted oldest first once the stored bytes pass
    ``max_bytes``; running ones are never evicted.
    """

    url = "memory://"

    def __init__(self, *, ttl: float = 3600.0, max_bytes: int = 256 << 20) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self._ttl = ttl
        self._max_bytes = max_bytes
        self._generations: OrderedDict[str, Generation] = OrderedDict()
        self._stored = 0
        self._registered = 0

    async def open(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def register(self, generation: Generation) -> None:
        self._generations[generation.id] = generation
        self._registered += 1
        if self._registered & 0xFF == 0:
            self._evict()

    def _evict(self) -> None:
        now = time.time()
        stored = 0
        expired: list[str] = []
        for generation in self._generations.values():
            finished = generation.finished_at
            if finished is not None and now - finished > self._ttl:
                expired.append(generation.id)
            else:
                stored += generation.size
        for generation_id in expired:
            del self._generations[generation_id]
        if stored > self._max_bytes:
            for generation_id, generation in list(self._generations.items()):
                if generation.finished_at is None:
                    continue
                del self._generations[generation_id]
                stored -= generation.size
                if stored <= self._max_bytes:
                    break
        self._stored = stored

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
