"""Upstream responses tied to the request that opened them.

Cancelling an app's task does not always close its upstream: an async generator
suspended at ``yield`` keeps its ``async with client.stream(...)`` open until garbage
collection. Responses registered here are closed when the request's policy cancels.

Register every response of your own client with one line::

    client = httpx.AsyncClient(event_hooks={"response": [track_response]})
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._contract import current_state

if TYPE_CHECKING:
    from ._contract import Closable

__all__ = ["track", "track_response"]


def track(upstream: Closable) -> bool:
    """Close ``upstream`` if the current request is cancelled; False outside a request."""
    state = current_state.get()
    if state is None:
        return False
    state.track(upstream)
    return True


async def track_response(response: Closable) -> None:
    """An httpx (or httpx2) ``response`` event hook that calls :func:`track`."""
    track(response)
