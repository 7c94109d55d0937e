"""Deliberate client-disconnect handling for streamed responses in ASGI apps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ._backends import BackendUnavailable, DurableBackend, MemoryBackend, connect
from ._claims import once
from ._contract import (
    CREDENTIAL_HEADERS,
    Backend,
    ClaimStore,
    Ending,
    GenerationLog,
    GenerationReader,
    Outcome,
    PinStore,
    RequestState,
    Reservations,
    UsageSink,
    UsageStore,
    default_principal,
)
from ._disconnect import DisconnectMiddleware, check_options
from ._drain import DrainMiddleware
from ._errors import AsgiDisconnectError, IdempotencyKeyRequired
from ._idempotency import IdempotencyMiddleware, idempotent
from ._metering import MeteringMiddleware, estimate_tokens, metered
from ._options import refuse_unknown, refusing_unknown
from ._pins import SessionPins
from ._policy import Policy, PolicySource, disconnect_policy
from ._records import Claim, ClaimState, GenerationInfo, Status, StoredResponse, UsageRecord
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from ._telemetry import TelemetryMiddleware

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from starlette.applications import Starlette
    from starlette.types import Scope

__all__ = [
    "AsgiDisconnectError",
    "Backend",
    "BackendUnavailable",
    "CREDENTIAL_HEADERS",
    "Claim",
    "ClaimState",
    "ClaimStore",
    "DisconnectMiddleware",
    "DrainMiddleware",
    "DurableBackend",
    "Ending",
    "GenerationInfo",
    "GenerationLog",
    "GenerationReader",
    "IdempotencyKeyRequired",
    "IdempotencyMiddleware",
    "MemoryBackend",
    "MeteringMiddleware",
    "PinStore",
    "Policy",
    "Outcome",
    "RequestState",
    "Reservations",
    "SessionPins",
    "Status",
    "StoredResponse",
    "TelemetryMiddleware",
    "UsageRecord",
    "UsageSink",
    "UsageStore",
    "connect",
    "default_principal",
    "disconnect_policy",
    "estimate_tokens",
    "idempotent",
    "install",
    "metered",
    "once",
]


def __getattr__(name: str) -> Any:
    # OpenTelemetry is optional: its middleware is imported when asked for, not before.
    if name == "TelemetryMiddleware":
        from ._telemetry import TelemetryMiddleware

        return TelemetryMiddleware
    raise AttributeError(f"module 'asgi_disconnect' has no attribute {name!r}")


@refusing_unknown
def install(
    app: Starlette,
    *,
    backend: Backend | str | None = None,
    policy: PolicySource = Policy.CANCEL,
    principal: Callable[[Scope], str | None] | None = None,
    resume_prefix: str | None = "/generations",
    exclude_paths: Sequence[str] = (),
    max_lag_bytes: int = 4 << 20,
    max_lag_seconds: float = 30.0,
    shutdown_timeout: float = 30.0,
    keep_alive: float | None = 15.0,
    resume_secret: bytes | None = None,
    resume_token_ttl: float = 300.0,
    client_timeout: float | None = 10.0,
    upstreams: Mapping[str, Any] | None = None,
    takeover_sinks: Sequence[UsageSink] | None = None,
    sinks: Sequence[UsageSink] = (),
    provider: str | Callable[[Scope], str | None] | None = None,
    reservations: Reservations | None = None,
    tokenizer: Callable[[str], int] = estimate_tokens,
    store_usage: bool = True,
    request_log: str | None = "text",
    idempotency: bool | Mapping[str, Any] = False,
    drain: bool | Mapping[str, Any] = False,
    telemetry: bool = False,
    tracer_provider: Any = None,
    meter_provider: Any = None,
) -> None:
    """Add the package's middleware stack to a Starlette or FastAPI ``app``.

    Outermost first: ``DisconnectMiddleware`` (the options from ``backend`` to
    ``takeover_sinks``, listed below, checked here, not at the first request), then
    ``MeteringMiddleware`` (``sinks``,
    ``provider``, ``reservations``, ``tokenizer``). With ``store_usage`` (the default) each
    record is also written to the backend's usage table. ``request_log``: with each record,
    one line in the ``asgi_disconnect.requests`` logger at INFO (id, route, policy, how it
    ended, tokens billed and delivered, usage source, duration): ``"text"`` (the default),
    ``"json"`` (one object per line) or None. ``idempotency`` (True, or the
    options of ``IdempotencyMiddleware``) adds it outside the others, on the same backend.
    ``drain`` (True, or the options of ``DrainMiddleware``) adds it outside those, with
    the same ``resume_prefix``. ``telemetry`` (spans and metrics through the global
    OpenTelemetry providers), or a ``tracer_provider`` / ``meter_provider`` of one's own,
    adds ``TelemetryMiddleware`` outside them all (``pip install 'asgi-disconnect[otel]'``).

    ``DisconnectMiddleware``'s options, passed to it (see it for each in full):

    - ``backend``: a backend, or its URL for ``connect()`` (default: in memory, with a
      warning; with ``idempotency``, one in memory for both);
    - ``policy``: ``"cancel"`` (the default), ``"detach"``, or ``(scope) -> Policy``;
    - ``principal``: ``(scope) -> str | None``, who the caller is (default: a digest of
      its credential headers); idempotency and telemetry use the same;
    - ``resume_prefix``: where generations are read, resumed and stopped (default
      ``"/generations"``; None: no endpoints);
    - ``exclude_paths``: regular expressions of paths the stack leaves alone;
    - ``max_lag_bytes``, ``max_lag_seconds``: how far behind a client may fall before the
      policy applies (default 4 MiB, 30 s);
    - ``shutdown_timeout``: seconds running generations get at shutdown (default 30);
    - ``keep_alive``: seconds of silence before a ``: keep-alive`` comment (default 15;
      None: none);
    - ``resume_secret``, ``resume_token_ttl``: the key and lifetime of the signed resume
      tokens browsers use (default: a random key per process, 300 s);
    - ``client_timeout``: seconds a client's TCP may acknowledge nothing before it counts
      as gone (default 10; None: off);
    - ``upstreams``: named upstream clients this replica continues lapsed detached
      generations with;
    - ``takeover_sinks``: where the records of those attempts go (default: ``sinks``).
    """
    if not isinstance(telemetry, bool):
        raise TypeError(
            "telemetry must be True or False; pass tracer_provider= / meter_provider= to use "
            "providers of your own"
        )
    if isinstance(backend, str):
        backend = connect(backend)
    options: dict[str, Any] = {
        "backend": backend,
        "policy": policy,
        "principal": principal,
        "resume_prefix": resume_prefix,
        "exclude_paths": exclude_paths,
        "max_lag_bytes": max_lag_bytes,
        "max_lag_seconds": max_lag_seconds,
        "shutdown_timeout": shutdown_timeout,
        "keep_alive": keep_alive,
        "resume_secret": resume_secret,
        "resume_token_ttl": resume_token_ttl,
        "client_timeout": client_timeout,
        "upstreams": upstreams,
        "takeover_sinks": () if takeover_sinks is None else takeover_sinks,
    }
    check_options(**options)
    for name, nested, middleware in (
        ("idempotency", idempotency, IdempotencyMiddleware),
        ("drain", drain, DrainMiddleware),
    ):
        if isinstance(nested, Mapping):
            refuse_unknown(f"install({name}=...)", nested, middleware)
    traced = telemetry or tracer_provider is not None or meter_provider is not None
    if traced:
        from ._telemetry import require_opentelemetry

        require_opentelemetry()  # now, before anything is added, not at the first request
    for entry in getattr(app, "user_middleware", ()):
        if getattr(entry, "cls", None) in (
            DisconnectMiddleware,
            MeteringMiddleware,
            DrainMiddleware,
        ):
            raise RuntimeError(
                "install() was already called on this app (or one of its middlewares was "
                "added by hand); add the stack once"
            )
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
        request_log=request_log,
    )
    # The records of a replica that died (the attempt it ran, a taken-over generation's next)
    # go where all records do.
    if takeover_sinks is None:
        options["takeover_sinks"] = sinks
    app.add_middleware(DisconnectMiddleware, **options)
    if idempotency:
        settings = dict(idempotency) if isinstance(idempotency, Mapping) else {}
        if principal is not None:
            # One caller identity for claims and generations alike.
            settings.setdefault("principal", principal)
        app.add_middleware(IdempotencyMiddleware, backend=options["backend"], **settings)
    if drain:
        settings = dict(drain) if isinstance(drain, Mapping) else {}
        settings.setdefault("resume_prefix", resume_prefix)
        app.add_middleware(DrainMiddleware, **settings)
    if traced:
        from ._telemetry import TelemetryMiddleware

        app.add_middleware(
            TelemetryMiddleware,
            tracer_provider=tracer_provider,
            meter_provider=meter_provider,
            principal=principal,
        )
