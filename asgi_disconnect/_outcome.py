"""How one request's app ended, and what that makes of its generation and its exchange.

Every path (returned, raised, cancelled by the policy, stopped by its owner, drained,
interrupted from outside, stopped because the server refused a send) goes through
``Outcome.app_ended``, whichever task ran the app: the generation's status, an error
frame for an event stream that did not complete, and the counters, in one place;
``Outcome.ending`` is the exchange's ``Ending`` from it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from http import HTTPStatus
from typing import TYPE_CHECKING

from ._contract import Ending, answered
from ._errors import FirstTokenTimeout, IdleTimeout, UpstreamStatusError, UpstreamStreamError
from ._frames import STOPPED, error_frame, is_event_stream
from ._records import Status

if TYPE_CHECKING:
    from ._contract import RequestState
    from ._outbound import Outbound

__all__ = ["AppEnd", "Counters", "Outcome"]

logger = logging.getLogger("asgi_disconnect")

# Enum members read on the request's paths, bound once: on Python 3.11 a member's
# lookup goes through EnumType.__getattr__ (~60 ns, ~200 instructions); see
# docs/performance.md for what it costs per request and per chunk.
_ENDING_CANCELLED = Ending.CANCELLED
_ENDING_CUT = Ending.CUT
_ENDING_DELIVERED = Ending.DELIVERED
_ENDING_FAILED = Ending.FAILED
_ENDING_INTERRUPTED = Ending.INTERRUPTED
_STATUS_CANCELLED = Status.CANCELLED
_STATUS_FAILED = Status.FAILED
_STATUS_INTERRUPTED = Status.INTERRUPTED


class Counters:
    """In-process counts of disconnect decisions."""

    __slots__ = (
        "cancelled",
        "continuations",
        "continued",
        "detach_completed",
        "detached",
        "disconnects",
        "drained",
        "fenced",
        "handed_over",
        "interrupted",
        "left_interrupted",
        "policy_errors",
        "stopped",
        "takeovers",
    )

    def __init__(self) -> None:
        self.disconnects = 0
        self.cancelled = 0
        self.detached = 0
        self.detach_completed = 0
        self.interrupted = 0
        self.drained = 0
        self.policy_errors = 0
        self.stopped = 0
        # Takeover: generations taken over here, continued by kind ("continuations" counts
        # all; by kind in ``continued``), handed over by a drain, fenced (another replica
        # took one over from here), and taken over but left interrupted.
        self.takeovers = 0
        self.continuations = 0
        self.handed_over = 0
        self.fenced = 0
        self.left_interrupted = 0
        self.continued: dict[str, int] = {}

    def as_dict(self) -> dict[str, int]:
        counts = {name: getattr(self, name) for name in self.__slots__ if name != "continued"}
        counts.update({f"continued_{kind}": n for kind, n in self.continued.items()})
        return counts


class AppEnd(enum.Enum):
    """How the app of one exchange ended."""

    RETURNED = "returned"
    FAILED = "failed"  # it raised, or the server refused a send and it was stopped for it
    CANCELLED = "cancelled"  # by the policy, or by its owner's Stop
    INTERRUPTED = "interrupted"  # cancelled from outside: a drain, a shutdown, the server


_APP_CANCELLED = AppEnd.CANCELLED
_APP_FAILED = AppEnd.FAILED
_APP_INTERRUPTED = AppEnd.INTERRUPTED
_APP_RETURNED = AppEnd.RETURNED


class Outcome:
    """How the app of one exchange ended; see the module docstring."""

    __slots__ = (
        "app",
        "cancelled_by_policy",
        "counters",
        "drained",
        "interrupt_reason",
        "out",
        "state",
        "stopped",
    )

    def __init__(self, out: Outbound, state: RequestState, counters: Counters) -> None:
        self.out = out
        self.state = state
        self.counters = counters
        # None while the app runs; written once, by app_ended.
        self.app: AppEnd | None = None
        self.cancelled_by_policy = False  # the policy, a Stop: not a cancel from outside
        self.interrupt_reason = "interrupted before it finished"
        self.stopped = False  # its owner asked to stop it (POST .../cancel)
        self.drained: int | None = None  # a drain ended it: retry after that many seconds

    def app_ended(self, failure: BaseException | None) -> None:
        """Record how the app ended: the generation's status, then maybe the exchange's end."""
        generation = self.out.generation
        if failure is None:
            self.app = _APP_RETURNED
            if generation is not None and generation.running:
                self.record_end(_STATUS_FAILED, "the app returned before its response was complete")
        elif isinstance(failure, asyncio.CancelledError):
            refused = self.out.writer.error if self.out.writer is not None else None
            if refused is not None:
                # The server refused a send; the app was stopped for it.
                self.app = _APP_FAILED
                self.record_end(_STATUS_FAILED, f"the server refused a send: {refused!r}"[:500])
            elif self.cancelled_by_policy:
                self.app = _APP_CANCELLED
                if self.stopped:
                    self.record_end(_STATUS_CANCELLED, STOPPED, "cancelled")
                else:
                    self.record_end(_STATUS_CANCELLED, "cancelled after the client disconnected")
            else:
                self.app = _APP_INTERRUPTED
                if generation is not None and generation.running:
                    self.counters.interrupted += 1
                self.state.note("interrupted")
                self.record_end(_STATUS_INTERRUPTED, self.interrupt_reason)
        else:
            self.app = _APP_FAILED
            self.failed(failure)
        writer = self.out.writer
        if writer is not None:
            writer.close()

    def ending(self) -> Ending:
        """How the exchange ended, once the app did and nothing more is delivered."""
        outcome = self.app
        if outcome is _APP_CANCELLED:
            return _ENDING_CANCELLED
        if outcome is _APP_INTERRUPTED:
            return _ENDING_INTERRUPTED
        writer = self.out.writer
        if outcome is _APP_FAILED or (writer is not None and writer.error is not None):
            return _ENDING_FAILED
        generation = self.out.generation
        if generation is not None and generation.status is _STATUS_FAILED:
            return _ENDING_FAILED
        if self.out.handed():
            return _ENDING_DELIVERED
        return _ENDING_CUT

    def record_end(
        self,
        status: Status,
        error: str,
        code: str = "incomplete_response",
        frame: str = "",
        *,
        framed: bool = False,
    ) -> None:
        """End a generation that did not complete. A failed event stream, or one its owner
        stopped or a drain ended, gets an error frame (``code``, its ``type``: the failure's
        error type, else how it ended, with what stopped it; ``frame`` its message, else
        ``error``) and a proper end; any other response is left open, so the server aborts
        it rather than end it cleanly."""
        generation = self.out.generation
        if generation is None or not generation.running:
            return
        drained = self.drained
        stopped_by = self.state.stopped_by
        if (status is _STATUS_FAILED or self.stopped or drained is not None) and is_event_stream(
            generation.content_type
        ):
            if drained is not None and status is _STATUS_INTERRUPTED:
                code, frame = "interrupted", "The server is draining; retry on another replica."
            if not framed:
                generation.append_frame(
                    error_frame(
                        generation.id,
                        code,
                        frame or error,
                        retry_after=drained,
                        stopped_by=stopped_by if status is not _STATUS_FAILED else None,
                    )
                )
            generation.finish(status, error)
            self.deliver_rest()
            return
        generation.finish(status, error)
        if self.out.writer is not None:
            self.out.writer.ends_elsewhere()

    def failed(self, exc: BaseException) -> None:
        # A stream that carries its provider's error event has its error frame already.
        ending = self.state.stream_ending
        self.record_end(
            _STATUS_FAILED,
            f"{type(exc).__name__}: {exc}"[:500],
            str(getattr(exc, "error_type", "stream_error")),
            "The stream failed after it started.",
            framed=ending is not None and ending() == "error",
        )

    def deliver_rest(self) -> None:
        """Hand the end of a generation (an error frame, the final body) to the client."""
        out = self.out
        if out.client_gone or out.generation is None:
            return
        writer = out.writer or out.open_writer()
        writer.pump()

    async def answer_failure(self, exc: BaseException) -> bool:
        """An upstream's failure (``UpstreamStreamError``) that escaped the app, after
        ``app_ended``: answered here and logged in one line, instead of raised to the
        server (a traceback per request). An event stream ended with its error frame
        already; a response not started yet is a ``502`` problem of the error's type
        (``504`` for a timeout). True if it was answered; any other response that started
        is left to the server to abort, as before."""
        if not isinstance(exc, UpstreamStreamError):
            return False
        out = self.out
        generation = out.generation
        if generation is not None:
            if not is_event_stream(generation.content_type):
                return False
        elif out.passthrough or out.held is not None:
            return False
        elif not out.client_gone and not self.state.detached:
            await self._send_problem(exc)
        scope = out.scope
        logger.warning(
            "generation %s (%s %s): the upstream failed: %s: %s",
            self.state.generation_id,
            scope.get("method"),
            scope.get("path"),
            exc.error_type,
            exc,
        )
        return True

    async def _send_problem(self, exc: UpstreamStreamError) -> None:
        status = 504 if isinstance(exc, (FirstTokenTimeout, IdleTimeout)) else 502
        # The id its log line and usage record carry, for the caller to quote.
        headers = [
            (b"connection", b"close"),
            (b"x-generation-id", self.state.generation_id.encode()),
        ]
        if isinstance(exc, UpstreamStatusError) and exc.retry_after:
            headers.append((b"retry-after", exc.retry_after.encode("latin-1")))
        out = self.out
        answered(out.scope, status)
        try:
            await out.send_problem(
                status,
                exc.error_type.replace("_", "-"),
                HTTPStatus(status).phrase,
                str(exc),
                headers=headers,
            )
        except Exception:  # the client left meanwhile: nobody to answer
            logger.debug("the answer to an upstream failure was not sent", exc_info=True)
