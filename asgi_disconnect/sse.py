"""An incremental Server-Sent Events decoder: the WHATWG "interpreting an event stream" algorithm.

:class:`SSEDecoder` turns the bytes of a ``text/event-stream`` body, cut into chunks anywhere
(inside a line, a CRLF pair or a multi-byte UTF-8 sequence), into :class:`ServerSentEvent`
records, exactly as a browser's ``EventSource`` would dispatch them: UTF-8 with replacement of
invalid sequences, one leading BOM stripped, CR / LF / CRLF line ends, comments counted and
ignored, ``data`` lines joined with ``"\\n"``, an event with no ``data`` not dispatched, ``id``
persisting across events, ``retry`` only when all ASCII digits, and an event cut off by the end
of the stream discarded.

Memory is bounded: a line longer than ``max_line_bytes`` or an event whose data is larger than
``max_event_bytes`` raises :class:`SSEDecodeError`, the only exception :meth:`SSEDecoder.feed`
raises.

    decoder = SSEDecoder()
    for chunk in body_chunks:
        for event in decoder.feed(chunk):
            ...
    decoder.close()
"""

from __future__ import annotations

from typing import NoReturn

import msgspec

__all__ = ["SSEDecodeError", "SSEDecoder", "ServerSentEvent"]

_BOM = b"\xef\xbb\xbf"
# Chunks larger than this are decoded in slices, so the fast paths stay within the limits.
_SLICE = 1 << 16
# An unterminated event's complete lines are parsed (not kept as bytes) beyond this size.
_TAIL_CAP = 1 << 16


class SSEDecodeError(ValueError):
    """The stream broke a size limit; the decoder refuses further input."""


class ServerSentEvent(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One dispatched event.

    ``id`` is the stream's last event ID when the event was dispatched (it persists across
    events, like ``EventSource.lastEventId``); ``retry`` is the reconnection time set by this
    event's own lines, else None.
    """

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None


class SSEDecoder:
    """Decode an event stream incrementally; see the module docstring for the rules.

    ``comment_count`` counts comment lines (keep-alives such as ``: OPENROUTER PROCESSING``),
    ``last_event_id`` is the last event ID string, ``retry`` the last valid reconnection time and
    ``bytes_fed`` the number of bytes given to :meth:`feed`.
    """

    __slots__ = (
        "_at_start",
        "_block_retry",
        "_bom_head",
        "_comment_open",
        "_data",
        "_dirty",
        "_event_type",
        "_failed",
        "_fast_limit",
        "_id_buffer",
        "_max_event",
        "_max_line",
        "_partial",
        "_skip_lf",
        "_special",
        "_tail",
        "_tail_len",
        "bytes_fed",
        "comment_count",
        "last_event_id",
        "retry",
    )

    def __init__(self, *, max_line_bytes: int = 1 << 20, max_event_bytes: int = 4 << 20) -> None:
        if max_line_bytes < 1 or max_event_bytes < 1:
            raise ValueError("max_line_bytes and max_event_bytes must be positive")
        self._max_line = max_line_bytes
        self._max_event = max_event_bytes
        # An invalid byte decodes to U+FFFD, three bytes: below this a single-line event
        # cannot outgrow max_event_bytes, so the fast paths need no per-event size check.
        self._fast_limit = min(max_line_bytes, max_event_bytes // 3)
        self.comment_count = 0
        self.last_event_id = ""
        self.retry: int | None = None
        self.bytes_fed = 0
        self._tail: list[bytes] = []  # the unparsed bytes since the last block boundary
        self._tail_len = 0
        self._partial = 0  # bytes fed since the last line end
        self._dirty = False  # field lines were parsed since the last blank line
        self._comment_open = False  # the unterminated line is a comment
        self._data = bytearray()
        self._event_type = ""
        self._id_buffer = ""
        self._block_retry: int | None = None
        self._at_start = True
        self._bom_head = b""
        self._skip_lf = False
        self._failed = ""
        self._special = True

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Decode ``chunk``; return the events it completed, in order."""
        self.bytes_fed += len(chunk)
        if self._special:
            chunk = self._prepare(chunk)
            if not chunk:
                return []
        if 13 in chunk:
            if chunk[-1] == 13:
                self._skip_lf = self._special = True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if 10 not in chunk:
            if chunk:
                self._extend_line(chunk)
            return []
        if len(chunk) > _SLICE:
            return self._feed_slices(chunk)
        return self._feed_lines(chunk)

    def close(self) -> list[ServerSentEvent]:
        """End of stream: discard an event that was cut off (it is never dispatched)."""
        self._tail = []
        self._tail_len = self._partial = 0
        self._data = bytearray()
        self._event_type = ""
        self._block_retry = None
        self._dirty = self._comment_open = False
        self._bom_head = b""
        return []

    def _prepare(self, chunk: bytes) -> bytes:
        if self._failed:
            raise SSEDecodeError(self._failed)
        if self._at_start:
            head = self._bom_head + chunk
            if len(head) < 3 and _BOM.startswith(head):
                self._bom_head = head
                return b""
            self._at_start = False
            self._bom_head = b""
            chunk = head[3:] if head.startswith(_BOM) else head
        if self._skip_lf and chunk:
            self._skip_lf = False
            if chunk[0] == 10:
                chunk = chunk[1:]
        self._special = self._at_start or self._skip_lf
        return chunk

    def _feed_slices(self, chunk: bytes) -> list[ServerSentEvent]:
        events: list[ServerSentEvent] = []
        for start in range(0, len(chunk), _SLICE):
            piece = chunk[start : start + _SLICE]
            if 10 in piece:
                events += self._feed_lines(piece)
            else:
                self._extend_line(piece)
        return events

    def _extend_line(self, piece: bytes) -> None:
        """Keep ``piece``, which holds no line end, unparsed until its line ends."""
        partial = self._partial
        if partial + len(piece) > self._max_line:
            self._fail(f"an SSE line is longer than {self._max_line} bytes")
        if not partial:
            self._comment_open = piece[0] == 58
        self._partial = partial + len(piece)
        self._tail.append(piece)
        self._tail_len += len(piece)

    def _fail(self, message: str) -> NoReturn:
        self.close()
        self._failed = message
        self._special = True
        raise SSEDecodeError(message)

    def _feed_lines(self, chunk: bytes) -> list[ServerSentEvent]:
        """Feed a chunk that holds at least one LF and no CR."""
        size = len(chunk)
        partial = self._partial
        if partial + size > self._max_line:
            self._check_lines(partial, chunk)
        self._partial = size - chunk.rfind(b"\n") - 1
        tail = self._tail
        out: list[ServerSentEvent] = []
        if tail or self._dirty:
            if partial == 0 and chunk[0] == 10:
                if not tail:
                    # A blank line ends the event whose lines were parsed already.
                    self._dispatch(out)
                    chunk = chunk[1:]
                    if 10 not in chunk:
                        if chunk:
                            self._comment_open = chunk[0] == 58
                            self._tail = [chunk]
                            self._tail_len = len(chunk)
                        return out
            elif chunk.find(b"\n\n") < 0:
                self._store(chunk, partial == 0, out)
                return out
            if tail:
                tail.append(chunk)
                chunk = b"".join(tail)
                self._tail = []
                self._tail_len = 0
        end = chunk.rfind(b"\n\n") + 2
        if end == 1:
            self._store(chunk, True, out)
            return out
        self._comment_open = False
        if end == len(chunk):
            self._parse(chunk.decode("utf-8", "replace"), end > self._fast_limit, out)
        else:
            self._parse(chunk[:end].decode("utf-8", "replace"), end > self._fast_limit, out)
            self._store(chunk[end:], True, out)
        return out

    def _store(self, piece: bytes, line_start: bool, out: list[ServerSentEvent]) -> None:
        """Keep ``piece``, which holds an LF, unparsed until its event ends.

        Complete comment lines are parsed at once, so ``comment_count`` never lags.
        """
        self._tail.append(piece)
        self._tail_len += len(piece)
        last = len(piece) - self._partial - 1
        if (
            self._comment_open
            or (line_start and piece[0] == 58)
            or piece.find(b"\n:", 0, last) >= 0
            or self._tail_len > _TAIL_CAP
        ):
            self._flush_tail(out)
        self._comment_open = self._partial > 0 and piece[last + 1] == 58

    def _check_lines(self, partial: int, chunk: bytes) -> None:
        limit = self._max_line
        first = chunk.find(b"\n")
        if first < 0:
            first = len(chunk)
        if partial + first > limit:
            self._fail(f"an SSE line is longer than {limit} bytes")
        pos = first + 1
        while len(chunk) - pos > limit:
            newline = chunk.rfind(b"\n", pos, pos + limit + 1)
            if newline < 0:
                self._fail(f"an SSE line is longer than {limit} bytes")
            pos = newline + 1

    def _flush_tail(self, out: list[ServerSentEvent]) -> None:
        """Parse the complete lines of an overlong unterminated event, keeping only its data."""
        pending = b"".join(self._tail)
        cut = len(pending) - self._partial
        if cut <= 0:
            self._tail = [pending]
            return
        rest = pending[cut:]
        self._tail = [rest] if rest else []
        self._tail_len = len(rest)
        for line in pending[: cut - 1].decode("utf-8", "replace").split("\n"):
            self._line(line, out)

    def _parse(self, text: str, big: bool, out: list[ServerSentEvent]) -> None:
        """Parse ``text``: whole lines ending with a blank line; the first may continue an event."""
        pos = 0
        if self._dirty:
            if text[0] == "\n":
                self._dispatch(out)
                pos = 1
            else:
                end = text.find("\n\n")
                self._block(text[:end], out)
                pos = end + 2
        size = len(text)
        while pos < size:
            if text[pos] == "\n":
                pos += 1  # a blank line between events dispatches nothing
                continue
            if not big:
                if text.startswith("data: ", pos):
                    self._data_run(text[pos + 6 :], out)
                    return
                if text.startswith("event: ", pos):
                    self._event_run(text[pos + 7 :], out)
                    return
            end = text.find("\n\n", pos)
            self._block(text[pos:end], out)
            pos = end + 2

    def _data_run(self, text: str, out: list[ServerSentEvent]) -> None:
        """Parse blocks after a leading ``data: ``; ``data: VALUE`` blocks take the fast path."""
        pieces = text.split("\n\ndata: ")
        last = pieces.pop()[:-2]
        append = out.append
        event_id = self.last_event_id
        for piece in pieces:
            if "\n" in piece:
                self._block("data: " + piece, out)
                event_id = self.last_event_id
            else:
                append(ServerSentEvent(data=piece, id=event_id))
        if "\n" in last:
            self._block("data: " + last, out)
        else:
            append(ServerSentEvent(data=last, id=event_id))

    def _event_run(self, text: str, out: list[ServerSentEvent]) -> None:
        """Parse blocks after a leading ``event: ``; ``event: NAME\\ndata: VALUE`` go fast."""
        pieces = text.split("\n\nevent: ")
        pieces[-1] = pieces[-1][:-2]
        append = out.append
        event_id = self.last_event_id
        for piece in pieces:
            name, found, data = piece.partition("\ndata: ")
            if found and "\n" not in name and "\n" not in data:
                append(ServerSentEvent(event=name or "message", data=data, id=event_id))
            else:
                self._block("event: " + piece, out)
                event_id = self.last_event_id

    def _block(self, text: str, out: list[ServerSentEvent]) -> None:
        """Parse the lines of ``text``, then the blank line that ends it."""
        for line in text.split("\n"):
            self._line(line, out)
        self._dispatch(out)

    def _line(self, line: str, out: list[ServerSentEvent]) -> None:
        if not line:
            self._dispatch(out)
            return
        if line[0] == ":":
            self.comment_count += 1
            return
        self._dirty = True
        name, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if name == "data":
            encoded = value.encode()
            if len(self._data) + len(encoded) > self._max_event:
                self._fail(f"an SSE event's data is larger than {self._max_event} bytes")
            self._data += encoded
            self._data.append(10)
        elif name == "event":
            self._event_type = value
        elif name == "id":
            if "\0" not in value:
                self._id_buffer = value
        elif name == "retry" and value.isascii() and value.isdigit():
            try:
                retry = int(value.lstrip("0") or "0")
            except ValueError:  # more digits than int() accepts: no sensible delay
                return
            self.retry = self._block_retry = retry

    def _dispatch(self, out: list[ServerSentEvent]) -> None:
        self.last_event_id = self._id_buffer
        self._dirty = False
        if self._data:
            out.append(
                ServerSentEvent(
                    event=self._event_type or "message",
                    data=self._data[:-1].decode(),
                    id=self._id_buffer,
                    retry=self._block_retry,
                )
            )
            self._data = bytearray()
        self._event_type = ""
        self._block_retry = None
