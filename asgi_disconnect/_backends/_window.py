"""How long a durable backend waits between two flushes: group commit that follows load."""

from __future__ import annotations

from collections import deque

__all__ = ["FlushWindow", "default_ceiling"]

# Flushing may take this share of the wall clock before the window grows: below it the
# store keeps up at the flush interval; above it each transaction carries more chunks.
BUSY_SHARE = 0.25
# How many of the last flushes (that wrote something) the window is judged on.
REMEMBERED = 4


def default_ceiling(interval: float) -> float:
    """The window's ceiling when none is given: four flush intervals, at most 1 s (and
    never below the interval). Four windows' worth of flushes fit in one, which saves three
    quarters of what flushing costs in transactions; past that the saving is small while
    what a crash can lose, and what each generation keeps in memory, keep growing."""
    return max(interval, min(4 * interval, 1.0))


class FlushWindow:
    """The wait between the starts of two flushes, chosen from the last flushes.

    While flushes take less than a quarter of ``interval``, the window is ``interval``.
    When they take longer (many generations, a slow disk, a remote PostgreSQL), the window
    is four times what the last four flushes took on average, so that flushing keeps to
    about a quarter of the time, and it never exceeds ``ceiling``. A flush that wrote
    nothing says the store is idle: the window is back to ``interval`` at once.
    """

    __slots__ = ("_recent", "ceiling", "current", "interval")

    def __init__(self, interval: float, ceiling: float) -> None:
        if not 0 < interval <= ceiling:
            raise ValueError(
                f"the flush window's ceiling ({ceiling} s) must be at least its interval "
                f"({interval} s), which must be positive"
            )
        self.interval = interval
        self.ceiling = ceiling
        self.current = interval
        self._recent: deque[float] = deque(maxlen=REMEMBERED)

    def observe(self, took: float, rows: int) -> float:
        """A flush took ``took`` seconds and wrote ``rows`` rows: the next window."""
        if rows == 0:
            self._recent.clear()
            self.current = self.interval
            return self.current
        self._recent.append(took)
        busy = sum(self._recent) / len(self._recent)
        self.current = min(self.ceiling, max(self.interval, busy / BUSY_SHARE))
        return self.current
