"""MeteringMiddleware: exactly one usage record per request, whatever the client did."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from ._adapters import FORMATS
from ._aio import shielded
from ._contract import METERED_ATTRIBUTE, RequestState, Reservations, UsageSink
from ._lifecycle import lifecycle_of
from ._records import UsageRecord
from .metering import StreamMeter, StreamReport, analyze, llm_shape

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
_JSON_LIMIT = 4 << 20
# A JSON body over _JSON_LIMIT is read by its ends: where an LLM API puts what metering
# needs (``object``, ``model`` first; ``usage`` last).
_JSON_HEAD = 64 << 10
_JSON_TAIL = 256 << 10


def estimate_tokens(text: str) -> int:
    """The default estimate: about four characters per token, at least one for any text.

    Close to the BPE tokenizers of the major providers for English prose; pass your own
    ``tokenizer=`` to :class:`MeteringMiddleware` for better figures.
    """
    return 0 if not text else max(1, round(len(text) / 4))


# A model's characters per token are learned from this many of its output tokens, as the
# provider counted them, before estimates use them; the sums are halved past _CALIBRATED_CAP.
_CALIBRATED_AFTER = 200
_CALIBRATED_CAP = 1 << 20


class Calibration:
    """Characters per output token, per model, from the provider-reported usage of earlier
    complete generations: what the default estimate divides by once it knows a model."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[str, list[float]] = {}  # model -> [characters, tokens, answers]

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
    endpoint = scope.get("endpoint")
    mark = getattr(endpoint, METERED_ATTRIBUTE, None)
    if mark is None:
        mark = getattr(getattr(scope.get("route"), "endpoint", None), METERED_ATTRIBUTE, None)
    return mark


class MeteringMiddleware:
    """Tees every produced body byte into an SSE decoder and a provider adapter.

    The tee is synchronous (it never awaits anything the client controls). Exactly one
    :class:`UsageRecord` per HTTP request goes to each sink, from a cancellation-shielded
    ``finally``; under :class:`DisconnectMiddleware` it is emitted when the exchange is
    over, so ``delivered_bytes`` is final. Sinks and reservations that raise are logged,
    never raised into the request.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        sinks: Sequence[UsageSink] = (),
        provider: str | Callable[[Scope], str | None] | None = None,
        reservations: Reservations | None = None,
        tokenizer: Callable[[str], int] = estimate_tokens,
    ) -> None:
        self.app = app
        self.sinks = tuple(sinks)
        self.provider = provider
        self.reservations = reservations
        self.tokenizer = tokenizer
        self.calibration = Calibration()
        self.records = 0
        # Emissions that wait on something (a reservation, an async sink, a long text),
        # in order, for one task.
        self._jobs: deque[Awaitable[None]] = deque()
        self._emitter: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.get("asgi_disconnect")
        if not isinstance(state, RequestState):
            state = None
        elif state.marks is not None:
            state.usage_pending = True  # an observer waits for this request's record
        provider = self.provider(scope) if callable(self.provider) else self.provider
        tee = _Tee(scope, provider, time.time(), time.monotonic(), state)
        reservation: Any = None
        if self.reservations is not None:
            try:
                reservation = await self.reservations.reserve(scope)
            except Exception:
                logger.exception("reserve() failed; the request runs without a reservation")

        if state is not None and send is state.app_send:
            # DisconnectMiddleware is right outside: it shows us each message the app
            # sends, so the app gets its send as it is, not one more coroutine per chunk.
            state.observe = tee.observe
            app_send = send
        else:

            async def app_send(message: Message) -> None:
                tee.observe(message)
                await send(message)

        failure: BaseException | None = None
        try:
            await self.app(scope, receive, app_send)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            tee.failure = failure
            tee.ended = time.monotonic()
            if state is not None:
                # The exchange may still be delivering: record when it is over.
                exchange = state
                state.on_finished(lambda: self._finished(scope, tee, exchange, reservation))
            else:
                await shielded(self._emit(scope, tee, None, reservation))

    def _finished(self, scope: Scope, tee: _Tee, state: RequestState, reservation: Any) -> None:
        """The exchange is over: emit its record now when nothing in it waits (no
        reservation to settle, a short text to count, sinks that return nothing), else
        queue the emission for the one emitter task."""
        if self.reservations is not None or tee.text_bound() > _OFF_LOOP_TEXT:
            self._queue(self._emit(scope, tee, state, reservation))
            return
        try:
            report = tee.report()
            if not tee.wanted(report):
                if state.usage_pending:
                    state.settle_usage(None)
                return
            record = self._build(scope, tee, state, report, None)
        except Exception:
            logger.exception("analysing the response failed; its usage is recorded as unknown")
            record = self._unknown(scope, tee, state)
        self.records += 1
        if state.usage_pending:
            state.settle_usage(record)
        for waiting in self._to_sinks(record):
            self._queue(waiting)

    def _to_sinks(self, record: UsageRecord) -> list[Awaitable[None]]:
        """Give ``record`` to each sink; what async sinks return, to await in order."""
        waiting: list[Awaitable[None]] = []
        for sink in self.sinks:
            try:
                result = sink(record)
            except Exception:
                logger.exception("a usage sink failed for generation %s", record.generation_id)
                continue
            if result is not None:
                waiting.append(_awaited(result, record))
        return waiting

    def _queue(self, job: Awaitable[None]) -> None:
        self._jobs.append(job)
        emitter = self._emitter
        if emitter is None or emitter.done():
            # A context of its own: it outlives the request that happened to start it.
            self._emitter = asyncio.get_running_loop().create_task(
                self._emit_queued(), context=contextvars.Context()
            )

    async def _emit_queued(self) -> None:
        jobs = self._jobs
        while jobs:
            try:
                await jobs[0]
            except Exception:
                logger.exception("emitting a usage record failed")
            finally:
                jobs.popleft()

    async def drain(self, timeout: float = 10.0) -> None:
        """Wait for records still being emitted (called at lifespan shutdown)."""
        emitter = self._emitter
        if emitter is not None and not emitter.done():
            await asyncio.wait({emitter}, timeout=timeout)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        lifecycle, owner = lifecycle_of(scope)
        lifecycle.register("MeteringMiddleware", unique=True, flush=self.drain)
        await lifecycle.run(owner, self.app, scope, receive, send)

    async def _emit(
        self, scope: Scope, tee: _Tee, state: RequestState | None, reservation: Any
    ) -> None:
        try:
            report = tee.report()
            if reservation is None and not tee.wanted(report):
                if state is not None:
                    state.settle_usage(None)
                return
            record = await self._record(scope, tee, state, report)
        except Exception:
            logger.exception("analysing the response failed; its usage is recorded as unknown")
            record = self._unknown(scope, tee, state)
        self.records += 1
        if state is not None:
            state.settle_usage(record)
        if self.reservations is not None:
            try:
                await self.reservations.settle(reservation, record)
            except Exception:
                logger.exception("settle() failed for generation %s", record.generation_id)
        for waiting in self._to_sinks(record):
            await waiting

    async def _record(
        self, scope: Scope, tee: _Tee, state: RequestState | None, report: Any
    ) -> UsageRecord:
        estimate = None
        if (
            report.output_tokens is None
            and len(report.text) > _OFF_LOOP_TEXT
            and self.tokenizer is not estimate_tokens
        ):
            estimate = await asyncio.to_thread(self.tokenizer, report.text)
        return self._build(scope, tee, state, report, estimate)

    def _estimate(self, text: str, model: str | None) -> tuple[int, str]:
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

    def _build(
        self,
        scope: Scope,
        tee: _Tee,
        state: RequestState | None,
        report: Any,
        estimate: int | None,
    ) -> UsageRecord:
        """The record; ``estimate``: the output tokens counted already (off the loop)."""
        produced = tee.produced
        delivered = state.delivered_bytes if state is not None else tee.produced
        delivered = min(delivered, produced)
        failure = tee.failure
        cancelled = isinstance(failure, asyncio.CancelledError)
        outcome = _failed_outcome(tee, state)
        if outcome is None:
            if report.error is not None:
                outcome = "error"
            elif report.terminal_marker_seen:
                outcome = "complete"
            else:
                outcome = "truncated"
        error_type = report.error_type
        if error_type is None and failure is not None and not cancelled:
            error_type = getattr(failure, "error_type", None) or type(failure).__name__
        upstream = state.upstream_usage if state is not None else None
        if upstream is not None and report.usage_source != "provider":
            # Asked of the provider for the record, kept from the client (open_stream).
            report = msgspec.structs.replace(
                report,
                input_tokens=upstream.input_tokens,
                output_tokens=upstream.output_tokens,
                cache_read_tokens=upstream.cache_read_tokens,
                reasoning_tokens=upstream.reasoning_tokens,
                usage_source="provider",
            )
        input_tokens, output_tokens = report.input_tokens, report.output_tokens
        usage_source = report.usage_source
        text = report.text
        notes: list[str] = []
        if usage_source == "provider" and output_tokens and text and report.terminal_marker_seen:
            self.calibration.learn(
                report.model, len(text), output_tokens - (report.reasoning_tokens or 0)
            )
        if output_tokens is None and text:
            if estimate is not None:
                output_tokens, how = estimate, "estimated with the tokenizer given"
            else:
                output_tokens, how = self._estimate(text, report.model)
            usage_source = "estimated"
            notes.append(how)
        if (
            input_tokens is None
            and state is not None
            and state.request_body is not None
            and (tee.status_code or 0) < 400  # a refusal bills no input
        ):
            # The provider's usage never came (a cancel): the prompt the app sent upstream.
            prompt = prompt_text(state.request_body)
            if prompt:
                input_tokens, how = self._estimate(prompt, report.model)
                usage_source = "estimated"
                if how not in notes:
                    notes.append(how)
        skipped = getattr(report, "skipped_events", 0)
        if skipped:
            notes.append(f"{skipped} event(s) over the meter's window were not read")
        if tee.bounded and usage_source == "none":
            notes.append("a JSON body over 4 MiB, read by its ends: no usage there")
        delivered_tokens = output_tokens
        if output_tokens is not None and delivered < produced:
            # Scale the count by the share of the output text that reached the client.
            if text:
                share = tee.text_chars_within(delivered) / len(text)
            else:
                share = delivered / max(produced, 1)
            delivered_tokens = min(output_tokens, round(output_tokens * share))
        return UsageRecord(
            **_request_fields(scope, tee, state),
            provider=report.provider_format,
            model=report.model,
            outcome=outcome,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            usage_source=usage_source,
            cache_read_tokens=report.cache_read_tokens,
            reasoning_tokens=report.reasoning_tokens,
            delivered_bytes=delivered,
            produced_output_tokens=output_tokens,
            delivered_output_tokens=delivered_tokens,
            finish_reason=report.finish_reason,
            error_type=error_type,
            usage_note="; ".join(notes) or None,
        )

    def _unknown(self, scope: Scope, tee: _Tee, state: RequestState | None) -> UsageRecord:
        """The one record of a response that could not be analysed: usage unknown."""
        failure = tee.failure
        return UsageRecord(
            **_request_fields(scope, tee, state),
            provider=tee.provider,
            model=None,
            outcome=_failed_outcome(tee, state) or "unknown",
            input_tokens=None,
            output_tokens=None,
            usage_source="none",
            delivered_bytes=min(state.delivered_bytes if state else tee.produced, tee.produced),
            produced_output_tokens=None,
            delivered_output_tokens=None,
            finish_reason=None,
            error_type=type(failure).__name__ if failure is not None else None,
        )


class _Tee:
    """The synchronous side of metering: a meter fed with every produced body byte."""

    __slots__ = (
        "_head",
        "_json",
        "_tail",
        "chunks",
        "ended",
        "failure",
        "first_event",
        "is_event_stream",
        "mark",
        "meter",
        "produced",
        "provider",
        "recognized",
        "scope",
        "started",
        "started_at",
        "state",
        "status_code",
    )

    def __init__(
        self,
        scope: Scope,
        provider: str | None,
        started_at: float,
        started: float,
        state: RequestState | None,
    ) -> None:
        self.scope = scope
        self.mark: str | bool | None = None  # what @metered says, read at the start
        self.recognized = False  # a JSON body of an LLM API (see ``report``)
        self.provider = provider
        self.state = state
        self.started_at = started_at
        self.started = started
        self.ended = started
        self.meter: StreamMeter | None = None
        self.status_code: int | None = None
        self.is_event_stream = False
        self.produced = 0
        self.first_event: float | None = None
        self.failure: BaseException | None = None
        self.chunks: list[bytes] = []  # a JSON body, to read at the end
        self._json = False
        # Over _JSON_LIMIT: its first and last bytes only.
        self._head: bytes | None = None
        self._tail = bytearray()

    def observe(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            body = message.get("body", b"")
            if not body:
                return
            self.produced += len(body)
            meter = self.meter
            if meter is not None:
                meter.feed(body)
                if self.first_event is None and meter.event_count:
                    self.first_event = time.monotonic() - self.started
                    state = self.state
                    if state is not None and state.marks is not None:
                        state.note("first_event")
            elif self._json:
                if self._head is None:
                    self.chunks.append(body)
                    if self.produced > _JSON_LIMIT:
                        self._bound_json()
                else:
                    tail = self._tail
                    tail += body
                    if len(tail) > 2 * _JSON_TAIL:
                        del tail[: len(tail) - _JSON_TAIL]
        elif kind == "http.response.start":
            self.status_code = message["status"]
            mark = self.mark = _route_mark(self.scope)
            if mark is False:
                self._step_aside()
                return
            if isinstance(mark, str):
                self.provider = mark
            for name, value in message.get("headers", ()):
                if name.lower() == b"content-type":
                    content_type = bytes(value).lower()
                    if content_type.startswith(b"text/event-stream"):
                        self.is_event_stream = True
                        meter = self.meter = StreamMeter(self.provider, marks=True)
                        if self.state is not None:
                            # DisconnectMiddleware ends the generation by it.
                            self.state.stream_ending = meter.ending
                    elif content_type.startswith(b"application/json"):
                        self._json = True
                    break
            if mark is None and not self.is_event_stream and not self._json:
                self._step_aside()  # neither an event stream nor JSON: not an LLM response

    @property
    def bounded(self) -> bool:
        """A JSON body too large to hold, read by its ends."""
        return self._head is not None

    def _bound_json(self) -> None:
        """The JSON body is too large to hold: keep its head and, from now on, its tail."""
        body = b"".join(self.chunks)
        self.chunks = []
        self._head = body[:_JSON_HEAD]
        self._tail = bytearray(body[-_JSON_TAIL:])

    def _step_aside(self) -> None:
        """No record for this response: stop observing it."""
        state = self.state
        if state is not None and state.observe == self.observe:
            state.observe = None

    def wanted(self, report: Any) -> bool:
        """Whether this request gets a usage record (see :func:`metered`)."""
        mark = self.mark
        if mark is not None:
            return mark is not False
        if self.status_code is None:
            return self.failure is not None  # it ended before its response started
        return self.is_event_stream or self.recognized

    def report(self) -> Any:
        if self.meter is not None:
            return self.meter.report()
        if self._json:
            if self._head is not None:
                report, self.recognized = _json_ends_report(
                    self._head, bytes(self._tail[-_JSON_TAIL:]), self.provider
                )
                return report
            report, self.recognized = _json_report(
                b"".join(self.chunks), self.provider, self.status_code
            )
            return report
        return analyze(b"", self.provider)

    def text_bound(self) -> int:
        """At most how many characters of text the report will hold (counted off the loop
        above _OFF_LOOP_TEXT, unless the count is the default's, a division)."""
        meter = self.meter
        return meter.text_chars if meter is not None else self.produced

    def text_chars_within(self, size: int) -> int:
        """Characters of output text in the events that ended within the first ``size``
        bytes, to the chunk: delivery stops between chunks, except inside a body over
        1 MiB, where the text of that chunk counts as not delivered."""
        meter = self.meter
        return 0 if meter is None else meter.text_chars_within(size)


async def _awaited(result: Awaitable[object], record: UsageRecord) -> None:
    try:
        await result
    except Exception:
        logger.exception("a usage sink failed for generation %s", record.generation_id)


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


_JSON_BODY = msgspec.json.Decoder(_JsonBody)


def _json_report(body: bytes, provider: str | None, status: int | None) -> tuple[Any, bool]:
    """Usage from a non-streamed JSON response of any of the supported APIs, and whether
    the body is one (a known shape, or a ``usage`` member, or, with an error ``status``,
    a provider's error object: ``{"error": {"type" | "message" | "status": ...}}``)."""
    try:
        payload = _JSON_BODY.decode(body)
    except msgspec.DecodeError:  # not JSON, or not an object
        return analyze(b"", provider), False
    usage = _dict(payload.usage)
    meta = _dict(payload.usageMetadata)
    error = payload.error if isinstance(payload.error, dict) else None
    input_tokens = _count(usage, "prompt_tokens", "input_tokens")
    if input_tokens is None:
        input_tokens = _count(meta, "promptTokenCount")
    output_tokens = _count(usage, "completion_tokens", "output_tokens")
    if output_tokens is None:
        output_tokens = _count(meta, "candidatesTokenCount")
    choices = payload.choices
    first = _dict(choices[0]) if isinstance(choices, list) and choices else {}
    finish = _text(first.get("finish_reason")) or _text(payload.stop_reason)
    finish = finish or _text(payload.status)
    if payload.object == "chat.completion":
        fmt: str | None = "openai_chat"
    elif payload.object == "response":
        fmt = "openai_responses"
    elif payload.type == "message":
        fmt = "anthropic_messages"
    elif payload.candidates is not msgspec.UNSET:
        fmt = "gemini"
    else:
        fmt = provider
    # One rule with DisconnectMiddleware's: a provider's refusal passed on is one too.
    recognized = fmt is not provider or llm_shape(payload, status)
    error_type = None
    if error is not None:
        # OpenAI and Anthropic say "type"; Gemini (Google's APIs) "status", then "code".
        error_type = _text(error.get("type")) or _text(error.get("status"))
        if error_type is None and isinstance(error.get("code"), str | int):
            error_type = str(error["code"])
    report = StreamReport(
        provider_format=fmt,
        # A whole JSON document is a whole answer (an embeddings batch reports no output).
        terminal_marker_seen=error is None,
        error=error,
        error_type=error_type,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        usage_source="provider" if output_tokens is not None else "none",
        finish_reason=finish,
        event_count=0,
        model=_text(payload.model),
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


_FIRST_STRING = {
    name: re.compile(rb'"' + name.encode() + rb'"\s*:\s*"([^"\\]{0,200})"')
    for name in ("object", "model", "type")
}
_USAGE_KEY = re.compile(rb'"(usage|usageMetadata)"\s*:\s*\{')


def _json_object_at(data: bytes, start: int) -> bytes | None:
    """The JSON object that opens at ``data[start]`` (a ``{``), by its brackets; None if it
    does not close within ``data``."""
    depth = 0
    in_string = escaped = False
    for index in range(start, len(data)):
        byte = data[index]
        if in_string:
            if escaped:
                escaped = False
            elif byte == 92:  # backslash
                escaped = True
            elif byte == 34:
                in_string = False
        elif byte == 34:
            in_string = True
        elif byte == 123:
            depth += 1
        elif byte == 125:
            depth -= 1
            if not depth:
                return data[start : index + 1]
    return None


def _json_ends_report(head: bytes, tail: bytes, provider: str | None) -> tuple[Any, bool]:
    """Usage from a JSON body too large to hold, by its ends: ``object`` / ``type`` /
    ``model`` from its head, the last ``usage`` object from its tail; whole if the tail
    closes the document."""
    fields: dict[str, str] = {}
    for name, pattern in _FIRST_STRING.items():
        match = pattern.search(head)
        if match:
            fields[name] = match.group(1).decode("utf-8", "replace")
    usage: dict[str, Any] = {}
    matches = list(_USAGE_KEY.finditer(tail))
    if matches:
        found = _json_object_at(tail, matches[-1].end() - 1)
        if found is not None:
            with contextlib.suppress(msgspec.DecodeError):
                usage = _dict(msgspec.json.decode(found))
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


def _request_fields(scope: Scope, tee: _Tee, state: RequestState | None) -> dict[str, Any]:
    """What a usage record says of the request, whatever its body said."""
    route = scope.get("route")
    return {
        "generation_id": state.generation_id if state is not None else None,
        "principal": state.principal if state is not None else None,
        "method": scope.get("method", ""),
        "route": getattr(route, "path", None) or scope.get("path", ""),
        "status_code": tee.status_code,
        "produced_bytes": tee.produced,
        "time_to_first_event": tee.first_event,
        "duration": tee.ended - tee.started,
        "policy": state.policy.value if state is not None and state.policy is not None else None,
        "detached": state.detached if state is not None else False,
        "delivery": state.delivery if state is not None else "sent",
        "started_at": tee.started_at,
    }


def _failed_outcome(tee: _Tee, state: RequestState | None) -> str | None:
    """``cancelled``, ``interrupted`` or ``error`` when the exchange says so, else None."""
    if isinstance(tee.failure, asyncio.CancelledError):
        policy = state.policy if state is not None else None
        return "cancelled" if policy is not None and policy.value == "cancel" else "interrupted"
    if getattr(tee.failure, "error_type", None) == "truncated_stream":
        return "truncated"  # asgi_disconnect.upstream.TruncatedStream
    if tee.failure is not None or (tee.status_code or 0) >= 400:
        return "error"
    return None


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
