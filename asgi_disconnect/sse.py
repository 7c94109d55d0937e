"""An incremental Server-Sent Events decoder: the WHATWG "interpreting an event stream" algorithm.

``SSEDecoder`` turns the bytes of a ``text/event-stream`` body, cut into chunks anywhere
(inside a line, a CRLF pair or a multi-byte UTF-8 sequence), into ``ServerSentEvent``
records, exactly as a browser's ``EventSource`` would dispatch them: UTF-8 with replacement of
invalid sequences, one leading BOM stripped, CR / LF / CRLF line ends, comments counted and
ignored, ``data`` lines joined with ``"\\n"``, an event with no ``data`` not dispatched, ``id``
persisting across events, ``retry`` only when all ASCII digits, and an event cut off by the end
of the stream discarded.

Memory is bounded: a line longer than ``max_line_bytes`` or an event whose data is larger than
``max_event_bytes`` (UTF-8) raises ``SSEDecodeError``, the only exception
``SSEDecoder.feed`` raises::

    decoder = SSEDecoder()
    for chunk in body_chunks:
        for event in decoder.feed(chunk):
            ...
    decoder.close()

The wheel build compiles this module with mypyc where it can (``hatch_build.py``), so it
stays plain, fully typed Python that mypyc accepts; the tests run it both ways.
"""

from __future__ import annotations

from typing import NoReturn

import msgspec

__all__ = ["SSEDecodeError", "SSEDecoder", "ServerSentEvent"]

_BOM = b"\xef\xbb\xbf"
# Larger chunks are decoded in slices, which bounds the work done between two size checks.
_SLICE = 1 << 16
# Beyond this size the complete lines of an unfinished event are parsed rather than kept.
_TAIL_CAP = 1 << 16


class SSEDecodeError(ValueError):
    """The stream broke a size limit; the decoder refuses further input."""


class ServerSentEvent(msgspec.Struct, frozen=True, gc=False):
    """One dispatched event.

    ``id`` is the stream's last event ID when the event was dispatched (it persists across
    events, like ``EventSource.lastEventId``); ``retry`` is the reconnection time set by this
    event's own lines, else None.
    """

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None


def _retry_value(value: str) -> int | None:
    if not (value.isascii() and value.isdigit()):
        return None
    try:
        return int(value.lstrip("0") or "0")
    except ValueError:  # more digits than int() accepts: no sensible delay
        return None


def _last_retry(lines: bytes) -> int | None:
    """The value of the last valid ``retry`` line among complete ``lines``, else None."""
    retry = None
    if b"retry" in lines:
        for line in lines.decode("utf-8", "replace").split("\n"):
            name, _, value = line.partition(":")
            if name == "retry":
                found = _retry_value(value[1:] if value[:1] == " " else value)
                retry = retry if found is None else found
    return retry


def _one_event(chunk: bytes, last_event_id: str) -> list[ServerSentEvent] | None:
    """``chunk`` as its one event (a ``data:`` line, or an ``event:`` and a ``data:`` line,
    then a blank line), or None if it is not that simple."""
    head, _, rest = chunk.partition(b"\n")
    if rest == b"\n":
        if head[:6] == b"data: ":
            return [ServerSentEvent("message", head[6:].decode("utf-8", "replace"), last_event_id)]
    elif head[:7] == b"event: ":
        line, _, rest = rest.partition(b"\n")
        if rest == b"\n" and line[:6] == b"data: ":
            return [
                ServerSentEvent(
                    event=head[7:].decode("utf-8", "replace") or "message",
                    data=line[6:].decode("utf-8", "replace"),
                    id=last_event_id,
                )
            ]
    return None


def _has_long_line(partial: int, chunk: bytes, limit: int) -> bool:
    """Whether a line of ``chunk``, which holds an LF, is longer than ``limit`` bytes; its
    first line continues an unterminated line of ``partial`` bytes, its last may go on."""
    first = chunk.find(b"\n")
    if partial + first > limit:
        return True
    pos = first + 1
    while len(chunk) - pos > limit:
        newline = chunk.rfind(b"\n", pos, pos + limit + 1)
        if newline < 0:
            return True
        pos = newline + 1
    return False


class SSEDecoder:
    """Decode an event stream incrementally; see the module docstring for the rules.

    ``last_event_id`` is the last event ID string and ``bytes_fed`` the number of bytes given
    to ``feed``.

    Blocks of the form ``data: VALUE`` and ``event: NAME`` + ``data: VALUE`` are recognised
    whole and decoded with one UTF-8 decode per chunk; anything else goes through the
    line-by-line algorithm.
    """

    __slots__ = (
        "_at_start",
        "_block_retry",
        "_bom_head",
        "_comments",
        "_data",
        "_dirty",
        "_event_type",
        "_failed",
        "_fast_limit",
        "_id_buffer",
        "_max_event",
        "_max_line",
        "_partial",
        "_retry",
        "_skip_lf",
        "_special",
        "_tail",
        "_tail_len",
        "bytes_fed",
        "last_event_id",
    )

    def __init__(self, *, max_line_bytes: int = 1 << 20, max_event_bytes: int = 4 << 20) -> None:
        if max_line_bytes < 1 or max_event_bytes < 1:
            raise ValueError("max_line_bytes and max_event_bytes must be positive")
        self._max_line = max_line_bytes
        self._max_event = max_event_bytes
        # An invalid byte decodes to U+FFFD, three bytes: below this a one-line event cannot
        # outgrow max_event_bytes, so the whole-block paths need no per-event size check.
        self._fast_limit = min(max_line_bytes, max_event_bytes // 3)
        self.last_event_id = ""
        self.bytes_fed = 0
        self._comments = 0
        self._retry: int | None = None
        self._tail: list[bytes] = []  # the unparsed bytes since the last blank line
        self._tail_len = 0  # with _partial, an upper bound of the tail's size
        self._partial = 0  # the length of the unterminated line
        self._dirty = False  # field lines were parsed since the last blank line
        self._data = bytearray()
        self._event_type = ""
        self._id_buffer = ""
        self._block_retry: int | None = None
        self._at_start = True
        self._bom_head = b""
        self._skip_lf = False
        self._failed = ""
        self._special = True

    @property
    def comment_count(self) -> int:
        """Comment lines seen so far (keep-alives such as ``: OPENROUTER PROCESSING``)."""
        pending = self._pending_lines()
        return self._comments + pending.startswith(b":") + pending.count(b"\n:")

    @property
    def retry(self) -> int | None:
        """The reconnection time (ms) set by the last valid ``retry`` line, else None."""
        found = _last_retry(self._pending_lines())
        return self._retry if found is None else found

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Decode ``chunk``; return the events it completed, in order.

        Raises ``SSEDecodeError`` when the stream breaks a size limit, and from then on.
        """
        size = len(chunk)
        self.bytes_fed += size
        if self._special or 13 in chunk:
            return self._feed_special(chunk)
        if 10 not in chunk:
            partial = self._partial + size
            if partial > self._max_line:
                self._fail(f"an SSE line is longer than {self._max_line} bytes")
            self._partial = partial
            self._tail.append(chunk)
            return []
        if size > _SLICE:
            return self._feed_special(chunk)
        if chunk[-1] == 10 and not (self._tail or self._dirty) and size <= self._fast_limit:
            # A chunk that is exactly one event, as an app or a network read delivers it.
            one = _one_event(chunk, self.last_event_id)
            if one is not None:
                return one
        partial = self._partial
        if partial + size > self._max_line and _has_long_line(partial, chunk, self._max_line):
            self._fail(f"an SSE line is longer than {self._max_line} bytes")
        newline = chunk.rfind(b"\n")
        self._partial = size - newline - 1
        if not newline or chunk[newline - 1] != 10:
            return self._feed_lines(chunk, newline, partial)
        # The chunk's last LF ends a blank line: parse up to it, keep the rest.
        chunk = self._through(chunk, newline, size)
        text = chunk.decode("utf-8", "replace")
        if self._dirty or len(chunk) > self._fast_limit:
            out: list[ServerSentEvent] = []
            self._parse(text, len(chunk) > self._fast_limit, out)
            return out
        if text[:6] == "data: ":
            newline = text.find("\n")
            if newline == len(text) - 2:
                return [ServerSentEvent("message", text[6:newline], self.last_event_id)]
        out = []
        self._run(text, out)
        return out

    def _through(self, chunk: bytes, newline: int, size: int) -> bytes:
        """The bytes through the blank line that ends at ``newline``, with what waited
        before them; the rest of ``chunk`` waits for the next one."""
        if newline + 1 < size:
            rest = chunk[newline + 1 :]
            chunk = chunk[: newline + 1]
            if self._tail:
                self._tail.append(chunk)
                chunk = b"".join(self._tail)
            self._tail = [rest]
            self._tail_len = 0
        elif self._tail:
            self._tail.append(chunk)
            chunk = b"".join(self._tail)
            self._tail = []
            self._tail_len = 0
        return chunk

    def _feed_lines(self, chunk: bytes, newline: int, partial: int) -> list[ServerSentEvent]:
        """Feed a chunk whose last LF does not end a blank line; ``partial`` as it was."""
        end = chunk.rfind(b"\n\n", 0, newline) + 2
        out: list[ServerSentEvent] = []
        if end == 1 and (partial or chunk[0] != 10 or not (self._tail or self._dirty)):
            # No blank line ends an event here: keep the bytes until one does.
            self._tail.append(chunk)
            self._tail_len += partial + len(chunk)
            if self._tail_len > _TAIL_CAP:
                self._flush_tail(out)
            return out
        rest = chunk[end:]
        chunk = chunk[:end]
        if self._tail:
            self._tail.append(chunk)
            chunk = b"".join(self._tail)
        self._tail = [rest] if rest else []
        self._tail_len = len(rest) - self._partial
        text = chunk.decode("utf-8", "replace")
        if self._dirty or len(chunk) > self._fast_limit:
            self._parse(text, len(chunk) > self._fast_limit, out)
        else:
            self._run(text, out)
        return out

    def close(self) -> list[ServerSentEvent]:
        """End of stream: discard an event that was cut off, which is never dispatched.

        Returns no events; it exists so that a stream's end is explicit, like ``feed``.
        """
        self._comments = self.comment_count
        self._retry = self.retry
        self._tail = []
        self._tail_len = self._partial = 0
        self._data = bytearray()
        self._event_type = ""
        self._block_retry = None
        self._dirty = False
        self._bom_head = b""
        return []

    def _pending_lines(self) -> bytes:
        """The complete lines kept unparsed in the tail."""
        pending = b"".join(self._tail)
        return pending[: len(pending) - self._partial]

    def _feed_special(self, chunk: bytes) -> list[ServerSentEvent]:
        """Feed a chunk at the start of the stream, after a CR, holding a CR, or a large one."""
        if self._special:
            if self._failed:
                raise SSEDecodeError(self._failed)
            chunk = self._prepare(chunk)
        skip_lf = False
        if 13 in chunk:
            skip_lf = chunk[-1] == 13
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        # feed() counts the pieces again.
        self.bytes_fed -= len(chunk)
        events: list[ServerSentEvent] = []
        for start in range(0, len(chunk), _SLICE):
            events += self.feed(chunk[start : start + _SLICE])
        if skip_lf:
            self._skip_lf = self._special = True
        return events

    def _prepare(self, chunk: bytes) -> bytes:
        """Strip a BOM at the start of the stream and the LF of a CRLF split across chunks."""
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

    def _fail(self, message: str) -> NoReturn:
        self.close()
        self._failed = message
        self._special = True
        raise SSEDecodeError(message)

    def _flush_tail(self, out: list[ServerSentEvent]) -> None:
        """Parse the complete lines kept in the tail; only the first of them can be blank."""
        pending = b"".join(self._tail)
        cut = len(pending) - self._partial
        rest = pending[cut:]
        self._tail = [rest] if rest else []
        self._tail_len = 0
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
        if not big:
            if pos < len(text):
                self._run(text[pos:] if pos else text, out)
            return
        size = len(text)
        while pos < size:
            if text[pos] == "\n":
                pos += 1  # a blank line between events dispatches nothing
                continue
            end = text.find("\n\n", pos)
            self._block(text[pos:end], out)
            pos = end + 2

    def _run(self, text: str, out: list[ServerSentEvent]) -> None:
        """Parse whole blocks, the last one ending with a blank line, from the start of a block.

        A stream repeats one shape, ``data: VALUE`` or ``event: NAME`` + ``data: VALUE``: one
        split on the blank line and the next block's first field cuts the run into events.
        A piece that is not that shape is cut into blocks and each is parsed on its own.
        """
        append = out.append
        event_id = self.last_event_id
        if text.startswith("data: "):
            pieces = text.split("\n\ndata: ")
            pieces[0] = pieces[0][6:]
            pieces[-1] = pieces[-1][:-2]
            for piece in pieces:
                if "\n" in piece:
                    self._blocks(piece, "data: ", out)
                    event_id = self.last_event_id
                else:
                    append(ServerSentEvent("message", piece, event_id))
        elif text.startswith("event: "):
            pieces = text.split("\n\nevent: ")
            pieces[0] = pieces[0][7:]
            pieces[-1] = pieces[-1][:-2]
            for piece in pieces:
                newline = piece.find("\n")
                if (
                    newline >= 0
                    and piece.startswith("data: ", newline + 1)
                    and piece.find("\n", newline + 7) < 0
                ):
                    append(
                        ServerSentEvent(
                            piece[:newline] or "message", piece[newline + 7 :], event_id
                        )
                    )
                else:
                    self._blocks(piece, "event: ", out)
                    event_id = self.last_event_id
        else:
            self._blocks(text[:-2], "", out)

    def _blocks(self, text: str, field: str, out: list[ServerSentEvent]) -> None:
        """Parse ``field + text``, blocks separated by blank lines, up to the next run.

        A block that starts a run of another shape hands the rest to ``_run``. That rest
        holds no block starting with the shape ``text`` was cut from, so this recurses at most
        twice whatever the input.
        """
        end = text.find("\n\n")
        self._one_block(field + text[:end] if end >= 0 else field + text, out)
        while end >= 0:
            pos = end + 2
            if text.startswith("data: ", pos) or text.startswith("event: ", pos):
                self._run(text[pos:] + "\n\n", out)
                return
            end = text.find("\n\n", pos)
            if end != pos:
                self._one_block(text[pos:end] if end >= 0 else text[pos:], out)

    def _one_block(self, block: str, out: list[ServerSentEvent]) -> None:
        """Parse one block: the two common shapes at once, any other line by line."""
        if block.startswith("data: "):
            if "\n" not in block:
                out.append(ServerSentEvent("message", block[6:], self.last_event_id))
                return
        elif block.startswith("event: "):
            newline = block.find("\n")
            if block.startswith("data: ", newline + 1) and block.find("\n", newline + 7) < 0:
                name = block[7:newline] or "message"
                out.append(ServerSentEvent(name, block[newline + 7 :], self.last_event_id))
                return
        self._block(block, out)

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
            self._comments += 1
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
        elif name == "retry":
            retry = _retry_value(value)
            if retry is not None:
                self._retry = self._block_retry = retry

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
