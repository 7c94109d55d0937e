"""A claim store that fails: settles are retried, and only live requests renew a claim."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_disconnect import IdempotencyMiddleware, MemoryBackend, connect
from asgi_disconnect._records import Claim, ClaimState
from asgi_disconnect.testing import drive, lifespan

pytestmark = pytest.mark.anyio

AUTH = ("authorization", "Bearer alice")


class StoreDown(ConnectionError):
    pass


class FlakyStore:
    """A claim store that refuses what it is told to, as a database that went away would."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.down = False
        self.refuse_settles = False
        self.claims_fail_after_landing = False
        self.renewed: list[tuple[str, float]] = []

    def _check(self) -> None:
        if self.down:
            raise StoreDown("connection refused")

    async def open(self) -> None:
        await self.inner.open()

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def claim(self, principal: str, key: str, fingerprint: bytes, **kw: Any) -> Claim:
        self._check()
        claim: Claim = await self.inner.claim(principal, key, fingerprint, **kw)
        if self.claims_fail_after_landing:
            # The insert committed; the answer was lost with the connection.
            raise StoreDown("connection lost during commit")
        return claim

    async def renew_claims(self, owner: str, lease: float) -> None:
        self._check()
        self.renewed.append((owner, asyncio.get_running_loop().time()))
        await self.inner.renew_claims(owner, lease)

    async def complete_claim(self, principal: str, key: str, **kw: Any) -> bool:
        self._check()
        if self.refuse_settles:
            raise StoreDown("refused")
        return bool(await self.inner.complete_claim(principal, key, **kw))

    async def release_claim(self, principal: str, key: str, **kw: Any) -> bool:
        self._check()
        if self.refuse_settles:
            raise StoreDown("refused")
        return bool(await self.inner.release_claim(principal, key, **kw))

    async def note_generation(self, principal: str, key: str, **kw: Any) -> None:
        self._check()
        await self.inner.note_generation(principal, key, **kw)


class Charges:
    def __init__(self) -> None:
        self.calls = 0
        self.running = asyncio.Event()
        self.release = asyncio.Event()

    def app(self) -> Starlette:
        async def charge(request: Request) -> JSONResponse:
            self.calls += 1
            self.running.set()
            await self.release.wait()
            return JSONResponse({"charge": self.calls, "body": (await request.body()).decode()})

        return Starlette(routes=[Route("/charge", charge, methods=["POST"])])


async def post(mw: Any, key: str = "k-1") -> Any:
    return await drive(
        mw, method="POST", path="/charge", headers=[AUTH, ("idempotency-key", key)], body=b"10"
    )


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def inner(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """The real store under the flaky one; a durable one renews its generations every 0.2 s."""
    if request.param == "memory":
        yield MemoryBackend()
        return
    if request.param == "sqlite":
        url = str(request.getfixturevalue("sqlite_url"))
    else:
        url = str(request.getfixturevalue("fault_url"))
    backend = connect(url, lease=0.6)
    await backend.open()
    try:
        yield backend
    finally:
        await backend.aclose()


async def test_an_answer_sent_while_the_store_was_down_is_what_a_retry_gets(inner: Any) -> None:
    store = FlakyStore(inner)
    charges = Charges()
    mw = IdempotencyMiddleware(charges.app(), backend=store)
    first = asyncio.ensure_future(post(mw))
    await asyncio.wait_for(charges.running.wait(), 5)
    store.down = True
    charges.release.set()
    answered = await first
    assert answered.status == 200
    during = await post(mw)
    assert during.status == 503
    assert during.header("retry-after") == "5"
    store.down = False
    # At once, before the retry task's next try: the retry stores the answer, then replays it.
    replay = await post(mw)
    assert replay.status == 200
    assert replay.header("idempotent-replayed") == "true"
    assert replay.body == answered.body
    assert charges.calls == 1
    assert len(mw.pending_settles) == 0


async def test_pending_settles_are_retried_with_backoff_until_the_store_is_back(
    inner: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = FlakyStore(inner)
    charges = Charges()
    charges.release.set()
    mw = IdempotencyMiddleware(charges.app(), backend=store)
    store.refuse_settles = True
    answers = [await post(mw, f"k-{i}") for i in range(5)]
    assert [a.status for a in answers] == [200] * 5
    assert len(mw.pending_settles) == 5
    await asyncio.sleep(0.5)  # the store stays down: tries back off, nothing is dropped
    assert len(mw.pending_settles) == 5
    store.refuse_settles = False
    async with asyncio.timeout(5):
        while mw.pending_settles:
            await asyncio.sleep(0.02)
    assert "5 pending claim(s) settled" in caplog.text
    for i, answer in enumerate(answers):
        again = await post(mw, f"k-{i}")
        assert again.header("idempotent-replayed") == "true"
        assert again.body == answer.body
    assert charges.calls == 5


async def test_a_claim_whose_request_ended_is_renewed_by_nothing(
    inner: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Its settle keeps failing while the process lives on: the claim expires at its
    lease (0.3 s), not kept alive by the process's heartbeat (every 0.2 s, for its
    generations). That is the bound on a second run: the answer was never stored."""
    store = FlakyStore(inner)
    charges = Charges()
    charges.release.set()
    mw = IdempotencyMiddleware(charges.app(), backend=store, lease=0.3)
    store.refuse_settles = True
    answered = await post(mw)
    assert answered.status == 200
    ended = asyncio.get_running_loop().time()
    await asyncio.sleep(0.7)
    assert [owner for owner, at in store.renewed if at > ended] == []
    # The same request through another process's middleware takes the expired claim over.
    other = IdempotencyMiddleware(charges.app(), backend=store, lease=0.3)
    again = await post(other)
    assert again.status == 200
    assert again.header("idempotent-replayed") is None
    assert charges.calls == 2
    store.refuse_settles = False
    async with asyncio.timeout(5):
        while mw.pending_settles or other.pending_settles:
            await asyncio.sleep(0.02)
    # The first answer's settle is fenced: the key keeps the answer of the run that holds it.
    assert "was no longer held when its settle was retried" in caplog.text
    replay = await post(mw)
    assert replay.header("idempotent-replayed") == "true"
    assert replay.body == again.body


async def test_a_running_request_renews_its_own_claim_and_no_other(inner: Any) -> None:
    store = FlakyStore(inner)
    charges = Charges()
    mw = IdempotencyMiddleware(charges.app(), backend=store, lease=0.3)
    # A claim of this process that nobody renews (its request ended).
    orphan = await inner.claim("p", "orphan", b"fp", owner="orphan-owner", lease=0.3, ttl=60)
    assert orphan.state is ClaimState.ACQUIRED
    running = asyncio.ensure_future(post(mw, "long"))
    await asyncio.wait_for(charges.running.wait(), 5)
    await asyncio.sleep(0.7)
    # The running request's lease holds; the orphan's ended, and it is taken over.
    conflict = await post(IdempotencyMiddleware(charges.app(), backend=store), "long")
    assert conflict.status == 409
    taken = await inner.claim("p", "orphan", b"fp", owner="new", lease=5, ttl=60)
    assert taken.state is ClaimState.ACQUIRED
    charges.release.set()
    assert (await running).status == 200
    assert charges.calls == 1


async def test_a_claim_that_landed_as_the_store_failed_is_released_once_it_is_back(
    inner: Any,
) -> None:
    store = FlakyStore(inner)
    charges = Charges()
    charges.release.set()
    mw = IdempotencyMiddleware(charges.app(), backend=store, lease=30)
    store.claims_fail_after_landing = True
    refused = await post(mw)
    assert refused.status == 503
    assert charges.calls == 0
    store.claims_fail_after_landing = False
    # Not a 409 for the 30 s of a lease nobody runs under: the retry runs now.
    ran = await post(mw)
    assert ran.status == 200
    assert ran.header("idempotent-replayed") is None
    assert charges.calls == 1


async def test_pending_settles_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore(MemoryBackend())
    charges = Charges()
    charges.release.set()
    mw = IdempotencyMiddleware(charges.app(), backend=store, max_pending_settles=2, lease=0.3)
    store.refuse_settles = True
    answers = [await post(mw, f"k-{i}") for i in range(3)]
    assert [a.status for a in answers] == [200] * 3
    assert len(mw.pending_settles) == 2
    assert "'k-2' failed (refused) and 2 settles" in caplog.text
    store.refuse_settles = False
    async with asyncio.timeout(5):
        while mw.pending_settles:
            await asyncio.sleep(0.02)
    assert (await post(mw, "k-0")).body == answers[0].body
    assert (await post(mw, "k-1")).body == answers[1].body
    # The dropped one was never stored: once its lease ended, it runs again.
    await asyncio.sleep(0.35)
    assert (await post(mw, "k-2")).header("idempotent-replayed") is None
    assert charges.calls == 4


async def test_shutdown_settles_what_is_pending_before_the_backend_closes(
    sqlite_url: str,
) -> None:
    store = FlakyStore(connect(sqlite_url))
    charges = Charges()
    charges.release.set()
    mw = IdempotencyMiddleware(charges.app(), backend=store)

    async def served(scope: Any, receive: Any, send: Any) -> None:
        async def shutdown_finds_the_store_back() -> Any:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                # Only now, so that only the shutdown can settle it.
                store.refuse_settles = False
            return message

        await mw(scope, shutdown_finds_the_store_back, send)

    async with lifespan(served):
        store.refuse_settles = True
        answered = await post(mw)
        assert len(mw.pending_settles) == 1
    assert len(mw.pending_settles) == 0
    later = IdempotencyMiddleware(charges.app(), backend=connect(sqlite_url))
    async with lifespan(later):
        replay = await post(later)
    assert replay.header("idempotent-replayed") == "true"
    assert replay.body == answered.body
    assert charges.calls == 1
