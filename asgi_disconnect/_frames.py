"""SSE framing: the frames the package writes into an event stream, and where its events end.

A low module: the response side, the resume endpoints and anything else that frames an event
stream import it; it imports nothing of the package.
"""

from __future__ import annotations

import re

import msgspec

__all__ = [
    "DRAINED",
    "LINE_END",
    "STOPPED",
    "EventIds",
    "error_frame",
    "event_ends",
    "is_event_stream",
]

_encode = msgspec.json.Encoder().encode
# The error of a generation its owner stopped; its log ends with its own error frame.
STOPPED = "stopped by its owner"
# The error of a generation a drain ended; its log ends with its draining frame.
DRAINED = "interrupted by a drain: the server is shutting down"
# Why a detached generation stopped here to be finished elsewhere.
HANDED_OVER = "handed over to another replica: this one is shutting down"
TAKEN_OVER = "taken over by another replica: this one had lost its lease"

LINE_END = re.compile(rb"\r\n|\r|\n")


def is_event_stream(content_type: str | None) -> bool:
    return content_type is not None and content_type.lower().startswith("text/event-stream")


def error_frame(
    generation_id: str,
    code: str,
    message: str,
    *,
    event_id: int | None = None,
    retry_after: int | None = None,
    stopped_by: str | None = None,
) -> bytes:
    """The SSE ``event: error`` frame that marks a stream that did not complete: ``code``
    its ``type`` (how the generation ended, ``cancelled`` or ``interrupted``, or a failure's
    error type), ``stopped_by`` what ended it (``owner``, ``drain``); a drain's says after
    how many seconds to retry (on another replica)."""
    error: dict[str, object] = {"type": code, "message": message, "generation_id": generation_id}
    if stopped_by is not None:
        error["stopped_by"] = stopped_by
    if retry_after is not None:
        error["retry_after"] = retry_after
    payload = _encode({"error": error})
    frame = b"event: error\ndata: " + payload + b"\n"
    if event_id is not None:
        frame += b"id: %d\n" % event_id
    return frame + b"\n"


def event_ends(data: bytes, base: int = 0) -> list[int]:
    """Where the events in ``data`` end (``base`` + the index just past each blank line),
    ``data`` starting at the start of a line."""
    ends = []
    line_start = 0
    for match in LINE_END.finditer(data):
        if match.start() == line_start:
            ends.append(base + match.end())
        line_start = match.end()
    return ends


class EventIds:
    """Re-frames an event stream read from ``offset`` (an event's start): whole events
    only, each with ``id:`` the offset where it ends, so an EventSource's Last-Event-ID
    says where to resume."""

    __slots__ = ("offset", "pending")

    def __init__(self, offset: int) -> None:
        self.offset = offset  # where ``pending`` starts in the generation
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        buffer = self.pending + data
        out: list[bytes] = []
        line_start = 0
        event_start = 0
        for match in LINE_END.finditer(buffer):
            start, end = match.span()
            if end == len(buffer) and buffer[start:end] == b"\r":
                break  # a CR at the end may be the first half of a CRLF: wait for more
            if start == line_start:
                # A blank line ends the event: its id goes just before it.
                out.append(buffer[event_start:start])
                out.append(b"id: %d\n" % (self.offset + end))
                out.append(buffer[start:end])
                event_start = end
            line_start = end
        self.pending = buffer[event_start:]
        self.offset += event_start
        return b"".join(out)

    def rest(self) -> bytes:
        """What never ended in a blank line (a stream cut short), as it is."""
        rest, self.pending = self.pending, b""
        return rest
