"""OpenTelemetry for the stack: one span per request, one per detached continuation, and the
metrics that tell a working disconnect policy from a broken one.

Optional (``pip install 'asgi-disconnect[otel]'``): nothing here imports OpenTelemetry until
``TelemetryMiddleware`` is built (``install(app, telemetry=True)``, or
``tracer_provider=`` / ``meter_provider=``). It sits outside the other middlewares and learns
what happened only through the contract: the moments the others note on the request's
state, the usage record metering settles there, and the generation's final status.

- The request span is a SERVER span, child of the caller's ``traceparent`` (read with the
  global propagator); under an outer instrumentation (opentelemetry-instrumentation-asgi)
  it is an INTERNAL child of that one's span. It ends with the response.
- Work that detached gets a continuation span, an INTERNAL child of the request span that
  also links to it; it ends when the generation ends.
- Never a span per chunk: what happened in between becomes span events (``first_event``,
  ``client_disconnect``, ``cancelled``, ``stopped``, ``detached``, ``interrupted``).

The GenAI conventions are in development. As they ask, the names of semantic conventions
v1.36.0 are emitted (``gen_ai.system``) unless ``OTEL_SEMCONV_STABILITY_OPT_IN`` lists
``gen_ai_latest_experimental``: then those of v1.44.0 (``gen_ai.provider.name``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from ._contract import Outcome, Principal, RequestState, default_principal, request_state
from ._lifecycle import lifecycle_of
from ._version import __version__

if TYPE_CHECKING:
    from collections.abc import Iterable

    from starlette.types import ASGIApp, Receive, Scope, Send

    from ._records import UsageRecord

__all__ = ["TelemetryMiddleware", "require_opentelemetry", "semconv_latest"]

logger = logging.getLogger("asgi_disconnect")

SCHEMA_1_36 = "https://opentelemetry.io/schemas/1.36.0"
SCHEMA_LATEST = "https://opentelemetry.io/schemas/1.44.0"

# The response formats metering recognises, as GenAI operations and providers.
_OPERATION = {
    "openai_chat": "chat",
    "openai_responses": "chat",
    "anthropic_messages": "chat",
    "gemini": "generate_content",
}
_FORMAT_PROVIDER = {
    "openai_chat": "openai",
    "openai_responses": "openai",
    "anthropic_messages": "anthropic",
    "gemini": "gcp.gemini",
}
# Explicit bucket boundaries the conventions advise for these histograms.
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                  16777216, 67108864)  # fmt: skip
_SECOND_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                   40.96, 81.92)  # fmt: skip
_FAILED_OUTCOMES = frozenset({"error", "truncated", "interrupted"})


def require_opentelemetry() -> None:
    """Raise an ImportError that says what to install when OpenTelemetry is missing."""
    try:
        import opentelemetry.metrics
        import opentelemetry.trace  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "telemetry needs OpenTelemetry: pip install 'asgi-disconnect[otel]'"
        ) from exc


def semconv_latest(environ: Any = os.environ) -> bool:
    """Whether ``OTEL_SEMCONV_STABILITY_OPT_IN`` asks for the latest GenAI conventions."""
    values = (environ.get("OTEL_SEMCONV_STABILITY_OPT_IN") or "").split(",")
    return "gen_ai_latest_experimental" in {value.strip() for value in values}


def _header_getter() -> Any:
    from opentelemetry.propagators.textmap import Getter

    class ASGIHeaders(Getter[list[tuple[bytes, bytes]]]):
        def get(self, carrier: list[tuple[bytes, bytes]], key: str) -> list[str] | None:
            name = key.lower().encode("latin-1")
            found = [value.decode("latin-1") for k, value in carrier if k == name]
            return found or None

        def keys(self, carrier: list[tuple[bytes, bytes]]) -> list[str]:
            return [k.decode("latin-1") for k, _ in carrier]

    return ASGIHeaders()


class _Counts:
    """Monotonic sums kept as plain integers per attribute set, observed at collection: a
    request pays a dictionary update, not an instrument call."""

    __slots__ = ("attributes", "values")

    def __init__(self) -> None:
        self.values: dict[tuple[str, ...], int] = {}
        self.attributes: dict[tuple[str, ...], dict[str, str]] = {}

    def add(self, amount: int, names: tuple[str, ...], key: tuple[str, ...]) -> None:
        values = self.values
        if key in values:
            values[key] += amount
        else:
            self.attributes[key] = {n: v for n, v in zip(names, key, strict=True) if v}
            values[key] = amount

    def observe(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        attributes = self.attributes
        # A copy made in one C call: the event loop's thread may add a key meanwhile.
        return [Observation(value, attributes[key]) for key, value in list(self.values.items())]


class TelemetryMiddleware:
    """Spans and metrics for every HTTP request that passes; see the module's docstring.

    ``tracer_provider`` / ``meter_provider``: the providers to use (default: the global
    ones). ``principal``: how the caller is identified when this is the outermost
    middleware of the package (``install()`` passes the stack's).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        principal: Principal | None = None,
    ) -> None:
        require_opentelemetry()
        from opentelemetry import context, metrics, propagate, trace

        self.app = app
        self.principal = principal or default_principal
        self.latest = semconv_latest()
        self.provider_key = "gen_ai.provider.name" if self.latest else "gen_ai.system"
        schema = SCHEMA_LATEST if self.latest else SCHEMA_1_36
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._trace = trace
        self._get_current_span = trace.get_current_span
        self._set_span_in_context = trace.set_span_in_context
        self._context = context
        self._propagate = propagate
        self._getter = _header_getter()
        # The headers the global propagator reads: a request without any is not parsed.
        self._fields = frozenset(
            field.lower().encode("latin-1") for field in propagate.get_global_textmap().fields
        )
        self._server = trace.SpanKind.SERVER
        self._internal = trace.SpanKind.INTERNAL
        self._error = trace.StatusCode.ERROR
        self.tracer = trace.get_tracer(
            "asgi_disconnect", __version__, tracer_provider, schema_url=schema
        )
        meter = metrics.get_meter("asgi_disconnect", __version__, meter_provider, schema_url=schema)
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used.",
            explicit_bucket_boundaries_advisory=list(_TOKEN_BUCKETS),
        )
        self.duration = meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="GenAI operation duration.",
            explicit_bucket_boundaries_advisory=list(_SECOND_BUCKETS),
        )
        self.first_chunk = meter.create_histogram(
            "gen_ai.client.operation.time_to_first_chunk",
            unit="s",
            description="Time to receive the first chunk of a streamed response.",
            explicit_bucket_boundaries_advisory=list(_SECOND_BUCKETS),
        )
        self.counts: dict[str, _Counts] = {}
        for name, unit, description in (
            ("asgi_disconnect.requests.disconnected", "{request}",
             "Requests whose client left before the response was complete."),
            ("asgi_disconnect.requests.cancelled", "{request}",
             "Requests whose work was cancelled: by the policy when the client left, or by "
             "its owner (Stop)."),
            ("asgi_disconnect.generations.detached", "{generation}",
             "Generations that went on after their client left."),
            ("asgi_disconnect.generations.detach_completed", "{generation}",
             "Detached generations that completed."),
            ("asgi_disconnect.generations.interrupted", "{generation}",
             "Generations the server or the process stopped before they ended."),
            ("asgi_disconnect.output_tokens.billed", "{token}",
             "Output tokens the upstream produced (reported, else estimated)."),
            ("asgi_disconnect.output_tokens.delivered", "{token}",
             "Output tokens that reached the client."),
            ("asgi_disconnect.idempotency.requests", "{request}",
             "Requests with an Idempotency-Key, by outcome."),
            ("asgi_disconnect.generations.taken_over", "{generation}",
             "Attempts that finished a generation whose owner was gone, by continuation "
             "kind and outcome (complete, interrupted, cancelled, error)."),
        ):  # fmt: skip
            counts = self.counts[name] = _Counts()
            meter.create_observable_counter(
                name, [counts.observe], unit=unit, description=description
            )
        self.in_flight = 0
        meter.create_observable_up_down_counter(
            "asgi_disconnect.requests.in_flight",
            [self._observe_in_flight],
            unit="{request}",
            description="Requests whose response is under way.",
        )

    def _observe_in_flight(self, options: Any) -> Iterable[Any]:
        from opentelemetry.metrics import Observation

        return [Observation(self.in_flight)]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._not_http(scope, receive, send)
            return
        state = request_state(scope, self.principal)
        state.marks = []
        context = self._context
        parent = context.get_current()
        if self._get_current_span(parent).get_span_context().is_valid:
            kind = self._internal  # an outer instrumentation's span is the server span
        else:
            kind = self._server
            headers = scope["headers"]
            # In one C call: does the request carry a header the propagator reads?
            if not self._fields.isdisjoint(dict(headers)):
                parent = self._propagate.extract(headers, parent, getter=self._getter)
        method = scope["method"]
        span = self.tracer.start_span(
            method,
            parent,
            kind,
            {
                "http.request.method": method,
                "url.path": scope["path"],
                "url.scheme": scope.get("scheme", "http"),
            },
        )
        token = context.attach(self._set_span_in_context(span, parent))
        self.in_flight += 1
        failure: BaseException | None = None
        try:
            await self.app(scope, receive, send)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            context.detach(token)
            self.in_flight -= 1
            try:
                self._response_over(span, scope, state, failure)
            except Exception:  # telemetry never fails a request
                logger.exception("recording the request's telemetry failed")

    def attempt_started(
        self, generation_id: str, attempt: int, kind: str, trace: str | None
    ) -> object:
        """A span for one attempt of a generation taken over here, linked to the first
        attempt's span (its ``traceparent``, stored with the generation)."""
        links = []
        if trace:
            carrier = {"traceparent": trace}
            first = self._get_current_span(self._propagate.extract(carrier)).get_span_context()
            if first.is_valid:
                links.append(self._trace.Link(first))
        return self.tracer.start_span(
            "asgi_disconnect.takeover",
            kind=self._internal,
            attributes={
                "asgi_disconnect.generation_id": generation_id,
                "asgi_disconnect.attempt": attempt,
                "asgi_disconnect.continuation": kind,
            },
            links=links,
        )

    def attempt_ended(self, token: object, outcome: str, error: str | None) -> None:
        span: Any = token
        kind = str(span.attributes.get("asgi_disconnect.continuation", ""))
        span.set_attribute("asgi_disconnect.outcome", outcome)
        if error is not None and outcome != "complete":
            span.set_status(self._error, error[:200])
        span.end()
        counts = self.counts
        counts["asgi_disconnect.generations.taken_over"].add(
            1, ("asgi_disconnect.continuation", "asgi_disconnect.outcome"), (kind, outcome)
        )
        # Detach started and completed stay comparable across replicas: the replica that
        # finishes a taken-over generation counts how it ended (its route is not known here).
        key = ("", "detach")
        if outcome == "complete":
            counts["asgi_disconnect.generations.detach_completed"].add(1, _POLICY_NAMES, key)
        elif outcome == "interrupted":
            counts["asgi_disconnect.generations.interrupted"].add(1, _POLICY_NAMES, key)

    async def _not_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            lifecycle, owner = lifecycle_of(scope)
            lifecycle.register("TelemetryMiddleware", unique=True, close=self.flush)
            lifecycle.attempts = self  # the attempts of generations taken over here
            await lifecycle.run(owner, self.app, scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _response_over(
        self, span: Any, scope: Scope, state: RequestState, failure: BaseException | None
    ) -> None:
        ended = time.time_ns()
        route = _route(scope)
        # Named before routing: now the route is known.
        name = f"{scope['method']} {route}" if route else None
        marks = state.marks or []
        progress = state.progress()
        detached = progress.detached and progress.ending is None
        state.marks = [] if detached else None
        if (
            progress.disconnect_reason is not None
            or progress.detached
            or progress.idempotency is not None
        ):
            self._count_request(route, state, progress)
        if detached:
            # The response is over, the work goes on: the continuation span follows it.
            self._continue(span, state, failure, marks, ended, route, name, scope["method"])
            return
        if state.usage_settled:
            # Over, or answered without DisconnectMiddleware (a replay, a refusal). Else the
            # record comes later, to the same call.
            self._end_span(span, state, failure, marks, ended, route, name, True, state.usage)
        else:
            state.on_usage(
                partial(self._end_span, span, state, failure, marks, ended, route, name, True)
            )

    def _continue(
        self,
        span: Any,
        state: RequestState,
        failure: BaseException | None,
        marks: list[tuple[str, int]],
        ended: int,
        route: str,
        name: str | None,
        method: str,
    ) -> None:
        """End the request span of work that detached, and start its continuation span,
        which ends when the work does."""
        detached_at = next((t for moment, t in marks if moment == "detached"), ended)
        continuation = self.tracer.start_span(
            "detached " + (name or method),
            self._set_span_in_context(span),
            self._internal,
            {"asgi_disconnect.generation.id": state.generation_id},
            [self._trace.Link(span.get_span_context())],
            detached_at,
        )
        self._end_span(span, state, failure, marks, ended, route, name, False, None)
        state.on_usage(
            lambda record: self._end_span(
                continuation, state, None, state.marks or [], None, route, None, True, record
            )
        )

    def _count_request(self, route: str, state: RequestState, progress: Outcome) -> None:
        policy = str(progress.policy) if progress.policy is not None else ""
        counts = self.counts
        if progress.disconnect_reason is not None:
            counts["asgi_disconnect.requests.disconnected"].add(1, _POLICY_NAMES, (route, policy))
        if progress.detached:
            counts["asgi_disconnect.generations.detached"].add(1, _POLICY_NAMES, (route, policy))
        outcome = progress.idempotency
        if outcome is not None:
            counts["asgi_disconnect.idempotency.requests"].add(
                1, _IDEMPOTENCY_NAMES, (route, outcome)
            )

    def _end_span(
        self,
        span: Any,
        state: RequestState,
        failure: BaseException | None,
        marks: list[tuple[str, int]],
        end_time: int | None,
        route: str,
        name: str | None,
        last: bool,
        record: UsageRecord | None,
    ) -> None:
        """Put what is known on ``span`` and end it. ``name``: its name now that the route
        is known (None: as it is); ``last``: the work is over, so its record and the
        generation's status are counted (once per request)."""
        if failure is not None and isinstance(failure, asyncio.CancelledError):
            failure = None  # a cancel is no error of the request's
        generation = state.generation
        progress = state.progress()
        # The generation's status is told once its work is over.
        generation_status = str(generation.status) if last and generation is not None else None
        error_type = _error_type(failure, record, generation_status)
        genai = None if record is None else self._genai(state, record, error_type)
        if span.is_recording():
            status = progress.status
            attributes = _attributes(
                state, progress, record, genai, status, generation_status, error_type
            )
            if route:
                attributes["http.route"] = route
            span.set_attributes(attributes)
            if name is not None:
                span.update_name(name)
            if error_type is not None or (status or 0) >= 500:
                if failure is not None:
                    span.record_exception(failure)
                span.set_status(self._error, error_type or f"HTTP {status}")
            for moment, at in marks:
                span.add_event("asgi_disconnect." + moment, timestamp=at)
        span.end(end_time)
        if last:
            self._count_end(state, progress, route, record, genai, generation_status)

    def _genai(
        self, state: RequestState, record: UsageRecord, error_type: str | None
    ) -> dict[str, Any]:
        """The GenAI attributes a span and the GenAI metrics share; empty if the response
        is not one of a known GenAI API."""
        operation = _OPERATION.get(record.provider or "")
        if operation is None:
            return {}
        genai: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            self.provider_key: state.provider_name or _FORMAT_PROVIDER[record.provider or ""],
        }
        if state.request_model is not None:
            genai["gen_ai.request.model"] = state.request_model
        if record.model is not None:
            genai["gen_ai.response.model"] = record.model
        if error_type is not None:
            genai["error.type"] = error_type
        return genai

    def _count_end(
        self,
        state: RequestState,
        progress: Outcome,
        route: str,
        record: UsageRecord | None,
        genai: dict[str, Any] | None,
        status: str | None,
    ) -> None:
        counts = self.counts
        key = (route, str(progress.policy) if progress.policy is not None else "")
        if progress.ending == "cancelled":
            counts["asgi_disconnect.requests.cancelled"].add(1, _POLICY_NAMES, key)
        if progress.detached and status == "complete":
            counts["asgi_disconnect.generations.detach_completed"].add(1, _POLICY_NAMES, key)
        if status == "interrupted" and progress.stopped_by != "handover":
            # Handed over, it is finished elsewhere (counted there, see attempt_ended).
            counts["asgi_disconnect.generations.interrupted"].add(1, _POLICY_NAMES, key)
        if record is None:
            return
        billed = record.output_tokens
        if billed is not None:
            counts["asgi_disconnect.output_tokens.billed"].add(billed, _POLICY_NAMES, key)
            delivered = record.delivered_output_tokens or 0
            counts["asgi_disconnect.output_tokens.delivered"].add(delivered, _POLICY_NAMES, key)
        if not genai:
            return
        self.duration.record(record.duration, genai)
        if record.time_to_first_event is not None:
            self.first_chunk.record(record.time_to_first_event, genai)
        if record.usage_source == "provider":
            if record.input_tokens is not None:
                self.token_usage.record(
                    record.input_tokens, {**genai, "gen_ai.token.type": "input"}
                )
            if record.output_tokens is not None:
                self.token_usage.record(
                    record.output_tokens, {**genai, "gen_ai.token.type": "output"}
                )

    async def flush(self) -> None:
        """Export what the providers hold (at shutdown, after the last records)."""
        from opentelemetry import metrics, trace

        for provider in (
            self.tracer_provider or trace.get_tracer_provider(),
            self.meter_provider or metrics.get_meter_provider(),
        ):
            force_flush = getattr(provider, "force_flush", None)
            if force_flush is not None:
                await asyncio.to_thread(force_flush)


_POLICY_NAMES = ("http.route", "asgi_disconnect.policy")
_IDEMPOTENCY_NAMES = ("http.route", "asgi_disconnect.idempotency.outcome")


def _attributes(
    state: RequestState,
    progress: Outcome,
    record: UsageRecord | None,
    genai: dict[str, Any] | None,
    status: int | None,
    generation_status: str | None,
    error_type: str | None,
) -> dict[str, Any]:
    """A recorded span's attributes (an unsampled span gets none built), all at once."""
    attributes: dict[str, Any] = {
        "asgi_disconnect.generation.id": state.generation_id,
        "asgi_disconnect.detached": progress.detached,
        "asgi_disconnect.produced.bytes": progress.produced_bytes,
        "asgi_disconnect.delivered.bytes": progress.delivered_bytes,
        "asgi_disconnect.delivery": progress.delivery,
    }
    if status is not None:
        attributes["http.response.status_code"] = status
    if progress.policy is not None:
        attributes["asgi_disconnect.policy"] = str(progress.policy)
    if progress.ending is not None:
        attributes["asgi_disconnect.ending"] = str(progress.ending)
    if progress.idempotency is not None:
        attributes["asgi_disconnect.idempotency.outcome"] = progress.idempotency
    if generation_status is not None:
        attributes["asgi_disconnect.generation.status"] = generation_status
    if record is not None:
        _record_attributes(attributes, record, genai)
    if error_type is not None:
        attributes["error.type"] = error_type
    return attributes


def _error_type(
    failure: BaseException | None, record: UsageRecord | None, generation_status: str | None
) -> str | None:
    """The request's ``error.type``: the failure's, else its record's or its record's failed
    outcome; a generation interrupted before it had a record is ``interrupted``."""
    error_type = None
    if failure is not None:
        error_type = getattr(failure, "error_type", None) or type(failure).__qualname__
    if record is None:
        return "interrupted" if generation_status == "interrupted" else error_type
    if error_type is None:
        error_type = record.error_type
    if error_type is None and record.outcome in _FAILED_OUTCOMES:
        error_type = record.outcome
    return error_type


def _record_attributes(
    attributes: dict[str, Any], record: UsageRecord, genai: dict[str, Any] | None
) -> None:
    attributes["asgi_disconnect.outcome"] = record.outcome
    attributes["asgi_disconnect.usage.source"] = record.usage_source
    if record.produced_output_tokens is not None:
        attributes["asgi_disconnect.produced.output_tokens"] = record.produced_output_tokens
    if record.delivered_output_tokens is not None:
        attributes["asgi_disconnect.delivered.output_tokens"] = record.delivered_output_tokens
    if genai:
        attributes.update(genai)
    if record.usage_source == "provider":
        if record.input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = record.input_tokens
        if record.output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = record.output_tokens
    if record.finish_reason:
        attributes["gen_ai.response.finish_reasons"] = (record.finish_reason,)


def _route(scope: Scope) -> str:
    """The matched route's template; never the raw path (unbounded cardinality)."""
    return getattr(scope.get("route"), "path", None) or ""
