"""The output a durable backend has not written yet, bounded across the process."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["PendingBound"]

logger = logging.getLogger("asgi_disconnect")

# How long a count of the output waiting for the store serves the producers that ask.
_RECOUNT = 0.001


class PendingBound:
    """Producers wait on the store, never on their clients, while more than ``limit`` bytes
    of output produced in this process wait to be written.

    A generation's log is handed this as its ``hold``: its producer asks ``room`` once
    the log holds more than ``HOLD_CHECK`` bytes (the store is behind on it), so a producer
    the store keeps up with never asks. The backend calls ``written`` after each write
    (or failed one) and ``release`` when it closes.
    """

    __slots__ = ("_count", "_counted", "_recount_at", "_room", "_say_at", "limit", "url", "waits")

    def __init__(self, count: Callable[[], int], limit: int, url: str) -> None:
        if limit <= 0:
            raise ValueError("max_pending_bytes must be positive")
        self._count = count  # the bytes waiting now (every live generation's, summed)
        self.limit = limit
        self.url = url
        self.waits = 0  # producers that waited, over the process's life
        self._counted = 0
        self._recount_at = 0.0
        self._say_at = 0.0  # when a wait may be logged again
        self._room: asyncio.Future[None] | None = None

    def written(self) -> None:
        """A write to the store ended: let the producers that wait go once what waits is
        down to three quarters of the limit."""
        counted = self._counted = self._count()
        self._recount_at = asyncio.get_running_loop().time() + _RECOUNT
        if counted <= self.limit * 3 // 4:
            self.release()

    def release(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    async def room(self) -> None:
        """Return at once while what waits for the store is within the limit, else once it
        is back under three quarters of it. Each wait is counted (``waits``); the first is
        logged, then at most one a minute."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now >= self._recount_at:
            self._counted = self._count()
            self._recount_at = now + _RECOUNT
        if self._counted <= self.limit:
            return
        self.waits += 1
        room = self._room
        if room is None:
            room = self._room = loop.create_future()
        if now >= self._say_at:
            self._say_at = now + 60.0
            logger.warning(
                "%s is behind: %d bytes of output wait to be written (max_pending_bytes "
                "%d); producers wait for it (%d waits so far)",
                self.url,
                self._counted,
                self.limit,
                self.waits,
            )
        await asyncio.shield(room)
