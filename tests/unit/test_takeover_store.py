"""Takeover in the SQL stores: the database picks exactly one new owner for a detached
generation whose lease lapsed, and every later write of the old owner is refused."""

from __future__ import annotations

import asyncio

import pytest

from asgi_disconnect import connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._log import Generation, Status
from asgi_disconnect._records import Adopted

pytestmark = pytest.mark.anyio

GID = "gen_" + "T" * 24
CONTINUATION = b"continuation-record"


def durable(url: str, **options: object) -> DurableBackend:
    options.setdefault("flush_interval", 0.02)
    options.setdefault("lease", 0.5)
    backend = connect(url, **options)  # type: ignore[arg-type]
    assert isinstance(backend, DurableBackend)
    return backend


async def settle(backend: DurableBackend) -> None:
    while await backend.flush():
        pass


def detached(generation_id: str = GID, *, upstream: str = "openai") -> Generation:
    generation = Generation(generation_id, principal="alice", content_type="text/event-stream")
    generation.policy = "detach"
    generation.detached = True
    generation.continuation = (upstream, CONTINUATION)
    return generation


async def lapse(backend: DurableBackend) -> None:
    """The owner is gone: its worker stops renewing (as a killed process's would)."""
    worker = backend._worker
    assert worker is not None
    worker.cancel()
    await asyncio.gather(worker, return_exceptions=True)
    await asyncio.sleep(backend.lease + 0.1)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


async def test_exactly_one_replica_takes_over_a_lapsed_generation(url: str) -> None:
    owner, first, second = durable(url), durable(url), durable(url)
    for backend in (owner, first, second):
        await backend.open()
    try:
        generation = detached()
        owner.register(generation)
        generation.append(b"data: one\n\n")
        await settle(owner)
        await lapse(owner)
        store_a, store_b = first.store, second.store
        taken_a, taken_b = await asyncio.gather(
            store_a.take_over(first.owner, 5.0, 10, ["openai"], 3),
            store_b.take_over(second.owner, 5.0, 10, ["openai"], 3),
        )
        taken = taken_a + taken_b
        assert len(taken) == 1
        (adopted,) = taken
        assert isinstance(adopted, Adopted)
        assert adopted.id == GID
        assert adopted.attempt == 2
        assert adopted.size == len(b"data: one\n\n")
        assert adopted.continuation == CONTINUATION
        assert adopted.principal == "alice"
        # Taken, with a live lease: nobody takes it again.
        assert await store_a.take_over(first.owner, 5.0, 10, ["openai"], 3) == []
    finally:
        for backend in (owner, first, second):
            await backend.aclose()


async def test_a_replica_never_takes_over_its_own_generation_after_a_late_heartbeat(
    url: str,
) -> None:
    """A process whose heartbeat came late (a busy loop, a slow database) still runs its
    generation: its own scan leaves it alone; another replica's scan takes it."""
    owner, other = durable(url), durable(url)
    await owner.open()
    await other.open()
    try:
        generation = detached()
        owner.register(generation)
        generation.append(b"data: one\n\n")
        await settle(owner)
        await lapse(owner)
        assert await owner.store.take_over(owner.owner, 5.0, 10, ["openai"], 3) == []
        (adopted,) = await other.store.take_over(other.owner, 5.0, 10, ["openai"], 3)
        assert adopted.attempt == 2
    finally:
        await owner.aclose()
        await other.aclose()


async def test_only_a_replica_with_the_upstream_registered_takes_it_over(url: str) -> None:
    owner, other = durable(url), durable(url)
    await owner.open()
    await other.open()
    try:
        generation = detached(upstream="anthropic")
        owner.register(generation)
        generation.append(b"data: one\n\n")
        await settle(owner)
        await lapse(owner)
        assert await other.store.take_over(other.owner, 5.0, 10, ["openai"], 3) == []
        # Not interrupted yet either: a replica that has it may still come, for the grace.
        assert await other.store.sweep(60.0, 3, 30.0) == []
        assert (await other.store.sweep(60.0, 3, 0.0)) == [GID]
        info = await other.get(GID)
        assert info is not None
        assert info.status is Status.INTERRUPTED
        assert info.error is not None
        assert "'anthropic'" in info.error
    finally:
        await owner.aclose()
        await other.aclose()


async def test_a_generation_without_a_continuation_is_interrupted_at_once(url: str) -> None:
    owner, other = durable(url), durable(url)
    await owner.open()
    await other.open()
    try:
        generation = detached()
        generation.continuation = None
        owner.register(generation)
        generation.append(b"data: one\n\n")
        await settle(owner)
        await lapse(owner)
        assert await other.store.take_over(other.owner, 5.0, 10, ["openai"], 3) == []
        assert await other.store.sweep(60.0, 3, 30.0) == [GID]
    finally:
        await owner.aclose()
        await other.aclose()


async def test_the_old_owner_is_fenced_after_a_takeover(url: str) -> None:
    """A partitioned owner that comes back appends not one more byte, and learns it."""
    owner, taker = durable(url), durable(url)
    await owner.open()
    await taker.open()
    fenced: list[str] = []
    owner.on_fenced = fenced.append
    try:
        generation = detached()
        owner.register(generation)
        generation.append(b"data: one\n\n")
        await settle(owner)
        worker = owner._worker
        assert worker is not None
        worker.cancel()  # partitioned: no heartbeat, no flush
        await asyncio.gather(worker, return_exceptions=True)
        await asyncio.sleep(owner.lease + 0.1)
        (adopted,) = await taker.store.take_over(taker.owner, 5.0, 10, ["openai"], 3)
        resumed = Generation.adopted(
            generation_id=GID,
            principal=adopted.principal,
            size=adopted.size,
            status_code=adopted.status_code,
            content_type=adopted.content_type,
            policy=adopted.policy,
            created_at=adopted.created_at,
            attempt=adopted.attempt,
        )
        taker.adopt(resumed, adopted.size)
        resumed.append(b"data: two\n\n")
        await settle(taker)
        # The old owner comes back with output it kept in memory, and its end.
        generation.append(b"data: stale\n\n")
        generation.finish(Status.INTERRUPTED, "its process was partitioned")
        await settle(owner)
        assert fenced == [GID]
        assert owner.pending_bytes() == 0
        resumed.append(b"data: three\n\n")
        resumed.finish(Status.COMPLETE)
        await settle(taker)
        info = await taker.get(GID)
        assert info is not None
        assert info.status is Status.COMPLETE
        stored = await taker.read_all(GID, info.size)
        assert stored == b"data: one\n\ndata: two\n\ndata: three\n\n"
    finally:
        await owner.aclose()
        await taker.aclose()


async def test_a_handed_over_generation_is_taken_at_once_and_not_interrupted(url: str) -> None:
    owner, taker = durable(url, lease=30.0), durable(url, lease=30.0)
    await owner.open()
    await taker.open()
    try:
        generation = detached()
        owner.register(generation)
        generation.append(b"data: one\n\n")
        generation.handed_over = True
        generation.finish(Status.INTERRUPTED, "drained")
        await settle(owner)
        await asyncio.sleep(0.01)  # the database's clock passes the release
        # The old owner's heartbeat no longer renews it.
        await owner.store.heartbeat(owner.owner, 30.0)
        (adopted,) = await taker.store.take_over(taker.owner, 30.0, 10, ["openai"], 3)
        assert adopted.id == GID
        assert adopted.size == len(b"data: one\n\n")
        info = await taker.get(GID)
        assert info is not None
        assert info.status is Status.RUNNING
    finally:
        await owner.aclose()
        await taker.aclose()


async def test_attempts_are_bounded(url: str) -> None:
    owner, taker = durable(url), durable(url)
    await owner.open()
    await taker.open()
    try:
        generation = detached()
        owner.register(generation)
        generation.append(b"data: one\n\n")
        await settle(owner)
        await lapse(owner)
        assert len(await taker.store.take_over(taker.owner, 0.2, 10, ["openai"], 2)) == 1
        await lapse(taker)  # the taker died too
        assert await taker.store.take_over(taker.owner, 0.2, 10, ["openai"], 2) == []
        assert await taker.store.sweep(60.0, 2, 30.0) == [GID]
    finally:
        await owner.aclose()
        await taker.aclose()


def test_takeover_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        connect("sqlite:///x.db", max_attempts=0)
    with pytest.raises(ValueError, match="takeover_interval"):
        connect("sqlite:///x.db", takeover_interval=0)
