"""A streamed LLM response read as it arrives: its format, end, errors, usage and text.

``StreamMeter`` reads a ``text/event-stream`` body a chunk at a time and gives a
``StreamReport``. A low module, over the SSE decoder (``sse``) and the provider adapters
(``_adapters``): metering (``asgi_disconnect.metering``, which names these two) and the
upstream helpers (``asgi_disconnect.upstream``) both read streams with it, and neither is
imported here.
"""

from __future__ import annotations

import logging
import re
from array import array
from typing import Any

import msgspec

from ._adapters import ADAPTERS, FORMATS, Adapter, StreamState, detect, error_frame
from .sse import ServerSentEvent, SSEDecodeError, SSEDecoder

__all__ = ["WINDOW", "StreamMeter", "StreamReport"]

logger = logging.getLogger("asgi_disconnect")

_LINE_END = re.compile(rb"\r\n|\r|\n")
# Events without a recognisable payload after which the stream is taken as not an LLM stream.
_DETECTION_EVENTS = 16


class StreamReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one streamed response said.

    - ``provider_format``: ``"openai_chat"``, ``"openai_responses"``, ``"anthropic_messages"``,
      ``"gemini"``, or None when no event told.
    - ``terminal_marker_seen``: the protocol's end arrived (``[DONE]``, ``response.completed``,
      ``response.failed`` or ``response.incomplete``, ``message_stop``, Gemini's final
      ``finishReason``); False means the stream was cut off.
    - ``error`` / ``error_type``: the first error frame's error object and its most specific
      reason (``code``, else ``type``, else ``status``); ``"sse_decode_error"`` when the stream
      broke the decoder's size limits.
    - token counts: the provider's last reported figures, None where it reported none;
      ``output_tokens`` includes reasoning tokens. ``usage_source`` is ``"provider"`` when any
      figure arrived, else ``"none"`` (a caller that estimates sets ``"estimated"``).
    - ``finish_reason``: ``finish_reason`` / ``stop_reason`` / ``finishReason``, or for the
      Responses API the response's status (its ``incomplete_details.reason`` if incomplete).
    - ``event_count`` / ``comment_count``: events dispatched and comment lines seen.
    - ``text``: the output text deltas, concatenated (tool-call arguments and reasoning are
      not included).
    - ``first_event_offset``: the stream offset just past the blank line that completed the
      first event.
    - ``skipped_events``: events over the meter's window (about 1 MiB: an image as base64,
      say), skipped unread so that metering holds no more than that; the events after them
      are read as usual, the provider's usage and the terminal marker included.
    """

    provider_format: str | None
    terminal_marker_seen: bool
    error: dict[str, Any] | None
    error_type: str | None
    input_tokens: int | None
    output_tokens: int | None
    cache_read_tokens: int | None = None
    cache_write_tokens: int | None = None
    reasoning_tokens: int | None = None
    usage_source: str
    finish_reason: str | None
    event_count: int
    comment_count: int = 0
    model: str | None = None
    text: str = ""
    first_event_offset: int | None = None
    skipped_events: int = 0


# An event that grows past this many bytes is skipped, not decoded: below the decoder's
# 1 MiB line limit, so no event can break it.
WINDOW = 960 << 10
_BLANK_LINES = (b"\n\n", b"\r\n\r\n", b"\r\r")
# Looked for as an int: one memchr; ``b"\r" in data`` is a substring search, about five
# times as long per chunk (docs/performance.md, "Metering's record by keyword").
_CR = ord("\r")


def _after_blank_line(data: bytes) -> int:
    """The offset just past the last blank line (an event's end) in ``data``, or -1."""
    end = data.rfind(b"\n\n")
    end = end + 2 if end >= 0 else -1
    if _CR in data:
        for marker in _BLANK_LINES[1:]:
            found = data.rfind(marker)
            if found >= 0:
                end = max(end, found + len(marker))
    return end


def _first_blank_line(data: bytes) -> int:
    """The offset just past the first blank line in ``data``, or -1."""
    ends = [found + len(marker) for marker in _BLANK_LINES if (found := data.find(marker)) >= 0]
    return min(ends) if ends else -1


# What a JSON document too large to hold says at its ends: its first strings of these names
# (the head) and its last usage object (the tail).
_FIRST_STRING = {
    name: re.compile(rb'"' + name.encode() + rb'"\s*:\s*"([^"\\]{0,200})"')
    for name in ("object", "model", "type", "status")
}
_USAGE_KEY = re.compile(rb'"(usage|usageMetadata)"\s*:\s*\{')
_QUOTE, _BACKSLASH, _OPEN, _CLOSE = b'"\\{}'  # as bytes iterate: their values
# An event over the window is read by its ends: its first and last bytes.
_EVENT_HEAD = 16 << 10
_EVENT_TAIL = 256 << 10
_EVENT_LAST = 4 << 10
_EVENT_LINE = re.compile(rb"^event:[ ]?([^\r\n]*)", re.MULTILINE)
_ENCODE = msgspec.json.Encoder()


def first_strings(head: bytes) -> dict[str, str]:
    """The first ``object``, ``model``, ``type`` and ``status`` strings in ``head``."""
    fields: dict[str, str] = {}
    for name, pattern in _FIRST_STRING.items():
        match = pattern.search(head)
        if match:
            fields[name] = match.group(1).decode("utf-8", "replace")
    return fields


def last_usage(tail: bytes) -> dict[str, Any]:
    """The last whole ``usage`` (or Gemini's ``usageMetadata``) object in ``tail``, or {}."""
    matches = list(_USAGE_KEY.finditer(tail))
    if matches:
        found = _json_object_at(tail, matches[-1].end() - 1)
        if found is not None:
            try:
                usage = msgspec.json.decode(found)
            except msgspec.DecodeError:
                return {}
            return usage if isinstance(usage, dict) else {}
    return {}


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
            elif byte == _BACKSLASH:
                escaped = True
            elif byte == _QUOTE:
                in_string = False
        elif byte == _QUOTE:
            in_string = True
        elif byte == _OPEN:
            depth += 1
        elif byte == _CLOSE:
            depth -= 1
            if not depth:
                return data[start : index + 1]
    return None


def event_by_its_ends(head: bytes, tail: bytes) -> ServerSentEvent:
    """What an event too large to read says at its ends, as a small event of its own: its
    name and ``type`` (and a Responses API response's ``status`` and ``model``) from its
    head, the last ``usage`` from its tail. OpenAI's ``response.completed`` carries the
    whole output (an image's base64) before its usage."""
    match = _EVENT_LINE.search(head)
    name = match.group(1).decode("utf-8", "replace") if match else "message"
    data_at = head.find(b"data:")
    data = head[data_at:] if data_at >= 0 else b""
    fields = first_strings(data)
    usage = last_usage(tail)
    payload: dict[str, Any] = {k: fields[k] for k in ("type", "object", "model") if k in fields}
    if b'"response"' in data:
        payload["response"] = {
            "status": fields.get("status"),
            "model": fields.get("model"),
            "usage": usage or None,
        }
    elif usage:
        payload["usage"] = usage
    return ServerSentEvent(event=name, data=_ENCODE.encode(payload).decode())


class StreamMeter:
    """Read a stream chunk by chunk; ``feed`` never awaits and never raises.

    ``provider`` fixes the wire format (one of the ``provider_format`` names); None detects it.
    It holds at most about ``WINDOW`` bytes of the stream: an event larger than that is
    skipped unread (``skipped_events``), and the stream is read on from the next event.
    """

    __slots__ = (
        "_adapter",
        "_base",
        "_block",
        "_carry",
        "_decoder",
        "_detections_left",
        "_event_head",
        "_event_last",
        "_first_offset",
        "_limit",
        "_max_event",
        "_open",
        "_skip_tail",
        "_skipping",
        "_state",
        "_stopped",
        "event_count",
        "marks",
        "skipped_events",
        "text_chars",
    )

    def __init__(
        self, provider: str | None = None, *, max_event_bytes: int = 4 << 20, marks: bool = False
    ) -> None:
        if provider is not None and provider not in ADAPTERS:
            raise ValueError(f"provider must be one of {', '.join(FORMATS)} or None: {provider!r}")
        self._max_event = max_event_bytes
        self._limit = min(WINDOW, max_event_bytes)
        self._decoder = SSEDecoder(max_event_bytes=max_event_bytes)
        self._base = 0  # bytes fed to decoders before this one, and skipped
        self._open = 0  # bytes since the last blank line: the event under way
        self._skipping = False
        self._carry = b""  # while skipping: the last bytes, a blank line may straddle
        self._event_head = b""  # the first bytes of the event under way
        self._event_last = b""  # and its last
        self._skip_tail = bytearray()  # while skipping: the event's last bytes
        self.skipped_events = 0
        self._state = StreamState(provider)
        self._adapter = ADAPTERS[provider] if provider is not None else None
        self._detections_left = _DETECTION_EVENTS
        self._first_offset: int | None = None
        self._stopped = False
        self.event_count = 0
        # The output text's length so far, in characters; the pieces of text before
        # ``_block`` are joined blocks (see ``_count_text``).
        self.text_chars = 0
        self._block = 0
        # With ``marks``: (bytes fed, ``text_chars``) after each chunk that added text.
        self.marks: array[int] | None = array("q") if marks else None

    @property
    def provider_format(self) -> str | None:
        """The wire format given or detected so far."""
        return self._state.provider_format

    def feed(self, chunk: bytes) -> None:
        """Read the next ``chunk`` of the body."""
        if self._stopped:
            return
        try:
            if type(chunk) is not bytes:
                chunk = bytes(chunk)
            if (self._open or len(chunk) > WINDOW) and self._outgrown(chunk):
                return
            if self._skipping:
                chunk = self._skip(chunk)
                if not chunk:
                    return
            # The bytes of the event under way: a blank line ends an event.
            end = chunk.rfind(b"\n\n")
            if end >= 0 and _CR not in chunk:
                end += 2
                size = self._open = len(chunk) - end
            else:
                end = _after_blank_line(chunk)
                size = self._open = len(chunk) - end if end >= 0 else self._open + len(chunk)
            if size:
                # The event under way: its head is kept, to read it by its ends if it is
                # too large to hold (rare: most chunks end where an event does).
                if end >= 0:
                    self._event_head = chunk[end : end + _EVENT_HEAD]
                elif len(self._event_head) < _EVENT_HEAD:
                    self._event_head += chunk[: _EVENT_HEAD - len(self._event_head)]
                self._event_last = chunk[-_EVENT_LAST:]
            if size > self._limit:
                # The event under way is too large to hold: read what ended before it,
                # then skip the rest of it, keeping its last bytes.
                head = chunk[:end] if end >= 0 else b""
                events = self._decode(head) if head else []
                self._start_skipping(chunk[len(head) :])
            elif self._first_offset is None:
                events = self._feed_first(chunk)
            else:
                events = self._decoder.feed(chunk)
            if events:
                self.event_count += len(events)
                self._read(events)
                if self._state.text_chars != self.text_chars:
                    self._count_text()
        except SSEDecodeError as exc:
            self._stop({"type": "sse_decode_error", "message": str(exc)})
        except Exception:
            # A meter must not break the response it measures.
            logger.exception("metering failed; the rest of this stream is not metered")
            self._stop({"type": "meter_error", "message": "the stream could not be metered"})

    def _outgrown(self, chunk: bytes) -> bool:
        """The event under way may outgrow the window in ``chunk``: skip it from here if it
        does (it is read by its ends); True if ``chunk`` was read here."""
        if len(chunk) > WINDOW:
            # In pieces, so that an event in it larger than the window is read by its ends,
            # not handed whole to the decoder, whose limits it would break.
            for start in range(0, len(chunk), WINDOW):
                self.feed(chunk[start : start + WINDOW])
            return True
        if self._open and not self._skipping and self._open + len(chunk) > self._limit:
            first = _first_blank_line(chunk)
            if first >= 0 and self._open + first > self._limit:
                self._start_skipping(b"")  # it ends in this chunk, larger than the window
        return False

    def _decode(self, chunk: bytes) -> list[ServerSentEvent]:
        if self._first_offset is None:
            return self._feed_first(chunk)
        return self._decoder.feed(chunk)

    def _start_skipping(self, rest: bytes) -> None:
        """Drop the event under way (the decoder's part of it, and ``rest``) until its end."""
        self.skipped_events += 1
        self._base += self._decoder.bytes_fed + len(rest)
        self._decoder = SSEDecoder(max_event_bytes=self._max_event)
        self._skipping = True
        self._carry = rest[-3:]
        # Its last bytes: a usage object may straddle the chunk it outgrew the window in.
        self._skip_tail = bytearray(rest[-_EVENT_TAIL:] if rest else self._event_last)
        self._open = 0

    def _skip(self, chunk: bytes) -> bytes:
        """While skipping: the part of ``chunk`` after the skipped event's end (b"" if it
        goes on)."""
        carry = self._carry
        data = carry + chunk
        end = _first_blank_line(data)
        tail = self._skip_tail
        if end < 0:
            self._base += len(chunk)
            self._carry = data[-3:]
            tail += chunk
            if len(tail) > 2 * _EVENT_TAIL:
                del tail[: len(tail) - _EVENT_TAIL]
            return b""
        self._skipping = False
        self._carry = b""
        consumed = end - len(carry)
        self._base += consumed
        tail += chunk[: max(consumed, 0)]
        event = event_by_its_ends(self._event_head, bytes(tail[-_EVENT_TAIL:]))
        self._event_head, self._skip_tail = b"", bytearray()
        self.event_count += 1
        self._read([event])
        return chunk[consumed:]

    def jump(self, count: int) -> None:
        """Leave the next ``count`` bytes of the stream unread (the event under way, if any,
        is dropped): the bytes fed next start an event. Metering reads a long stream's end
        this way without reading its middle."""
        if count <= 0:
            return
        self._base += self._decoder.bytes_fed + count
        self._decoder = SSEDecoder(max_event_bytes=self._max_event)
        self._skipping = False
        self._carry = b""
        self._open = 0

    @property
    def bytes_fed(self) -> int:
        """Bytes of the stream read so far, skipped ones included."""
        return self._base + self._decoder.bytes_fed

    def _count_text(self) -> None:
        """Mark the text's new length; join every 64 pieces into one block, so a long
        stream of small deltas keeps its text, not an object per delta."""
        state = self._state
        self.text_chars = state.text_chars
        marks = self.marks
        if marks is not None:
            marks.append(self._base + self._decoder.bytes_fed)
            marks.append(state.text_chars)
        text = state.text
        block = self._block
        if len(text) - block >= 64:
            text[block:] = ["".join(text[block:])]
            self._block = block + 1

    def text_chars_within(self, size: int) -> int:
        """With ``marks``: the characters of text in the events that ended within the
        first ``size`` bytes, to the chunk (a chunk's text counts once it is all in)."""
        marks = self.marks
        if marks is None:
            raise ValueError("this meter keeps no marks: StreamMeter(marks=True)")
        low, high = 0, len(marks) // 2
        while low < high:  # the first mark past ``size``
            middle = (low + high) // 2
            if marks[2 * middle] <= size:
                low = middle + 1
            else:
                high = middle
        return marks[2 * low - 1] if low else 0

    def ending(self) -> str | None:
        """How the stream ended by its protocol, so far: ``"complete"`` (its terminal marker
        arrived), ``"error"`` (an error event), ``"truncated"`` (a known protocol without
        its marker), or None (no known protocol, so no marker to expect)."""
        state = self._state
        if state.terminal:
            return "complete"
        if state.error is not None:
            return "error"
        return None if state.provider_format is None else "truncated"

    def report(self) -> StreamReport:
        """What the stream said so far (call it when the stream has ended)."""
        state = self._state
        if state.text_chars != self.text_chars:
            self._count_text()
        text = "".join(state.text)
        state.text = [text] if text else []
        self._block = len(state.text)
        figures = (
            state.input_tokens,
            state.output_tokens,
            state.cache_read_tokens,
            state.cache_write_tokens,
            state.reasoning_tokens,
        )
        return StreamReport(
            provider_format=state.provider_format,
            terminal_marker_seen=state.terminal,
            error=state.error,
            error_type=state.error_type,
            input_tokens=state.input_tokens,
            output_tokens=state.output_tokens,
            cache_read_tokens=state.cache_read_tokens,
            cache_write_tokens=state.cache_write_tokens,
            reasoning_tokens=state.reasoning_tokens,
            usage_source="none" if figures.count(None) == len(figures) else "provider",
            finish_reason=state.finish_reason,
            event_count=self.event_count,
            comment_count=self._decoder.comment_count,
            model=state.model,
            text=text,
            first_event_offset=self._first_offset,
            skipped_events=self.skipped_events,
        )

    def _feed_first(self, chunk: bytes) -> list[ServerSentEvent]:
        """Feed up to each blank line separately until the first event, to know its offset."""
        decoder = self._decoder
        base = self.bytes_fed
        start = previous = 0
        for match in _LINE_END.finditer(chunk):
            line_start, line_end = match.span()
            if line_start == previous:
                events = decoder.feed(chunk[start:line_end])
                start = line_end
                if events:
                    self._first_offset = base + line_end
                    return events + decoder.feed(chunk[line_end:])
            previous = line_end
        return decoder.feed(chunk[start:])

    def _read(self, events: list[ServerSentEvent]) -> None:
        state = self._state
        adapter = self._adapter
        for event in events:
            if adapter is None:
                adapter = self._detect(event)
                if adapter is None:
                    if event.event == "error":
                        error_frame(state, event.data)
                    elif event.data == "[DONE]":
                        state.terminal = True
                    continue
            if event.data == "[DONE]":
                state.terminal = True
            else:
                adapter(state, event)

    def _detect(self, event: ServerSentEvent) -> Adapter | None:
        if not self._detections_left:
            return None
        self._detections_left -= 1
        provider_format = detect(event)
        if provider_format is None:
            return None
        self._state.provider_format = provider_format
        self._adapter = ADAPTERS[provider_format]
        return self._adapter

    def _stop(self, error: dict[str, Any]) -> None:
        self._stopped = True
        self._state.set_error(error, "")
