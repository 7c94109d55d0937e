"""Claims: who runs a request or a side effect, decided by one conditional insert."""

from __future__ import annotations

import contextlib
import enum
import secrets
from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["Claim", "ClaimState", "ClaimStore", "StoredResponse", "once"]


class ClaimState(enum.StrEnum):
    ACQUIRED = "acquired"
    """This caller owns the claim: run the work."""
    RUNNING = "running"
    """Another owner holds a live lease: the work is under way elsewhere."""
    COMPLETED = "completed"
    """The work finished; its stored response can be replayed."""
    MISMATCH = "mismatch"
    """The key is in use with another fingerprint (another request body)."""


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    """A response to replay: status, allow-listed headers and the body chunk by chunk."""

    status: int
    headers: list[tuple[str, str]]
    chunks: list[bytes]
    generation_id: str | None = None


class Claim(msgspec.Struct, frozen=True, kw_only=True):
    state: ClaimState
    retry_after: float | None = None
    response: StoredResponse | None = None
    generation_id: str | None = None


class ClaimStore(Protocol):
    """The claim half of a backend. Leases and expiry are judged by the store's clock."""

    async def claim(
        self, principal: str, key: str, fingerprint: bytes, *, owner: str, lease: float, ttl: float
    ) -> Claim:
        """Take the claim, or report who holds it; a fresh claim is one round trip.

        A running claim whose lease expired is taken over (same fingerprint only); a
        claim past its expiry is taken afresh.
        """

    async def renew_claims(self, owner: str, lease: float) -> None:
        """Extend the lease of every running claim of ``owner``."""

    async def complete_claim(
        self, principal: str, key: str, *, owner: str, response: StoredResponse, ttl: float
    ) -> bool:
        """Store the response; False if ``owner`` no longer holds the claim (fenced)."""

    async def release_claim(self, principal: str, key: str, *, owner: str) -> bool:
        """Give the claim up so a retry runs again; False if not held (fenced)."""

    async def note_generation(
        self, principal: str, key: str, *, owner: str, generation_id: str
    ) -> None:
        """Record which generation the running claim produces, so retries can attach."""


# Effect guards live in a principal namespace of their own.
_ONCE = "asgi-disconnect:once"


@contextlib.asynccontextmanager
async def once(
    store: ClaimStore, key: str, *, ttl: float = 24 * 3600.0, lease: float = 60.0
) -> AsyncIterator[bool]:
    """Run a side effect at most once per ``key``, across retries, processes and providers.

    ``async with once(backend, f"email:{order_id}") as first:`` yields True for the one
    caller that should act; completing the block marks the effect done, an exception
    releases the claim so a later attempt can act. A concurrent holder yields False.
    """
    owner = secrets.token_hex(8)
    claim = await store.claim(_ONCE, key, b"", owner=owner, lease=lease, ttl=ttl)
    first = claim.state is ClaimState.ACQUIRED
    try:
        yield first
    except BaseException:
        if first:
            await store.release_claim(_ONCE, key, owner=owner)
        raise
    if first:
        done = StoredResponse(status=200, headers=[], chunks=[])
        await store.complete_claim(_ONCE, key, owner=owner, response=done, ttl=ttl)
