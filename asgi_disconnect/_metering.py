"""MeteringMiddleware: exactly one usage record per request, whatever the client did."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import msgspec

from ._adapters import FORMATS
from ._aio import shielded
from ._contract import (
    METERED_ATTRIBUTE,
    Ending,
    Outcome,
    RequestState,
    Reservations,
    UsageSink,
    content_kind,
)
from ._lifecycle import lifecycle_of
from ._llm_stream import (
    WINDOW,
    StreamMeter,
    StreamReport,
    _after_blank_line,
    first_strings,
    last_usage,
)
from ._records import UsageRecord
from ._request_log import REQUESTS, check_format, log_request
from .metering import analyze, llm_shape

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ._contract import GenerationOutput, LogStore

__all__ = [
    "MeteringMiddleware",
    "metered",
    "Reservations",
    "UsageRecord",
    "UsageSink",
    "estimate_tokens",
]

logger = logging.getLogger("asgi_disconnect")

_OFF_LOOP_TEXT = 64 * 1024
_ENDING_INTERRUPTED = Ending.INTERRUPTED
# An event stream under DisconnectMiddleware is read as it is produced only for its first
# events (its format, model and first event; Anthropic's message_start); then the generation
# log, which holds every byte, has the rest: metering reads its end (the provider's usage,
# the terminal marker, an error) when it ends, and the whole only when the record needs its
# text (an estimate, the share delivered, a calibration sample).
_HEAD_EVENTS = 8
_JSON_LIMIT = 4 << 20
# A JSON body over _JSON_LIMIT is read by its ends: where an LLM API puts what metering
# needs (``object``, ``model`` first; ``usage`` last).
_JSON_HEAD = 64 << 10
_JSON_TAIL = 256 << 10
# How long a record waits for the store to give back a stream's bytes its log let go.
_STORED_READ_TIMEOUT = 30.0


def estimate_tokens(text: str) -> int:
    """The default estimate: about four characters per token, at least one for any text.

    Close to the BPE tokenizers of the major providers for English prose; pass your own
    ``tokenizer=`` to ``MeteringMiddleware`` for better figures.
    """
    return 0 if not text else max(1, round(len(text) / 4))


# A model's characters per token are learned from this many of its output tokens, as the
# provider counted them, before estimates use them; the sums are halved past _CALIBRATED_CAP.
_CALIBRATED_AFTER = 200
_CALIBRATED_CAP = 1 << 20
_LEARNED_ANSWERS = 8
_SAMPLED_EVERY = 32


class Calibration:
    """Characters per output token, per model, from the provider-reported usage of earlier
    complete generations: what the default estimate divides by once it knows a model."""

    __slots__ = ("_answers", "_seen")

    def __init__(self) -> None:
        self._seen: dict[str, list[float]] = {}  # model -> [characters, tokens, answers]
        self._answers = 0

    def learn(self, model: str | None, characters: int, tokens: int | None) -> None:
        if model is None or not tokens or tokens <= 0 or characters <= 0:
            return
        seen = self._seen.setdefault(model, [0.0, 0.0, 0.0])
        seen[0] += characters
        seen[1] += tokens
        seen[2] += 1
        if seen[1] > _CALIBRATED_CAP:
            seen[0] /= 2
            seen[1] /= 2
        if len(self._seen) > 1024:
            self._seen.pop(next(iter(self._seen)))

    def wants(self, model: str | None) -> bool:
        """Whether to learn from a complete answer of ``model``: each of its first
        ``_LEARNED_ANSWERS`` (and until it is known), then one in ``_SAMPLED_EVERY``
        (reading a stream's text costs a decode of it)."""
        if model is None:
            return False
        seen = self._seen.get(model)
        if seen is None or seen[1] < _CALIBRATED_AFTER or seen[2] < _LEARNED_ANSWERS:
            return True
        self._answers += 1
        return self._answers % _SAMPLED_EVERY == 0

    def ratio(self, model: str | None) -> tuple[float, int] | None:
        """(characters per token, answers learned from) for ``model``, once known."""
        seen = self._seen.get(model) if model is not None else None
        if seen is None or seen[1] < _CALIBRATED_AFTER:
            return None
        return seen[0] / seen[1], int(seen[2])


_E = TypeVar("_E", bound=Callable[..., Any])


def metered(provider: str | bool | None = None) -> Callable[[_E], _E]:
    """Say whether an endpoint's requests get a usage record.

    ``@metered()`` (or ``@metered("anthropic_messages")``, naming the wire format): every
    request gets exactly one record, whatever its response was. ``@metered(False)``: none,
    and metering costs the route nothing past its response start. An endpoint without the
    decorator is metered when its response is an event stream or a JSON response of an LLM
    API (an OpenAI, Anthropic or Gemini shape, or a ``usage`` object), when it failed or was
    cancelled before its response started, or when a reservation was made for it.
    """
    if provider is not None and not isinstance(provider, bool) and provider not in FORMATS:
        raise ValueError(f"provider must be one of {', '.join(FORMATS)}, True, False or None")
    mark: str | bool = True if provider is None else provider

    def decorate(endpoint: _E) -> _E:
        setattr(endpoint, METERED_ATTRIBUTE, mark)
        return endpoint

    return decorate


def _route_mark(scope: Scope) -> str | bool | None:
    """What ``@metered`` says of the routed endpoint, if routing has happened."""
    endpoint = scope.get("endpoint") or getattr(scope.get("route"), "endpoint", None)
    return getattr(endpoint, METERED_ATTRIBUTE, None)


class MeteringMiddleware:
    """Tees every produced body byte into an SSE decoder and a provider adapter.

    The tee is synchronous (it never awaits anything the client controls). Exactly one
    ``UsageRecord`` per HTTP request goes to each sink, from a cancellation-shielded
    ``finally``; under ``DisconnectMiddleware`` it is emitted when the exchange is
    over, so ``delivered_bytes`` is final. Sinks and reservations that raise are logged,
    never raised into the request.

    ``request_log``: with each record, one line in the ``asgi_disconnect.requests`` logger
    at INFO: ``"text"`` (the default), ``"json"`` (one object per line) or None (none).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        sinks: Sequence[UsageSink] = (),
        provider: str | Callable[[Scope], str | None] | None = None,
        reservations: Reservations | None = None,
        tokenizer: Callable[[str], int] = estimate_tokens,
        request_log: str | None = "text",
    ) -> None:
        self.request_log = check_format(request_log)
        self.app = app
        self.sinks = tuple(sinks)
        self.provider = provider
        # Asked per request, or the same for all.
        self._provider_of = provider if callable(provider) else None
        self._provider = None if callable(provider) else provider
        self.reservations = reservations
        self.tokenizer = tokenizer
        self.calibration = Calibration()
        # What each request's tee is given: how to count tokens, and where records go.
        self._counting = _Counting(tokenizer=tokenizer, calibration=self.calibration)
        self._emitter = _Emitter(self.sinks, reservations, self.request_log)

    @property
    def records(self) -> int:
        """How many usage records were emitted."""
        return self._emitter.records

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.get("asgi_disconnect")
        if type(state) is not RequestState and not isinstance(state, RequestState):
            state = None
        else:
            state.expect_usage()
        provider_of = self._provider_of
        provider = provider_of(scope) if provider_of is not None else self._provider
        tee = _Tee(
            scope, provider, time.time(), time.monotonic(), state, self._counting, self._emitter
        )
        if self.reservations is not None:
            try:
                tee.reservation = await self.reservations.reserve(scope)
            except Exception:
                logger.exception("reserve() failed; the request runs without a reservation")

        if state is not None and state.on_message(send, tee.observe):
            # DisconnectMiddleware is right outside: it shows us each message the app
            # sends, so the app gets its send as it is, not one more coroutine per chunk.
            tee.direct = True
            app_send = send
        else:

            async def app_send(message: Message) -> None:
                tee.observe(message)
                await send(message)

        failure: _Failure | None = None
        try:
            await self.app(scope, receive, app_send)
        except BaseException as exc:
            failure = _Failure.of(exc)
            raise
        finally:
            tee.failure = failure
            tee.ended = time.monotonic()
            if state is not None:
                # The exchange may still be delivering: record when it is over.
                state.on_end(tee.over)
            else:
                await shielded(tee.emit())

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait for records still being emitted (called at lifespan shutdown)."""
        await self._emitter.drain(timeout)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle, owner = lifecycle_of(scope)
        lifecycle.register("MeteringMiddleware", unique=True, flush=self.drain)
        await lifecycle.run(owner, self.app, scope, receive, send)


class _Counting(msgspec.Struct, frozen=True, kw_only=True):
    """How a record counts the tokens its provider did not report: with the tokenizer
    given, else at the characters per token ``calibration`` learned for the model, else at
    four; built once per middleware, given to each request's tee."""

    tokenizer: Callable[[str], int]
    calibration: Calibration

    @property
    def custom(self) -> bool:
        """Whether the tokenizer is one given (not a division: a long text is counted off
        the loop)."""
        return self.tokenizer is not estimate_tokens

    def estimate(self, text: str, model: str | None) -> tuple[int, str]:
        """Tokens in ``text`` and how they were counted."""
        if self.tokenizer is not estimate_tokens:
            return self.tokenizer(text), "estimated with the tokenizer given"
        calibrated = self.calibration.ratio(model)
        if calibrated is None:
            return estimate_tokens(text), "estimated at 4 characters per token"
        ratio, answers = calibrated
        return max(1, round(len(text) / ratio)), (
            f"estimated at {ratio:.2f} characters per token, calibrated on {answers} "
            f"answer(s) of {model}"
        )

    def wants_sample(self, report: Any) -> bool:
        """Whether the calibration learns from this report's text: a complete answer with
        the provider's counts, of a model it samples now."""
        return (
            report.usage_source == "provider"
            and report.terminal_marker_seen
            and bool(report.output_tokens)
            and self.calibration.wants(report.model)
        )

    async def off_loop(self, report: Any) -> int | None:
        """The output tokens of a long text with none reported, counted in a thread by the
        tokenizer given; None for the others (counted with the record)."""
        if report.output_tokens is None and len(report.text) > _OFF_LOOP_TEXT and self.custom:
            return await asyncio.to_thread(self.tokenizer, report.text)
        return None

    def counts(
        self,
        report: Any,
        text: str,
        estimate: int | None,
        request_body: bytes | None,
        notes: list[str],
    ) -> tuple[int | None, int | None, str]:
        """(input tokens, output tokens, their source): the provider's, else estimated from
        the text produced (``estimate`` if counted already) and the prompt in
        ``request_body`` (how, in ``notes``); a complete answer with the provider's counts
        teaches the calibration."""
        input_tokens, output_tokens = report.input_tokens, report.output_tokens
        usage_source = report.usage_source
        if usage_source == "provider" and output_tokens and text and report.terminal_marker_seen:
            self.calibration.learn(
                report.model, len(text), output_tokens - (report.reasoning_tokens or 0)
            )
        if output_tokens is None and text:
            if estimate is not None:
                output_tokens, how = estimate, "estimated with the tokenizer given"
            else:
                output_tokens, how = self.estimate(text, report.model)
            usage_source = "estimated"
            notes.append(how)
        if input_tokens is None and request_body is not None:
            # The provider's usage never came (a cancel): the prompt the app sent upstream.
            prompt = prompt_text(request_body)
            if prompt:
                input_tokens, how = self.estimate(prompt, report.model)
                usage_source = "estimated"
                if how not in notes:
                    notes.append(how)
        return input_tokens, output_tokens, usage_source


class _Emitter:
    """Where a middleware's records go: the request's state, the request log, the
    reservations and the sinks. Emissions that wait on something (a reservation, an async
    sink, a long text) run in order in one task, not a task per request."""

    __slots__ = ("_jobs", "_task", "records", "request_log", "reservations", "sinks")

    def __init__(
        self,
        sinks: tuple[UsageSink, ...],
        reservations: Reservations | None,
        request_log: str | None,
    ) -> None:
        self.sinks = sinks
        self.reservations = reservations
        self.request_log = request_log
        self.records = 0
        self._jobs: deque[Awaitable[None]] = deque()
        self._task: asyncio.Task[None] | None = None

    def emit(self, record: UsageRecord, state: RequestState | None, ended: Outcome | None) -> None:
        """Emit ``record`` now (no reservation waits for it); what async sinks return is
        queued."""
        self._settle(record, state, ended)
        for waiting in self._to_sinks(record):
            self.queue(waiting)

    async def emit_waiting(
        self,
        record: UsageRecord,
        state: RequestState | None,
        ended: Outcome | None,
        reservation: Any,
    ) -> None:
        """Emit ``record``, settle its reservation and await what async sinks return."""
        self._settle(record, state, ended)
        if self.reservations is not None:
            try:
                await self.reservations.settle(reservation, record)
            except Exception:
                logger.exception("settle() failed for generation %s", record.generation_id)
        for waiting in self._to_sinks(record):
            await waiting

    def _settle(
        self, record: UsageRecord, state: RequestState | None, ended: Outcome | None
    ) -> None:
        self.records += 1
        if state is not None:
            state.settle_usage(record)
        if self.request_log is not None and REQUESTS.isEnabledFor(logging.INFO):
            log_request(self.request_log, record, ended)

    def _to_sinks(self, record: UsageRecord) -> Sequence[Awaitable[None]]:
        """Give ``record`` to each sink; what async sinks return, to await in order."""
        waiting: list[Awaitable[None]] | None = None
        for sink in self.sinks:
            try:
                result = sink(record)
            except Exception:
                logger.exception("a usage sink failed for generation %s", record.generation_id)
                continue
            if result is not None:
                if waiting is None:
                    waiting = []
                waiting.append(_awaited(result, record))
        return waiting or ()

    def queue(self, job: Awaitable[None]) -> None:
        self._jobs.append(job)
        task = self._task
        if task is None or task.done():
            # A context of its own: it outlives the request that happened to start it.
            self._task = asyncio.get_running_loop().create_task(
                self._run(), context=contextvars.Context()
            )

    async def _run(self) -> None:
        jobs = self._jobs
        while jobs:
            try:
                await jobs[0]
            except Exception:
                logger.exception("emitting a usage record failed")
            finally:
                jobs.popleft()

    async def drain(self, timeout: float) -> None:
        """Wait for the queued emissions."""
        task = self._task
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout)


class _Failure(NamedTuple):
    """What metering keeps of the exception the app raised: not the exception, whose
    traceback's frames refer back to the request's objects (a reference cycle that would
    wait for the cyclic garbage collector)."""

    name: str
    cancelled: bool
    error_type: str | None

    @classmethod
    def of(cls, exc: BaseException) -> _Failure:
        error_type = getattr(exc, "error_type", None)
        return cls(
            type(exc).__name__,
            isinstance(exc, asyncio.CancelledError),
            error_type if isinstance(error_type, str) else None,
        )


class _Tee:
    """One request's metering: every body byte the app produces, seen synchronously, and
    when the exchange is over its usage record, made and emitted."""

    __slots__ = (
        "counting",
        "direct",
        "emitter",
        "ended",
        "failure",
        "first_event",
        "json",
        "mark",
        "outcome",
        "produced",
        "provider",
        "recognized",
        "reservation",
        "scope",
        "started",
        "started_at",
        "state",
        "status_code",
        "stream",
    )

    def __init__(
        self,
        scope: Scope,
        provider: str | None,
        started_at: float,
        started: float,
        state: RequestState | None,
        counting: _Counting,
        emitter: _Emitter,
    ) -> None:
        self.scope = scope
        self.counting = counting
        self.emitter = emitter
        self.reservation: Any = None
        self.outcome: Outcome | None = None  # DisconnectMiddleware's, when the exchange ends
        self.mark: str | bool | None = None  # what @metered says, read at the start
        self.recognized = False  # a JSON body of an LLM API (see ``report``)
        self.provider = provider
        self.state = state
        self.started_at = started_at
        self.started = started
        self.ended = started
        self.stream: _EventStream | None = None
        self.json: _HeldJson | None = None
        self.status_code: int | None = None
        self.produced = 0
        self.first_event: float | None = None
        self.failure: _Failure | None = None
        # Seeing each message of the app right where DisconnectMiddleware logs it: an event
        # stream may then be left to its log after its first events.
        self.direct = False

    def observe(self, message: Message) -> bool | None:
        """Read one message the app sends; True: metering needs no more of them (the
        generation log holds the rest of the body)."""
        kind = message["type"]
        if kind == "http.response.body":
            body = message.get("body", b"")
            if not body:
                return None
            self.produced += len(body)
            stream = self.stream
            if stream is not None:
                meter = stream.meter
                meter.feed(body)
                if self.first_event is None and meter.event_count:
                    self._first_event()
                if self.direct and meter.event_count >= _HEAD_EVENTS:
                    return stream.to_log(self.state)
            elif self.json is not None:
                self.json.add(body, self.produced)
        elif kind == "http.response.start":
            self._start(message)
        return None

    def over(self, outcome: Outcome) -> None:
        """The exchange is over (``RequestState.on_end``): emit its record now when nothing
        in it waits (no reservation to settle, a short text to count, sinks that return
        nothing), else queue the emission for the emitter's task."""
        state = self.state
        assert state is not None
        self.outcome = outcome
        emitter = self.emitter
        stream = self.stream
        # At most how many characters of text the report holds: counted off the loop above
        # _OFF_LOOP_TEXT (unless the count is the default's, a division).
        if (
            emitter.reservations is not None
            or (stream.meter.text_chars if stream is not None else self.produced) > _OFF_LOOP_TEXT
        ):
            emitter.queue(self.emit())
            return
        if self.direct and state.generation is None and self.mark is None and self.status_code:
            # DisconnectMiddleware found no LLM exchange in the response (by the rule that
            # ``wanted`` applies): nothing to read, no record.
            if state.usage_pending:
                state.settle_usage(None)
            return
        try:
            report = self.report()
            if not self.wanted(report):
                if state.usage_pending:
                    state.settle_usage(None)
                return
            if stream is not None and self.wants_text(report):
                if not stream.whole_in_memory():
                    emitter.queue(self.emit())
                    return
                report = stream.read_log(self.produced, self.delivered, report)
                if self.counting.custom and len(report.text) > _OFF_LOOP_TEXT:
                    emitter.queue(self.emit(report))
                    return
            record = self.record(report, None)
        except Exception:
            logger.exception("analysing the response failed; its usage is recorded as unknown")
            record = self.unknown_record()
        emitter.emit(record, state, outcome)

    async def emit(self, report: Any = None) -> None:
        """Make the record, waiting for what it needs (the stream's text read back from
        the store, a long text counted off the loop), and emit it."""
        state = self.state
        try:
            if report is None:
                report = self.report()
                if self.reservation is None and not self.wanted(report):
                    if state is not None:
                        state.settle_usage(None)
                    return
                stream = self.stream
                if state is not None and stream is not None and self.wants_text(report):
                    report = await stream.read_stored(
                        self.produced, self.delivered, report, state.log_store, state.generation_id
                    )
            record = self.record(report, await self.counting.off_loop(report))
        except Exception:
            logger.exception("analysing the response failed; its usage is recorded as unknown")
            record = self.unknown_record()
        await self.emitter.emit_waiting(record, state, self.outcome, self.reservation)

    @property
    def delivered(self) -> int:
        """What reached the client, as the exchange's outcome says (all that was produced
        when no DisconnectMiddleware ran the request)."""
        outcome = self.outcome
        return self.produced if outcome is None else outcome.delivered_bytes

    def _first_event(self) -> None:
        self.first_event = time.monotonic() - self.started
        state = self.state
        if state is not None and state.marks is not None:
            state.note("first_event")

    def _start(self, message: Message) -> None:
        """The response starts: what @metered says, and whether it is an event stream or
        JSON (anything else is no LLM response: metering steps aside)."""
        self.status_code = message["status"]
        mark = self.mark = _route_mark(self.scope)
        if mark is False:
            self._step_aside()
            return
        if type(mark) is str:
            self.provider = mark
        kind = content_kind(message.get("headers", ()))
        if kind == "event-stream":
            self.stream = _EventStream(self.provider)
            if self.state is not None:
                self.state.stream_ending = self.ending  # DisconnectMiddleware ends it by this
        elif kind == "json":
            self.json = _HeldJson()
        elif mark is None:
            self._step_aside()

    def ending(self) -> str | None:
        """How the stream ended by its protocol (see ``StreamMeter.ending``); with a
        log, once its end is read."""
        stream = self.stream
        assert stream is not None
        if stream.log is not None:
            self.produced = stream.read_end()
        return stream.meter.ending()

    def _step_aside(self) -> None:
        """No record for this response: stop observing it."""
        state = self.state
        if state is not None:
            state.off_message(self.observe)

    def wanted(self, report: Any) -> bool:
        """Whether this request gets a usage record (see ``metered``)."""
        mark = self.mark
        if mark is not None:
            return mark is not False
        if self.status_code is None:
            return self.failure is not None  # it ended before its response started
        return self.stream is not None or self.recognized

    def report(self) -> Any:
        stream = self.stream
        if stream is not None:
            if stream.log is not None:
                self.produced = stream.read_end()
            return stream.meter.report()
        held = self.json
        if held is not None:
            report, self.recognized = held.report(self.provider, self.status_code)
            return report
        return analyze(b"", self.provider)

    def wants_text(self, report: Any) -> bool:
        """Whether the record needs the text of a stream left to its log: for an estimate,
        the share delivered, or a calibration sample of a complete answer."""
        stream = self.stream
        if stream is None or stream.log is None:
            return False
        if report.output_tokens is None:  # an estimate, unless the provider's usage came aside
            return self.state is None or self.state.upstream_usage is None
        if self.delivered < self.produced:
            return True  # the share delivered
        return self.counting.wants_sample(report)

    def record(self, report: Any, estimate: int | None) -> UsageRecord:
        """The record; ``estimate``: the output tokens counted already (off the loop)."""
        produced = self.produced
        delivered = self.delivered
        if delivered > produced:
            delivered = produced
        outcome, error_type = self.record_outcome(report)
        state = self.state
        upstream = state.upstream_usage if state is not None else None
        if upstream is not None and report.usage_source != "provider":
            report = _with_upstream(report, upstream)
        stream = self.stream
        left = stream is not None and stream.log is not None
        # A stream left to its log has its text only if it was read whole.
        text = "" if stream is not None and stream.text_unread else report.text
        notes: list[str] = []
        input_tokens, output_tokens = report.input_tokens, report.output_tokens
        usage_source = report.usage_source
        if text or (input_tokens is None and state is not None and state.request_body):
            # There is text to count or learn from, or a prompt to estimate.
            request_body = None
            if state is not None and (self.status_code or 0) < 400:  # a refusal bills no input
                request_body = state.request_body
            input_tokens, output_tokens, usage_source = self.counting.counts(
                report, text, estimate, request_body, notes
            )
        held = self.json
        if left or report.skipped_events or (held is not None and held.bounded):
            self._unread(report, output_tokens, usage_source, notes)
        delivered_tokens = output_tokens
        if output_tokens is not None and delivered < produced:
            # Scale the count by the share of the output text that reached the client.
            if text:
                within = stream.text_chars_within(delivered) if stream is not None else 0
                share = within / len(text)
            else:
                share = delivered / max(produced, 1)
            delivered_tokens = min(output_tokens, round(output_tokens * share))
        return self._usage_record(
            outcome,
            error_type,
            delivered,
            provider=report.provider_format,
            model=report.model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            usage_source=usage_source,
            delivered_tokens=delivered_tokens,
            finish_reason=report.finish_reason,
            cache_read_tokens=report.cache_read_tokens,
            reasoning_tokens=report.reasoning_tokens,
            note="; ".join(notes) if notes else None,
        )

    def unknown_record(self) -> UsageRecord:
        """The one record of a response that could not be analysed: usage unknown."""
        failure = self.failure
        return self._usage_record(
            self._failed_outcome() or "unknown",
            failure.name if failure is not None else None,
            min(self.delivered, self.produced),
            provider=self.provider,
        )

    def _usage_record(
        self,
        outcome: str,
        error_type: str | None,
        delivered: int,
        *,
        provider: str | None,
        model: str | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        usage_source: str = "none",
        delivered_tokens: int | None = None,
        finish_reason: str | None = None,
        cache_read_tokens: int | None = None,
        reasoning_tokens: int | None = None,
        note: str | None = None,
    ) -> UsageRecord:
        """The record: what the request was, whatever its body said, and what it cost."""
        scope, state = self.scope, self.state
        path = getattr(scope.get("route"), "path", None)
        ended = self.outcome  # None without DisconnectMiddleware
        policy = ended.policy if ended is not None else None
        return UsageRecord(
            generation_id=state.generation_id if state is not None else None,
            principal=state.principal if state is not None else None,
            method=scope["method"],
            route=path or scope["path"],
            status_code=self.status_code,
            provider=provider,
            model=model,
            outcome=outcome,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            usage_source=usage_source,
            produced_bytes=self.produced,
            delivered_bytes=delivered,
            produced_output_tokens=output_tokens,
            delivered_output_tokens=delivered_tokens,
            time_to_first_event=self.first_event,
            duration=self.ended - self.started,
            finish_reason=finish_reason,
            error_type=error_type,
            started_at=self.started_at,
            cache_read_tokens=cache_read_tokens,
            reasoning_tokens=reasoning_tokens,
            policy=policy.value if policy is not None else None,
            stopped_by=ended.stopped_by if ended is not None else None,
            detached=ended.detached if ended is not None else False,
            delivery=ended.delivery if ended is not None else "sent",
            usage_note=note,
        )

    def record_outcome(self, report: Any) -> tuple[str, str | None]:
        """How the request ended, for its record, and its error type if it failed."""
        failure = self.failure
        outcome = self._failed_outcome()
        if outcome is None:
            if report.error is not None:
                outcome = "error"
            elif report.terminal_marker_seen:
                outcome = "complete"
            else:
                outcome = "truncated"
        error_type = report.error_type
        if error_type is None and failure is not None and not failure.cancelled:
            error_type = failure.error_type or failure.name
        return outcome, error_type

    def _failed_outcome(self) -> str | None:
        """``cancelled``, ``interrupted`` or ``error`` when the exchange says so, else None."""
        failure = self.failure
        if failure is None:
            return "error" if (self.status_code or 0) >= 400 else None
        if failure.cancelled:
            # The exchange's ending says which, a Stop included (``stopped_by`` says why);
            # cancelled from outside, or no DisconnectMiddleware to tell: interrupted.
            ended = self.outcome
            if ended is None or ended.ending is _ENDING_INTERRUPTED or ended.ending is None:
                return "interrupted"
            return "cancelled"
        if failure.error_type == "truncated_stream":
            return "truncated"  # asgi_disconnect.upstream.TruncatedStream
        return "error"

    def _unread(
        self, report: Any, output_tokens: int | None, usage_source: str, notes: list[str]
    ) -> None:
        """Say in ``notes`` what metering could not read."""
        stream = self.stream
        if output_tokens is None and stream is not None and stream.text_unread:
            notes.append("the stream's text could not be read back from the store")
        skipped = report.skipped_events
        if skipped:
            notes.append(f"{skipped} event(s) over the meter's window were not read")
        held = self.json
        if held is not None and held.bounded and usage_source == "none":
            notes.append("a JSON body over 4 MiB, read by its ends: no usage there")


class _EventStream:
    """An event stream as metering reads it: its first events as they are produced; under
    DisconnectMiddleware, the rest from the generation log (``log``), its end when the
    exchange is over, and the whole only when the record needs its text."""

    __slots__ = ("log", "meter", "provider", "within")

    def __init__(self, provider: str | None) -> None:
        self.provider = provider
        # With marks: a stream cut within its first events (the ones read as produced)
        # needs them for the share its client received.
        self.meter = StreamMeter(provider, marks=True)
        self.log: GenerationOutput | None = None
        # With ``log``: the characters of text in the events the client received, once read.
        self.within: int | None = None

    def to_log(self, state: RequestState | None) -> bool:
        """Leave the rest of the stream to the request's generation log, if it has one."""
        log = state.generation if state is not None else None
        if log is None or log.frames_at is not None:
            return False
        self.log = log
        return True

    def read_end(self) -> int:
        """Feed the meter the stream's end as its log keeps it (its last events, see
        ``GenerationOutput.tail_start``), or all it did not read if that is less, unless the
        log let those bytes go (the store has them: the record reads it whole); the bytes
        the app produced."""
        log, meter = self.log, self.meter
        assert log is not None
        end = log.output_size
        fed = meter.bytes_fed
        if end > fed:
            start = min(max(fed, log.tail_start()), end)
            if start < log.base:
                return end
            meter.jump(start - fed)
            meter.feed(log.read_back(start, end))
        return end

    def whole_in_memory(self) -> bool:
        log = self.log
        return log is not None and log.base == 0

    @property
    def text_unread(self) -> bool:
        """Left to its log, and not read whole (its text is not known)."""
        return self.log is not None and self.within is None

    def read_log(self, produced: int, delivered: int, light: Any) -> Any:
        """The whole stream's report, read from its log (all of it in memory)."""
        log = self.log
        assert log is not None
        reader = self._reader(produced, delivered, light)
        for piece in log.pieces():
            if not reader.feed(piece):
                break
        return self._took(reader, light)

    async def read_stored(
        self,
        produced: int,
        delivered: int,
        light: Any,
        store: LogStore | None,
        generation_id: str,
    ) -> Any:
        """The whole stream's report, read from the log and the store that has what it let
        go; ``light`` (what its first events and its end said) if the store cannot give it."""
        if self.whole_in_memory():
            return self.read_log(produced, delivered, light)
        reader = self._reader(produced, delivered, light)
        try:
            async with asyncio.timeout(_STORED_READ_TIMEOUT):
                if store is not None:
                    async for piece in store.follow(generation_id, 0):
                        if not reader.feed(piece):
                            break
        except Exception as exc:
            logger.warning(
                "generation %s: its text could not be read back from the store (%s); its "
                "record has no estimate",
                generation_id,
                exc,
            )
            return light
        return self._took(reader, light)

    def _reader(self, produced: int, delivered: int, light: Any) -> _WholeRead | _TextScan:
        """A reader of the whole stream, fed its bytes in order (from the log, or from the
        store that has what the log let go); ``light``: what its first events and its end
        said. OpenAI chat and Anthropic text is found by a byte scan, the rest decoded."""
        pattern = _TEXT_MEMBERS.get(light.provider_format)
        if pattern is not None:
            return _TextScan(pattern, light, produced, delivered)
        return _WholeRead(StreamMeter(self.provider), produced, delivered)

    def _took(self, reader: _WholeRead | _TextScan, light: Any) -> Any:
        """The report of a whole read (its text, and the text delivered: ``within``), or
        ``light`` if the read did not reach the app's last byte."""
        if reader.offset < reader.end:
            return light
        report = reader.report()
        self.within = reader.within
        return report

    def text_chars_within(self, size: int) -> int:
        """Characters of output text in the events that ended within the first ``size``
        bytes, to the chunk: delivery stops between chunks, except inside a body over
        1 MiB, where the text of that chunk counts as not delivered."""
        if self.log is not None:
            return self.within or 0
        return self.meter.text_chars_within(size)


class _HeldJson:
    """A JSON response body as metering holds it until the record is made: whole up to
    _JSON_LIMIT, past it its first _JSON_HEAD and last _JSON_TAIL bytes."""

    __slots__ = ("chunks", "head", "tail")

    def __init__(self) -> None:
        self.chunks: list[bytes] | None = []
        self.head: bytes | None = None
        self.tail: bytearray | None = None

    @property
    def bounded(self) -> bool:
        """Whether the body outgrew _JSON_LIMIT (only its ends are held)."""
        return self.head is not None

    def add(self, body: bytes, produced: int) -> None:
        """Hold the next message's ``body``; ``produced``: the body's size with it."""
        tail = self.tail
        if tail is None:
            chunks = self.chunks
            assert chunks is not None
            chunks.append(body)
            if produced > _JSON_LIMIT:
                # Too large to hold: keep its head and, from now on, its tail.
                whole = b"".join(chunks)
                self.chunks = None
                self.head = whole[:_JSON_HEAD]
                self.tail = bytearray(whole[-_JSON_TAIL:])
        else:
            tail += body
            if len(tail) > 2 * _JSON_TAIL:
                del tail[: len(tail) - _JSON_TAIL]

    def report(self, provider: str | None, status: int | None) -> tuple[Any, bool]:
        """What the body said, and whether it is an LLM API's (see ``_json_report``)."""
        head, tail = self.head, self.tail
        if head is not None and tail is not None:
            return _json_ends_report(head, bytes(tail[-_JSON_TAIL:]), provider)
        chunks = self.chunks
        body = b"" if not chunks else chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return _json_report(body, provider, status)


class _WholeRead:
    """A whole stream read for its text: a meter fed up to the app's last byte, split at the
    bytes the client received, to count the text of the events that reached it."""

    __slots__ = ("delivered", "end", "meter", "offset", "within")

    def __init__(self, meter: StreamMeter, end: int, delivered: int) -> None:
        self.meter = meter
        self.end = end
        self.delivered = delivered
        self.offset = 0
        self.within: int | None = None

    def feed(self, piece: bytes) -> bool:
        """Read the next ``piece``; False once the app's output is all read."""
        offset = self.offset
        piece = piece[: self.end - offset]
        self.offset += len(piece)
        meter = self.meter
        if self.within is None and self.offset >= self.delivered:
            split = self.delivered - offset
            meter.feed(piece[:split])
            self.within = meter.text_chars
            piece = piece[split:]
        meter.feed(piece)
        return self.offset < self.end

    def report(self) -> Any:
        report = self.meter.report()
        if self.within is None:
            self.within = self.meter.text_chars
        return report


# The string member that carries an event's output text: OpenAI chat's ``delta.content``
# (not ``reasoning_content``: the quote before ``content`` is part of the name), Anthropic's
# ``text_delta.text`` (not ``cited_text``, ``thinking`` or ``partial_json``).
_TEXT_MEMBERS = {
    "openai_chat": re.compile(rb'"content"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"'),
    "anthropic_messages": re.compile(rb'"text"\s*:\s*"([^"\\]*(?:\\.[^"\\]*)*)"'),
}
_STRINGS = msgspec.json.Decoder(list[str])


class _TextScan:
    """A whole stream read for its text by a byte scan: each text member's string, found by
    a regular expression over the events and decoded as one JSON array per piece; what its
    first events and its end said (``light``) is the rest of the report. The text of the
    events that ended within the bytes the client received is counted at that point."""

    __slots__ = (
        "_carry",
        "_chars",
        "_pattern",
        "_texts",
        "delivered",
        "end",
        "light",
        "offset",
        "within",
    )

    def __init__(self, pattern: re.Pattern[bytes], light: Any, end: int, delivered: int) -> None:
        self._pattern = pattern
        self.light = light
        self.end = end
        self.delivered = delivered
        self.offset = 0
        self.within: int | None = None
        self._carry = b""
        self._texts: list[str] = []
        self._chars = 0

    def feed(self, piece: bytes) -> bool:
        """Read the next ``piece``; False once the app's output is all read."""
        offset = self.offset
        piece = piece[: self.end - offset]
        self.offset += len(piece)
        if self.within is None and self.offset >= self.delivered:
            # The events that ended within the bytes the client received, then the rest.
            data = self._carry + piece[: self.delivered - offset]
            cut = _after_blank_line(data)
            self._scan(data[: max(cut, 0)])
            self.within = self._chars
            self._carry = data[max(cut, 0) :]
            piece = piece[self.delivered - offset :]
        data = self._carry + piece if self._carry else piece
        cut = _after_blank_line(data)
        if cut < 0:
            cut = len(data) if len(data) > WINDOW else 0  # an event over the window
        self._scan(data[:cut])
        self._carry = data[cut:]
        return self.offset < self.end

    def _scan(self, data: bytes) -> None:
        found = self._pattern.findall(data)
        if found:
            try:
                texts = _STRINGS.decode(b'["' + b'","'.join(found) + b'"]')
            except msgspec.DecodeError:  # a string that is not JSON's: not a member's
                return
            self._texts.extend(texts)
            self._chars += sum(map(len, texts))

    def report(self) -> Any:
        carry = self._carry
        if carry:  # the events that ended: one cut short counts as an eager read counts it
            self._scan(carry[: max(_after_blank_line(carry), 0)])
            self._carry = b""
        if self.within is None:
            self.within = self._chars
        return msgspec.structs.replace(self.light, text="".join(self._texts))


def _with_upstream(report: Any, upstream: Any) -> Any:
    """``report`` with the usage asked of the provider for the record and kept from the
    client (``open_stream``)."""
    return msgspec.structs.replace(
        report,
        input_tokens=upstream.input_tokens,
        output_tokens=upstream.output_tokens,
        cache_read_tokens=upstream.cache_read_tokens,
        reasoning_tokens=upstream.reasoning_tokens,
        usage_source="provider",
    )


async def _awaited(result: Awaitable[object], record: UsageRecord) -> None:
    try:
        await result
    except Exception:
        logger.exception("a usage sink failed for generation %s", record.generation_id)


class _JsonUsage(msgspec.Struct, frozen=True, gc=False):
    """What a JSON response said, with the members of a ``StreamReport`` that a record
    reads; built positionally, once per JSON request."""

    provider_format: str | None
    terminal_marker_seen: bool
    error: dict[str, Any] | None
    error_type: str | None
    input_tokens: int | None
    output_tokens: int | None
    usage_source: str
    finish_reason: str | None
    model: str | None
    cache_read_tokens: int | None = None
    reasoning_tokens: int | None = None
    text: str = ""
    skipped_events: int = 0


_JSON_FORMATS = {"chat.completion": "openai_chat", "response": "openai_responses"}


class _JsonBody(msgspec.Struct):
    """The members of a JSON response that metering reads; the others are skipped, not
    built. Any member may be of any shape: what is not as expected counts as absent."""

    object: Any = None
    type: Any = None
    model: Any = None
    error: Any = None
    stop_reason: Any = None
    status: Any = None
    # UNSET: absent, told apart from null (a member that is there at all marks an LLM API).
    usage: Any = msgspec.UNSET
    usageMetadata: Any = msgspec.UNSET  # Gemini's name
    choices: Any = msgspec.UNSET
    candidates: Any = msgspec.UNSET

    def counts(self) -> tuple[int | None, int | None]:
        """(input, output) tokens of its ``usage`` (or Gemini's ``usageMetadata``)."""
        input_tokens = output_tokens = None
        usage = self.usage
        if type(usage) is dict:
            input_tokens = _count(usage, "prompt_tokens", "input_tokens")
            output_tokens = _count(usage, "completion_tokens", "output_tokens")
        meta = self.usageMetadata
        if type(meta) is dict:
            if input_tokens is None:
                input_tokens = _count(meta, "promptTokenCount")
            if output_tokens is None:
                output_tokens = _count(meta, "candidatesTokenCount")
        return input_tokens, output_tokens

    def finish_reason(self) -> str | None:
        """The first choice's ``finish_reason``, else ``stop_reason``, else ``status``."""
        choices = self.choices
        finish = None
        if type(choices) is list and choices and type(choices[0]) is dict:
            finish = _text(choices[0].get("finish_reason"))
        if not finish and self.stop_reason is not None:
            finish = _text(self.stop_reason)
        if not finish and self.status is not None:
            finish = _text(self.status)
        return finish


_JSON_BODY = msgspec.json.Decoder(_JsonBody)


def _json_error_type(error: dict[str, Any]) -> str | None:
    # OpenAI and Anthropic say "type"; Gemini (Google's APIs) "status", then "code".
    error_type = _text(error.get("type")) or _text(error.get("status"))
    if error_type is None and isinstance(error.get("code"), str | int):
        error_type = str(error["code"])
    return error_type


def _json_report(body: bytes, provider: str | None, status: int | None) -> tuple[Any, bool]:
    """Usage from a non-streamed JSON response of any of the supported APIs, and whether
    the body is one (a known shape, or a ``usage`` member, or, with an error ``status``,
    a provider's error object: ``{"error": {"type" | "message" | "status": ...}}``)."""
    try:
        payload = _JSON_BODY.decode(body)
    except msgspec.DecodeError:  # not JSON, or not an object
        return analyze(b"", provider), False
    input_tokens, output_tokens = payload.counts()
    error = payload.error if type(payload.error) is dict else None
    kind = payload.object
    # Any JSON may be there: a member that is no string is no format.
    fmt = _JSON_FORMATS[kind] if type(kind) is str and kind in _JSON_FORMATS else None
    if fmt is None:
        if payload.type == "message":
            fmt = "anthropic_messages"
        elif payload.candidates is not msgspec.UNSET:
            fmt = "gemini"
        else:
            fmt = provider
    # One rule with DisconnectMiddleware's: a provider's refusal passed on is one too.
    recognized = fmt is not provider or llm_shape(payload, status)
    error_type = None if error is None else _json_error_type(error)
    report = _JsonUsage(
        fmt,
        # A whole JSON document is a whole answer (an embeddings batch reports no output).
        error is None,
        error,
        error_type,
        input_tokens,
        output_tokens,
        "provider" if output_tokens is not None else "none",
        payload.finish_reason(),
        payload.model if type(payload.model) is str else None,
    )
    return report, recognized


class _Prompt(msgspec.Struct):
    """The members of an LLM request that carry its prompt (OpenAI Chat and Responses,
    Anthropic Messages, Gemini); any of any shape."""

    messages: Any = None
    system: Any = None
    input: Any = None
    instructions: Any = None
    prompt: Any = None
    contents: Any = None


_PROMPT = msgspec.json.Decoder(_Prompt)


def _texts(value: Any, out: list[str], depth: int = 0) -> None:
    """The text of a prompt member: strings, and the ``content`` / ``text`` / ``parts`` of
    messages and content parts, in order."""
    if depth > 8:
        return
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, list):
        for item in value:
            _texts(item, out, depth + 1)
    elif isinstance(value, dict):
        for name in ("content", "text", "parts"):
            if name in value:
                _texts(value[name], out, depth + 1)


def prompt_text(body: bytes) -> str:
    """The prompt of an LLM API request body, as text; ``""`` for anything else."""
    if body[:1] != b"{":
        return ""
    try:
        request = _PROMPT.decode(body)
    except msgspec.DecodeError:
        return ""
    out: list[str] = []
    for member in (
        request.system,
        request.instructions,
        request.messages,
        request.input,
        request.prompt,
        request.contents,
    ):
        _texts(member, out)
    return "\n".join(out)


def _json_ends_report(head: bytes, tail: bytes, provider: str | None) -> tuple[Any, bool]:
    """Usage from a JSON body too large to hold, by its ends: ``object`` / ``type`` /
    ``model`` from its head, the last ``usage`` object from its tail; whole if the tail
    closes the document."""
    fields = first_strings(head)
    usage = last_usage(tail)
    input_tokens = _count(usage, "prompt_tokens", "input_tokens", "promptTokenCount")
    output_tokens = _count(usage, "completion_tokens", "output_tokens", "candidatesTokenCount")
    if fields.get("object") == "chat.completion":
        fmt: str | None = "openai_chat"
    elif fields.get("object") == "response":
        fmt = "openai_responses"
    elif fields.get("type") == "message":
        fmt = "anthropic_messages"
    else:
        fmt = provider
    whole = tail.rstrip().endswith(b"}")
    reported = input_tokens is not None or output_tokens is not None
    report = StreamReport(
        provider_format=fmt,
        terminal_marker_seen=whole,
        error=None,
        error_type=None,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        usage_source="provider" if reported else "none",
        finish_reason=None,
        event_count=0,
        model=fields.get("model"),
    )
    return report, fmt is not provider or reported


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _count(fields: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None
