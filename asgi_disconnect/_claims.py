"""Effect guards: a side effect runs once per key, decided by one conditional insert."""

from __future__ import annotations

import contextlib
import secrets
from typing import TYPE_CHECKING

from ._records import ClaimState, StoredResponse

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ._contract import ClaimStore

__all__ = ["once"]


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
