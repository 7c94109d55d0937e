"""Deliberate client-disconnect handling for streamed responses in ASGI apps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._backends import Backend, BackendUnavailable, DurableBackend, MemoryBackend, connect
from ._claims import Claim, ClaimState, ClaimStore, StoredResponse, once
from ._disconnect import DisconnectMiddleware, default_principal
from ._idempotency import IdempotencyKeyRequired, IdempotencyMiddleware, idempotent
from ._log import GenerationInfo, Status
from ._metering import MeteringMiddleware, Reservations, UsageRecord, UsageSink, estimate_tokens
from ._policy import Policy, disconnect_policy
from ._state import RequestState

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from starlette.applications import Starlette
    from starlette.types import Scope

__all__ = [
    "Backend",
    "BackendUnavailable",
    "Claim",
    "ClaimState",
    "ClaimStore",
    "DisconnectMiddleware",
    "DurableBackend",
    "GenerationInfo",
    "IdempotencyKeyRequired",
    "IdempotencyMiddleware",
    "MemoryBackend",
    "MeteringMiddleware",
    "Policy",
    "RequestState",
    "Reservations",
    "Status",
    "StoredResponse",
    "UsageRecord",
    "UsageSink",
    "connect",
    "default_principal",
    "disconnect_policy",
    "estimate_tokens",
    "idempotent",
    "install",
    "once",
]

__version__ = "0.1.0"


def install(
    app: Starlette,
    *,
    sinks: Sequence[UsageSink] = (),
    provider: str | Callable[[Scope], str | None] | None = None,
    reservations: Reservations | None = None,
    tokenizer: Callable[[str], int] = estimate_tokens,
    store_usage: bool = True,
    idempotency: bool | Mapping[str, Any] = False,
    **options: Any,
) -> None:
    """Add the package's middleware stack to a Starlette or FastAPI ``app``.

    Outermost first: :class:`DisconnectMiddleware` (``options``: ``backend``, ``policy``,
    ``principal``, ``resume_prefix``, ...), then :class:`MeteringMiddleware` (``sinks``,
    ``provider``, ``reservations``, ``tokenizer``). With ``store_usage`` (the default) each
    record is also written to the backend's usage table. ``idempotency`` (True, or the
    options of :class:`IdempotencyMiddleware`) adds it outside the others, on the same backend.
    """
    backend = options.get("backend")
    if idempotency and backend is None:
        backend = options["backend"] = MemoryBackend()
    if store_usage and backend is not None:
        sinks = (*sinks, backend.record_usage)
    app.add_middleware(
        MeteringMiddleware,
        sinks=sinks,
        provider=provider,
        reservations=reservations,
        tokenizer=tokenizer,
    )
    app.add_middleware(DisconnectMiddleware, **options)
    if idempotency:
        settings = dict(idempotency) if isinstance(idempotency, Mapping) else {}
        app.add_middleware(IdempotencyMiddleware, backend=options["backend"], **settings)
