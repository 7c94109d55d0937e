"""The per-request state shared by the middlewares at ``scope["asgi_disconnect"]``."""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._log import Generation
    from ._policy import Policy

__all__ = ["Closable", "Counters", "RequestState", "current_state"]

logger = logging.getLogger("asgi_disconnect")


class Closable(Protocol):
    async def aclose(self) -> None: ...


class RequestState:
    """What the middlewares know about one request; read it, don't replace it."""

    # Defaults live on the class: a request sets only what differs.
    generation: Generation | None = None
    principal: str | None = None
    policy: Policy | None = None
    detached = False
    _disconnected: asyncio.Event | None = None
    disconnect_reason: str | None = None
    delivered_bytes = 0

    def __init__(self, generation_id: str) -> None:
        self.generation_id = generation_id
        self.upstreams: list[Closable] = []
        self._finalizers: list[Callable[[], object]] | None = []

    @property
    def disconnected(self) -> asyncio.Event:
        """Set when the client went away (or lagged too far behind)."""
        event = self._disconnected
        if event is None:
            event = self._disconnected = asyncio.Event()
        return event

    @property
    def produced_bytes(self) -> int:
        generation = self.generation
        return 0 if generation is None else generation.size

    @property
    def finished(self) -> bool:
        """True once the exchange is over: the app returned and nothing more is delivered."""
        return self._finalizers is None

    def on_finished(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once the exchange is over (at once if it already is)."""
        if self._finalizers is None:
            _call(callback)
        else:
            self._finalizers.append(callback)

    def finish(self) -> None:
        callbacks, self._finalizers = self._finalizers, None
        for callback in callbacks or ():
            _call(callback)

    def track(self, upstream: Closable) -> None:
        self.upstreams.append(upstream)

    async def close_upstreams(self) -> None:
        """Close every tracked upstream response; errors are logged, never raised."""
        upstreams, self.upstreams = self.upstreams, []
        for upstream in upstreams:
            try:
                await upstream.aclose()
            except Exception:
                logger.warning("closing an upstream response failed", exc_info=True)


def _call(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:
        logger.exception("a callback at the end of a request failed")


current_state: ContextVar[RequestState | None] = ContextVar("asgi_disconnect_state", default=None)


class Counters:
    """In-process counts of disconnect decisions."""

    __slots__ = ("cancelled", "detach_completed", "detached", "disconnects")

    def __init__(self) -> None:
        self.disconnects = 0
        self.cancelled = 0
        self.detached = 0
        self.detach_completed = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}
