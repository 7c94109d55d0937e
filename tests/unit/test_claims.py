"""Claims on memory, SQLite and PostgreSQL: one winner, fenced completion, takeover."""

from __future__ import annotations

import asyncio

import pytest

from asgi_disconnect import connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._claims import ClaimState, StoredResponse, once

pytestmark = pytest.mark.anyio

RESPONSE = StoredResponse(
    status=201, headers=[("content-type", "text/event-stream")], chunks=[b"data: 1\n\n", b"x"]
)


@pytest.fixture
async def backend(backend_url: str):  # type: ignore[no-untyped-def]
    store = connect(backend_url)
    await store.open()
    yield store
    await store.aclose()


async def test_exactly_one_of_many_concurrent_claims_wins(backend) -> None:  # type: ignore[no-untyped-def]
    claims = await asyncio.gather(
        *(
            backend.claim("alice", "key-1", b"fp", owner=f"o{i}", lease=10, ttl=60)
            for i in range(50)
        )
    )
    states = [c.state for c in claims]
    assert states.count(ClaimState.ACQUIRED) == 1
    assert states.count(ClaimState.RUNNING) == 49
    assert all(
        c.retry_after is not None and 0 < c.retry_after <= 10
        for c in claims
        if c.state is ClaimState.RUNNING
    )


async def test_complete_then_replay_and_mismatch(backend) -> None:  # type: ignore[no-untyped-def]
    first = await backend.claim("alice", "k", b"fp", owner="a", lease=10, ttl=60)
    assert first.state is ClaimState.ACQUIRED
    assert not await backend.complete_claim(
        "alice", "k", owner="intruder", response=RESPONSE, ttl=60
    )
    assert await backend.complete_claim("alice", "k", owner="a", response=RESPONSE, ttl=60)
    again = await backend.claim("alice", "k", b"fp", owner="b", lease=10, ttl=60)
    assert again.state is ClaimState.COMPLETED
    assert again.response == RESPONSE
    other_body = await backend.claim("alice", "k", b"other", owner="c", lease=10, ttl=60)
    assert other_body.state is ClaimState.MISMATCH
    # The same key from another principal is an independent claim.
    bob = await backend.claim("bob", "k", b"other", owner="d", lease=10, ttl=60)
    assert bob.state is ClaimState.ACQUIRED


async def test_release_lets_a_retry_run(backend) -> None:  # type: ignore[no-untyped-def]
    await backend.claim("alice", "k", b"fp", owner="a", lease=10, ttl=60)
    assert not await backend.release_claim("alice", "k", owner="b")
    assert await backend.release_claim("alice", "k", owner="a")
    retry = await backend.claim("alice", "k", b"fp", owner="b", lease=10, ttl=60)
    assert retry.state is ClaimState.ACQUIRED


async def test_an_expired_lease_is_taken_over_and_the_old_owner_is_fenced(backend) -> None:  # type: ignore[no-untyped-def]
    if isinstance(backend, DurableBackend):
        # Claimed by another process, which then died: this process's heartbeat, which
        # renews the claims of its own live requests, does not renew it.
        await backend.store.claim(
            "alice", "k", b"fp", owner="dead", process="a-dead-process", lease=0.2, ttl=60
        )
    else:
        await backend.claim("alice", "k", b"fp", owner="dead", lease=0.2, ttl=60)
    assert (await backend.claim("alice", "k", b"fp", owner="b", lease=10, ttl=60)).state is (
        ClaimState.RUNNING
    )
    await asyncio.sleep(0.3)
    # Another body may not take it over; the same request may.
    assert (await backend.claim("alice", "k", b"zz", owner="c", lease=10, ttl=60)).state is (
        ClaimState.MISMATCH
    )
    taken = await backend.claim("alice", "k", b"fp", owner="b", lease=10, ttl=60)
    assert taken.state is ClaimState.ACQUIRED
    assert not await backend.complete_claim("alice", "k", owner="dead", response=RESPONSE, ttl=60)
    assert await backend.complete_claim("alice", "k", owner="b", response=RESPONSE, ttl=60)


async def test_an_expired_completed_claim_runs_again(backend) -> None:  # type: ignore[no-untyped-def]
    await backend.claim("alice", "k", b"fp", owner="a", lease=10, ttl=60)
    await backend.complete_claim("alice", "k", owner="a", response=RESPONSE, ttl=0.2)
    await asyncio.sleep(0.3)
    fresh = await backend.claim("alice", "k", b"new body", owner="b", lease=10, ttl=60)
    assert fresh.state is ClaimState.ACQUIRED


async def test_once_runs_a_side_effect_once(backend) -> None:  # type: ignore[no-untyped-def]
    effects: list[str] = []

    async def attempt(name: str) -> None:
        async with once(backend, "send-invoice:42") as first:
            if first:
                await asyncio.sleep(0.05)
                effects.append(name)

    await asyncio.gather(*(attempt(f"try{i}") for i in range(10)))
    await attempt("later retry")
    assert len(effects) == 1


async def test_once_releases_on_failure(backend) -> None:  # type: ignore[no-untyped-def]
    async def failing_charge() -> None:
        async with once(backend, "charge:7") as first:
            assert first
            raise RuntimeError("provider timed out")

    with pytest.raises(RuntimeError):
        await failing_charge()
    async with once(backend, "charge:7") as first:
        assert first


async def test_durable_claims_are_seen_by_another_process(sqlite_url: str) -> None:
    a, b = connect(sqlite_url), connect(sqlite_url)
    assert isinstance(a, DurableBackend)
    await a.open()
    await b.open()
    try:
        assert (await a.claim("p", "k", b"f", owner="a", lease=10, ttl=60)).state is (
            ClaimState.ACQUIRED
        )
        assert (await b.claim("p", "k", b"f", owner="b", lease=10, ttl=60)).state is (
            ClaimState.RUNNING
        )
        await a.complete_claim("p", "k", owner="a", response=RESPONSE, ttl=60)
        replay = await b.claim("p", "k", b"f", owner="b", lease=10, ttl=60)
        assert replay.response == RESPONSE
    finally:
        await a.aclose()
        await b.aclose()
