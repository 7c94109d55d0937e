"""Session pins: provider cutovers that never make one conversation, or one retry, cross
providers.

A gateway asks, per request, which provider a session talks to::

    provider = await pins.provider_for(session_id, default=current_default())

The first turn of a session binds it to the default of that moment; every later turn, and
every retry after a connection error, gets the same binding back, on any replica that
shares the backend, until the session ends (``SessionPins.end``) or goes ``ttl``
seconds without a turn. Changing the default therefore moves only new sessions. The
binding is one conditional insert in the store, judged by the store's clock.

A store that cannot answer raises ``BackendUnavailable``: picking a provider anyway could
send a retry to a second provider, the double spending this exists to prevent. Answer 503
and let the client retry; ``fail_open=True`` returns ``default`` instead, for gateways that
prefer availability.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from ._contract import current_state
from ._errors import BackendUnavailable

if TYPE_CHECKING:
    from ._contract import PinStore

__all__ = ["SessionPins"]

logger = logging.getLogger("asgi_disconnect")

_MAX_ID = 255


class SessionPins:
    """Bindings of sessions to providers, kept in ``backend`` (a backend, or any
    ``PinStore``); see the module's docstring.

    Sessions are scoped to the caller: inside a request the stack runs, the request's
    principal (the same one its generations and idempotency keys belong to), so one
    caller cannot rebind another's session by guessing its id; elsewhere ``principal=``.
    """

    def __init__(self, backend: PinStore, *, ttl: float = 3600.0, fail_open: bool = False) -> None:
        if not (ttl > 0 and math.isfinite(ttl)):
            raise ValueError("ttl must be a positive number of seconds")
        self.backend = backend
        self.ttl = ttl
        self.fail_open = fail_open

    async def provider_for(
        self, session_id: str, *, default: str, principal: str | None = None
    ) -> str:
        """The provider ``session_id`` is bound to; binds it to ``default`` if it has none."""
        _check("session_id", session_id)
        _check("default", default)
        try:
            return await self.backend.pin_session(
                _principal(principal), session_id, default, self.ttl
            )
        except BackendUnavailable:
            if not self.fail_open:
                raise
            logger.warning("session pins unavailable; session %r goes to the default", session_id)
            return default

    async def end(self, session_id: str, *, principal: str | None = None) -> bool:
        """End the session's binding (its next turn binds afresh); True if it had one."""
        _check("session_id", session_id)
        return await self.backend.end_session(_principal(principal), session_id)


def _principal(principal: str | None) -> str:
    if principal is not None:
        return principal
    state = current_state.get()
    return state.principal if state is not None else ""


def _check(name: str, value: object) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_ID:
        raise ValueError(f"{name} must be a non-empty string of at most {_MAX_ID} characters")
