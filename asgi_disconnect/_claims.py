"""Effect guards: a side effect runs once per key, decided by one conditional insert."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import TYPE_CHECKING

from ._records import ClaimState, StoredResponse

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ._contract import ClaimStore

__all__ = ["once"]

logger = logging.getLogger("asgi_disconnect")


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
    if not first:
        yield False
        return
    # Renewed while the block runs and never after, so a claim we fail to complete (or
    # whose process died) expires at its lease instead of holding the key for good.
    renewing = asyncio.ensure_future(_renew(store, owner, lease))
    try:
        yield True
    except BaseException:
        renewing.cancel()
        await store.release_claim(_ONCE, key, owner=owner)
        raise
    renewing.cancel()
    done = StoredResponse(status=200, headers=[], chunks=[])
    await store.complete_claim(_ONCE, key, owner=owner, response=done, ttl=ttl)


async def _renew(store: ClaimStore, owner: str, lease: float) -> None:
    while True:
        await asyncio.sleep(lease / 3)
        try:
            await store.renew_claims(owner, lease)
        except Exception as exc:
            logger.warning("renewing an effect guard's lease failed: %s", exc)
