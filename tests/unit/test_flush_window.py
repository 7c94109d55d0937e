"""Group commit: the flush window stays at the interval while the store keeps up, grows
under load up to its ceiling, and shrinks back when load falls."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import pytest

from asgi_disconnect import DurableBackend, Status, connect
from asgi_disconnect._backends._window import FlushWindow, default_ceiling
from asgi_disconnect._log import Generation
from tests.apps import eventually

pytestmark = pytest.mark.anyio

INTERVAL = 0.05
CEILING = 0.2


def window() -> FlushWindow:
    return FlushWindow(INTERVAL, CEILING)


def test_while_flushes_are_quick_the_window_is_the_interval() -> None:
    flushes = window()
    for _ in range(10):
        assert flushes.observe(0.003, rows=100) == INTERVAL
    # A quarter of the interval is still quick enough.
    for _ in range(4):
        assert flushes.observe(INTERVAL / 4, rows=100) == pytest.approx(INTERVAL)


def test_flushes_that_take_a_large_share_grow_the_window_to_four_times_their_duration() -> None:
    flushes = window()
    for _ in range(4):
        flushes.observe(0.002, rows=10)
    windows = [flushes.observe(0.03, rows=1000) for _ in range(4)]
    # Judged on the last four flushes: one slow flush among quick ones is not load.
    assert windows == pytest.approx([0.05, 0.064, 0.092, 0.12])
    assert flushes.observe(0.03, rows=1000) == pytest.approx(0.12)


def test_the_window_never_exceeds_its_ceiling() -> None:
    flushes = window()
    for _ in range(4):
        flushes.observe(0.5, rows=1000)
    assert flushes.current == CEILING
    assert flushes.observe(30.0, rows=1000) == CEILING


def test_when_flushes_get_quick_again_the_window_shrinks_back() -> None:
    flushes = window()
    for _ in range(4):
        flushes.observe(0.1, rows=1000)
    assert flushes.current == CEILING
    shrinking = [flushes.observe(0.002, rows=10) for _ in range(4)]
    assert shrinking == sorted(shrinking, reverse=True)
    assert shrinking[-1] == INTERVAL


def test_a_flush_that_wrote_nothing_brings_the_interval_back_at_once() -> None:
    flushes = window()
    for _ in range(4):
        flushes.observe(0.1, rows=1000)
    assert flushes.observe(0.0001, rows=0) == INTERVAL
    # What came before the idle flush no longer counts.
    assert flushes.observe(0.004, rows=10) == INTERVAL


def test_the_default_ceiling_is_four_intervals_at_most_one_second() -> None:
    assert default_ceiling(0.05) == pytest.approx(0.2)
    assert default_ceiling(0.2) == pytest.approx(0.8)
    assert default_ceiling(0.5) == 1.0
    assert default_ceiling(2.0) == 2.0  # never below the interval: no growth


def test_a_ceiling_below_the_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="at least its interval"):
        FlushWindow(0.05, 0.04)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"flush_interval": 0.05, "max_flush_interval": 0.04}, "max_flush_interval"),
        ({"max_flush_interval": 6.0, "lease": 30.0}, "max_flush_interval"),
        ({"max_flush_interval": 2.0, "lease": 5.0}, "lease must be longer"),
        ({"max_pending_bytes": 0}, "max_pending_bytes must be positive"),
        ({"max_pending_bytes": -1}, "max_pending_bytes must be positive"),
    ],
)
def test_bad_window_options_are_clear_errors(
    options: dict[str, float], sqlite_url: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        connect(sqlite_url, **options)  # type: ignore[arg-type]


def test_a_durable_backend_starts_at_its_interval_with_the_documented_ceiling(
    sqlite_url: str,
) -> None:
    backend = connect(sqlite_url)
    assert isinstance(backend, DurableBackend)
    assert backend.flush_window == backend.flush_interval == 0.05
    assert backend.max_flush_interval == pytest.approx(0.2)
    fixed = connect(sqlite_url, max_flush_interval=0.05)
    assert isinstance(fixed, DurableBackend)
    assert fixed.max_flush_interval == 0.05


def slow_chunk_rows(db: sqlite3.Connection) -> None:
    """A store whose every chunk row costs 0.3 ms: a flush takes as long as it is large."""

    def trace(statement: str) -> None:
        if statement.startswith("insert into asgi_disconnect_chunks"):
            time.sleep(0.0003)

    db.set_trace_callback(trace)


async def test_a_burst_grows_the_window_and_idleness_shrinks_it_back(sqlite_url: str) -> None:
    backend = connect(sqlite_url, flush_interval=INTERVAL, init=slow_chunk_rows)
    assert isinstance(backend, DurableBackend)
    await backend.open()
    windows: list[float] = []

    async def produce(generations: list[Generation], steps: int) -> None:
        for step in range(steps):
            for generation in generations:
                generation.append(b"data: %d\n\n" % step)
            windows.append(backend.flush_window)
            await asyncio.sleep(0.01)
        for generation in generations:
            generation.finish(Status.COMPLETE)

    try:
        one = [Generation("gen_" + "L" * 24, principal="")]
        for generation in one:
            backend.register(generation)
        await produce(one, steps=30)
        assert set(windows) == {INTERVAL}, "one generation is no load: flushed every interval"

        burst = [Generation(f"gen_{n:024d}", principal="") for n in range(300)]
        for generation in burst:
            backend.register(generation)
        windows.clear()
        producing = asyncio.ensure_future(produce(burst, steps=100))
        await eventually(
            lambda: backend.flush_window == CEILING, 5, "the window grew to its ceiling"
        )
        await producing
        assert max(windows) == CEILING
        await eventually(
            lambda: backend.flush_window == INTERVAL, 5, "the window shrank back when idle"
        )
        assert backend.pending_bytes() == 0
    finally:
        await backend.aclose()
    reader = connect(sqlite_url)
    await reader.open()
    try:
        for generation in [*one, *burst]:
            info = await reader.get(generation.id)
            assert info is not None
            assert info.status is Status.COMPLETE
            assert info.size == generation.size, "a grown window loses nothing"
    finally:
        await reader.aclose()


def test_a_short_lease_keeps_the_default_ceiling_under_a_quarter_of_it(sqlite_url: str) -> None:
    backend = connect(sqlite_url, lease=0.6)
    assert isinstance(backend, DurableBackend)
    assert backend.max_flush_interval == pytest.approx(0.15)
    assert backend.flush_window == backend.flush_interval == 0.05
    with pytest.raises(ValueError, match="lease must be longer"):
        connect(sqlite_url, lease=0.15)
