"""A detached generation taken over from a replica that died or drained: an exchange with
no client, run by this process's supervisor until the generation ends.

The store chose this process (``Adopted``; the row's owner, this process's token, fences out
every earlier owner). The generation's
stored bytes say where the answer stands; ``_continuation.plan`` says which upstream call
produces the rest and stitches it onto them, so readers see one stream with one terminal
marker. The call is signed by this replica's own client registered under the upstream's name;
nothing the old owner held (a key, a connection) is needed. One usage record per attempt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from ._aio import shielded
from ._continuation import Attempt, Continuation, decode, plan, response_url
from ._errors import UpstreamStatusError, UpstreamStreamError, UpstreamUnreachable
from ._frames import HANDED_OVER, STOPPED, TAKEN_OVER, error_frame
from ._llm_stream import StreamMeter
from ._log import HOLD_CHECK, Generation
from ._records import Status, StoredResponse, UsageRecord
from .upstream import open_stream

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from ._contract import AttemptObserver, TakeoverStore, UsageSink
    from ._outcome import Counters
    from ._records import Adopted

__all__ = ["Takeover", "TakeoverOptions", "emit", "lost_attempt_record", "record_lost"]

logger = logging.getLogger("asgi_disconnect")

# How a taken-over generation that did not complete ends, by the attempt's outcome.
_STATUS_OF = {
    "cancelled": Status.CANCELLED,
    "error": Status.FAILED,
    "interrupted": Status.INTERRUPTED,
}
_OUTCOME_OF = {status: outcome for outcome, status in _STATUS_OF.items()}
_OUTCOME_OF[Status.COMPLETE] = "complete"
# A record's fields that come from the attempt's metered report (None: unknown).
_REPORTED = (
    "model",
    "input_tokens",
    "output_tokens",
    "produced_output_tokens",
    "finish_reason",
    "cache_read_tokens",
    "reasoning_tokens",
)


def emit(sinks: Sequence[UsageSink], record: UsageRecord) -> None:
    """Hand ``record`` to each sink; one that fails is logged, never raised."""
    for sink in sinks:
        try:
            result = sink(record)
        except Exception:
            logger.exception("a usage sink failed for generation %s", record.generation_id)
            continue
        if result is not None:
            task = asyncio.ensure_future(result)
            task.add_done_callback(_log_sink_failure)


def lost_attempt_record(
    lost: Adopted, attempt: int, stored: bytes, continuation: Continuation | None
) -> UsageRecord:
    """The record of an attempt that died with its process before it wrote one: estimated
    from what the store kept (the provider's figures died with it). A background response
    is billed once, by the attempt that finishes it: this one carries none of it."""
    meter = StreamMeter(None)
    meter.feed(stored)
    report = meter.report()
    background = continuation is not None and continuation.kind == "responses"
    # Metering's default estimate: about four characters per token.
    output = 0 if background else round(len(report.text) / 4)
    if background:
        note = "the provider bills the background response once, with the attempt that finished it"
    elif continuation is not None:
        note = "output estimated from the stored text, input unknown"
    else:
        note = "output estimated from the stored text; input, method and route unknown"
    if lost.status is not Status.RUNNING and lost.status is not Status.INTERRUPTED:
        # It ended; its process died waiting to write the record (on its client's TCP).
        note += "; what reached the client is unknown"
    return UsageRecord(
        generation_id=lost.id,
        principal=lost.principal,
        method=continuation.method if continuation is not None else "",
        route=continuation.url if continuation is not None else "",
        status_code=lost.status_code,
        provider=continuation.upstream if continuation is not None else None,
        model=report.model,
        outcome=_OUTCOME_OF.get(lost.status, "interrupted"),
        input_tokens=0 if background else None,
        output_tokens=output,
        usage_source="estimated",
        produced_bytes=len(stored),
        delivered_bytes=0,
        produced_output_tokens=output,
        delivered_output_tokens=None,
        time_to_first_event=None,
        duration=0.0,
        finish_reason=None,
        error_type="owner_lost",
        started_at=lost.created_at,
        policy=lost.policy,
        detached=lost.detached,
        usage_note=f"written by another process: its own died first; {note}",
        attempt=attempt,
    )


async def record_lost(store: TakeoverStore, sinks: Sequence[UsageSink], ids: list[str]) -> None:
    """Write the record of each generation a sweep interrupted (its owner died running it)
    or found still owing its record (its owner died waiting to write it), unless its owner
    wrote one; the store hands each id to one sweeper. An owed mark is cleared only with
    the record's own flush: if this fails, the mark's lease lapses and a sweep tries again."""
    try:
        for lost in await store.lost(ids):
            if not any(r.attempt == lost.attempt for r in await store.usage_of(lost.id)):
                stored = await store.read_all(lost.id, lost.size)
                continuation = None
                if lost.continuation:
                    try:
                        continuation = decode(lost.continuation)
                    except ValueError:
                        continuation = None
                emit(sinks, lost_attempt_record(lost, lost.attempt, stored, continuation))
            store.paid([lost.id])
    except Exception as exc:
        logger.warning("the records of %d interrupted generation(s) failed: %s", len(ids), exc)


class TakeoverOptions:
    """What every takeover of one middleware shares: the upstream clients by name, where
    its records go, and the deadlines of the continuation's upstream call."""

    __slots__ = (
        "clients",
        "first_token_timeout",
        "idle_timeout",
        "observer",
        "queued_timeout",
        "sinks",
    )

    def __init__(
        self,
        clients: Mapping[str, Any],
        sinks: Sequence[UsageSink],
        *,
        first_token_timeout: float = 60.0,
        idle_timeout: float = 120.0,
        queued_timeout: float = 120.0,
        observer: Callable[[], AttemptObserver | None] = lambda: None,
    ) -> None:
        self.clients = dict(clients)
        self.observer = observer  # who sees each attempt (telemetry), once the lifespan ran
        self.sinks = tuple(sinks)
        self.first_token_timeout = first_token_timeout
        self.idle_timeout = idle_timeout
        self.queued_timeout = queued_timeout


class Takeover:
    """One taken-over generation, from its stored prefix to its end (see the module)."""

    def __init__(
        self,
        adopted: Adopted,
        store: TakeoverStore,
        options: TakeoverOptions,
        counters: Counters,
        on_end: Callable[[Takeover], None],
    ) -> None:
        self.adopted = adopted
        self.store = store
        self.options = options
        self.counters = counters
        self.on_end = on_end
        self.task: asyncio.Task[None] | None = None
        self.generation = Generation.adopted(
            generation_id=adopted.id,
            principal=adopted.principal,
            size=adopted.size,
            status_code=adopted.status_code,
            content_type=adopted.content_type,
            policy=adopted.policy,
            created_at=adopted.created_at,
            attempt=adopted.attempt,
        )
        self.stopped = False  # a Stop: the provider is asked to cancel, the log says so
        self.was_fenced = False  # another replica took it over from here
        self.continuation: Continuation | None = None
        self._attempt: Attempt | None = None
        self._stream: Any = None
        self._span: tuple[AttemptObserver, object] | None = None

    @property
    def id(self) -> str:
        return self.adopted.id

    async def run(self) -> None:
        generation = self.generation
        started_at = time.time()
        began = time.monotonic()
        self.store.adopt(generation, self.adopted.size)
        appended = 0
        first_event: float | None = None
        report = None
        outcome, error, error_type = "interrupted", None, None
        try:
            try:
                continuation = self.continuation = decode(self.adopted.continuation)
                stored = await self.store.read_all(generation.id, self.adopted.size)
                attempt = plan(continuation, stored)
            except ValueError as exc:
                error = f"its continuation cannot be planned: {exc}"
                return
            await self._record_lost_attempt(continuation, stored)
            if attempt is None:
                error = f"its {continuation.kind} continuation is not possible here"
                return
            client = self.options.clients.get(continuation.upstream)
            if client is None:
                error = f"upstream {continuation.upstream!r} is not registered on this replica"
                return
            self._attempt = attempt
            self._observe(continuation, attempt)
            try:
                stream = await self._open(client, attempt)
            except UpstreamStatusError as exc:
                if attempt.kind != "prefill":
                    raise
                refused = plan(continuation, stored, refused=True)
                if refused is None:
                    raise
                logger.warning(
                    "generation %s: the provider refused prefill (%s); continuing as %s",
                    generation.id,
                    exc.status_code,
                    refused.kind,
                )
                attempt = self._attempt = refused
                stream = await self._open(client, attempt)
            self.counters.continuations += 1
            continued = self.counters.continued
            continued[attempt.kind] = continued.get(attempt.kind, 0) + 1
            stitcher = attempt.stitcher
            queued = self.options.queued_timeout
            async with asyncio.timeout(queued) as progress:
                async for chunk in stream:
                    if first_event is None:
                        first_event = time.monotonic() - began
                    data = stitcher.feed(chunk)
                    if stitcher.progressed and progress.when() is not None:
                        progress.reschedule(None)
                    if data:
                        generation.append(data)
                        appended += len(data)
                        hold = generation.hold
                        if hold is not None and generation.size - generation.base > HOLD_CHECK:
                            await hold.room()
                rest = stitcher.end()
                if rest:
                    generation.append(rest)
                    appended += len(rest)
            report = stream.meter.report()
            outcome = "complete"
        except TimeoutError:
            error = f"the provider's response stayed queued for {self.options.queued_timeout:g} s"
            error_type = "queued_timeout"
        except asyncio.CancelledError:
            if self.stopped:
                error, outcome = STOPPED, "cancelled"
                await shielded(self._cancel_at_provider())
            elif self.generation.handed_over:
                error = HANDED_OVER
            elif self.was_fenced:
                error = TAKEN_OVER
            else:
                error = "cancelled at this replica's shutdown"
            raise
        except UpstreamStatusError as exc:
            error = f"the provider refused the continuation: {exc.status_code} {exc.error}"
            error_type = "continuation_refused"
        except (UpstreamStreamError, UpstreamUnreachable) as exc:
            error = f"the continuation failed: {exc}"
            error_type = getattr(exc, "error_type", "stream_error")
            outcome = "error"
        except Exception as exc:  # the store, a continuation that ended mid-event
            logger.error("generation %s: its takeover failed", generation.id, exc_info=exc)
            error = f"the continuation failed: {exc!r}"[:500]
            error_type = "stream_error"
            outcome = "error"
        finally:
            if self._stream is not None:
                report = report or self._stream.meter.report()
            self._end(outcome, error, error_type)
            await shielded(self._settle_claims())
            if self._span is not None:
                observer, token = self._span
                ended = "handed_over" if generation.handed_over else outcome
                observer.attempt_ended(token, ended, error)
            self._record(outcome, error_type, report, appended, first_event, started_at, began)

    async def _settle_claims(self) -> None:
        """An Idempotency-Key that started the generation replays its whole stitched log
        once it completed; one whose generation did not complete runs again."""
        generation = self.generation
        response = None
        if generation.status is Status.COMPLETE and not generation.handed_over:
            headers = [("x-generation-id", generation.id)]
            if generation.content_type:
                headers.insert(0, ("content-type", generation.content_type))
            response = StoredResponse(
                status=generation.status_code,
                headers=headers,
                chunks=[],
                generation_id=generation.id,
            )
        elif generation.handed_over or self.was_fenced or generation.status is Status.RUNNING:
            return  # another replica goes on with it, and settles them
        try:
            await self.store.settle_claims(generation.id, response)
        except Exception as exc:
            logger.warning(
                "generation %s: its idempotency claims could not be settled (%s); they "
                "expire at their lease",
                generation.id,
                exc,
            )

    def _observe(self, continuation: Continuation, attempt: Attempt) -> None:
        observer = self.options.observer()
        if observer is None:
            return
        try:
            token = observer.attempt_started(
                self.generation.id, self.generation.attempt, attempt.kind, continuation.trace
            )
        except Exception:
            logger.exception("observing a takeover attempt failed")
            return
        self._span = (observer, token)

    async def _open(self, client: Any, attempt: Attempt) -> Any:
        request = client.build_request(
            attempt.method, attempt.url, headers=list(attempt.headers), content=attempt.body
        )
        stream = await open_stream(
            client,
            request,
            first_token_timeout=self.options.first_token_timeout,
            idle_timeout=self.options.idle_timeout,
        )
        self._stream = stream
        return stream

    def _end(self, outcome: str, error: str | None, error_type: str | None) -> None:
        generation = self.generation
        if outcome == "complete":
            generation.finish(Status.COMPLETE)
        elif generation.running:
            # A plain "interrupted" (handed over, its replica stopping) is left without a frame:
            # the next owner continues the log.
            if outcome != "interrupted" or error_type is not None:
                generation.append_frame(
                    error_frame(
                        generation.id,
                        error_type or outcome,
                        error or outcome,
                        stopped_by="owner" if self.stopped else None,
                    )
                )
            generation.finish(_STATUS_OF[outcome], error)
        if outcome != "complete" and not generation.handed_over:
            self.counters.left_interrupted += outcome == "interrupted"
            logger.warning(
                "generation %s (attempt %d, taken over): ended %s: %s",
                generation.id,
                generation.attempt,
                generation.status.value,
                error,
            )
        self.store.adopted_ended(generation.id)
        self.on_end(self)

    def _record(
        self,
        outcome: str,
        error_type: str | None,
        report: Any,
        appended: int,
        first_event: float | None,
        started_at: float,
        began: float,
    ) -> None:
        continuation = self.continuation
        attempt = self._attempt
        note = None
        if attempt is not None and not attempt.byte_exact:
            note = (
                f"a {attempt.kind} continuation (attempt {self.generation.attempt}): not byte-exact"
            )
        self._emit(
            self._usage(
                continuation,
                report,
                outcome=outcome,
                produced_bytes=appended,
                time_to_first_event=first_event,
                duration=time.monotonic() - began,
                error_type=error_type,
                started_at=started_at,
                usage_note=note,
                attempt=self.generation.attempt,
                stopped_by=(
                    "owner" if self.stopped else "handover" if self.generation.handed_over else None
                ),
            )
        )

    def _usage(self, continuation: Continuation | None, report: Any, **fields: Any) -> UsageRecord:
        """A record of one attempt: nobody read it live (delivered nothing), the route's
        policy detached it, its counts from ``report`` (None: unknown)."""
        counts: dict[str, Any] = dict.fromkeys(_REPORTED)
        counts["usage_source"] = "none"
        if report is not None:
            counts = {
                "model": report.model,
                "input_tokens": report.input_tokens,
                "output_tokens": report.output_tokens,
                "produced_output_tokens": report.output_tokens,
                "usage_source": report.usage_source,
                "finish_reason": report.finish_reason,
                "cache_read_tokens": report.cache_read_tokens,
                "reasoning_tokens": report.reasoning_tokens,
            }
        return UsageRecord(
            generation_id=self.generation.id,
            principal=self.adopted.principal,
            method=continuation.method if continuation is not None else "POST",
            route=continuation.url if continuation is not None else "",
            status_code=self.adopted.status_code,
            provider=continuation.upstream if continuation is not None else None,
            delivered_bytes=0,
            delivered_output_tokens=None,
            policy="detach",
            detached=True,
            **{**counts, **fields},
        )

    async def _record_lost_attempt(self, continuation: Continuation, stored: bytes) -> None:
        """The attempt before this one died with its process before its record was written:
        write one for it, so that every upstream call has its record."""
        previous = self.generation.attempt - 1
        try:
            records = await self.store.usage_of(self.generation.id)
        except Exception as exc:
            logger.warning(
                "generation %s: its earlier attempts' records could not be read (%s)",
                self.generation.id,
                exc,
            )
            return
        if not any(record.attempt == previous for record in records):
            self._emit(lost_attempt_record(self.adopted, previous, stored, continuation))

    def _emit(self, record: UsageRecord) -> None:
        emit(self.options.sinks, record)

    def stop(self) -> bool:
        """Stop it on its owner's request: the upstream call is cancelled (for a background
        response, at the provider too)."""
        task = self.task
        if task is None or task.done():
            return False
        self.stopped = True
        task.cancel()
        return True

    def hand_over(self) -> bool:
        """Leave it to another replica (this one drains): stopped here without a frame, its
        row loses its owner. True if it was running."""
        task = self.task
        if task is None or task.done() or self.stopped:
            return False
        self.generation.handed_over = True
        task.cancel()
        return True

    async def _cancel_at_provider(self) -> None:
        """A Stop of a re-attached background response: the provider is asked to cancel it."""
        continuation = self.continuation
        attempt = self._attempt
        if continuation is None or attempt is None or attempt.kind != "responses":
            return
        client = self.options.clients.get(continuation.upstream)
        response_id = self._stream.response_id if self._stream is not None else None
        response_id = response_id or attempt.url.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
        if client is None or not response_id:
            return
        url = response_url(continuation.url, response_id, "/cancel")
        try:
            response = await client.post(url, headers=list(continuation.headers))
        except Exception as exc:
            logger.warning("cancelling background response %s failed: %s", response_id, exc)
            return
        if response.status_code >= 300:
            logger.warning(
                "the provider refused to cancel background response %s: %s",
                response_id,
                response.status_code,
            )

    def fenced(self) -> None:
        """Another replica owns it now: stop here, writing nothing more."""
        self.was_fenced = True
        task = self.task
        if task is not None and not task.done():
            task.cancel()


def _log_sink_failure(task: asyncio.Future[Any]) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        if task.exception() is not None:
            logger.error("an async usage sink failed: %s", task.exception())
