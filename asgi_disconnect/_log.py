"""The generation log: a response's bytes in the order the app produced them.

The others know a ``Generation`` only by the contract's view of it: the middlewares
as ``GenerationOutput`` (``RequestState.generation``), the stores as ``LiveLog``.
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_right
from typing import TYPE_CHECKING, Any

from ._records import GenerationInfo, Status

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

    from ._contract import ClientReader, LiveLog, StoreRoom

__all__ = ["HOLD_CHECK", "Generation", "Released", "now"]


_READ_LIMIT = 1 << 20
# A running event stream's log keeps its last events whole, up to this many bytes: metering
# reads the stream's end there when it ends (the provider's usage, the terminal marker).
TAIL_EVENTS = 3
TAIL_LIMIT = 960 << 10
# A log holding more than this in memory (a message's worth past the kept end of a stream)
# asks its store whether the output waiting to be written is over the process's bound.
HOLD_CHECK = 2 << 20


# What a released chunk's slot holds: its bytes are gone, its index stays.
_RELEASED = b""


class Released(LookupError):
    """The bytes asked for were released from memory; the store that flushed them has them."""


def now() -> float:
    """Unix seconds to the microsecond: what a database timestamp keeps, so a stored time
    reads back equal to the live one."""
    return time.time_ns() // 1000 / 1e6


class Generation:
    """One response's output, appended by the producer and read by any number of followers.

    Appending never waits: followers (the client writer, resume readers, a backend
    flusher) are woken and read at their own pace. ``chunks`` is the log itself; only the
    producer appends to it (``append``, which the exchange inlines on its per-chunk path).
    ``running`` is ``status is Status.RUNNING``, kept as a field because it is read per
    chunk and a property call there costs more than the rest of the check.
    """

    # Fields a generation starts with and rarely changes live on the class until it does,
    # so opening one (on every request) stores only what differs.
    finished_at: float | None = None
    status = Status.RUNNING
    running = True
    policy: str | None = None
    detached = False
    error: str | None = None
    size = 0
    _ends: list[int] | None = None  # chunk end offsets, built when a reader needs them
    waiters: list[asyncio.Future[None]] | None = None
    # Called once when the generation ends: the store that keeps it accounts for it then.
    on_finish: Callable[[LiveLog], None] | None = None
    # The request whose client reads this log as it is produced (its ``delivered_bytes``):
    # what it has not received yet is never released.
    reader: ClientReader | None = None
    # Chunks before ``base_index`` (bytes before ``base``) were released (see ``release``).
    base = 0
    base_index = 0
    # The upstream's name and the encoded continuation another replica would finish it with.
    continuation: tuple[str, bytes] | None = None
    # Which upstream call produces it: 1, or a later one after a takeover.
    attempt = 1
    # Ended here to be finished by another replica (a drain handed it over).
    handed_over = False
    # Its request's usage record is still to be written (metering waits, for one, on the
    # client's TCP acknowledgements): a durable store keeps the mark on its row meanwhile.
    record_owed = False
    # Where the exchange's own frames (an error frame, say) began: the app's output ends there.
    frames_at: int | None = None
    # With a store that gives back what memory released (a durable backend): how much of
    # its client's backlog memory keeps (16 KiB); older stored bytes are let go
    # and the client writer reads them back there. 0: what the client has not received stays.
    reads_back = 0
    # Set by a durable store, which bounds the output waiting for it across the process
    # (``max_pending_bytes``): a producer whose log holds more than HOLD_CHECK bytes not
    # let go (the store is behind) awaits ``hold.room()``, which returns at once under it.
    hold: StoreRoom | None = None

    def __init__(
        self,
        generation_id: str,
        *,
        principal: str,
        status_code: int = 200,
        content_type: str | None = None,
        headers: list[Any] | None = None,
    ) -> None:
        self.id = generation_id
        self.principal = principal
        self.status_code = status_code
        self._content_type = content_type
        # The response's raw headers; the content type is looked up only when needed.
        self._headers = headers
        self.created_at = time.time_ns() // 1000 / 1e6  # now(), inlined: once per request
        self.chunks: list[bytes] = []

    @classmethod
    def adopted(
        cls,
        *,
        generation_id: str,
        principal: str,
        size: int,
        status_code: int,
        content_type: str | None,
        policy: str | None,
        created_at: float,
        attempt: int,
    ) -> Generation:
        """A generation taken over from another process: its first ``size`` bytes are in
        the store (its first slot stands for them, released), and it goes on from there."""
        generation = cls(
            generation_id,
            principal=principal,
            status_code=status_code,
            content_type=content_type,
        )
        generation.created_at = created_at
        generation.policy = policy
        generation.detached = True
        generation.attempt = attempt
        generation.chunks.append(_RELEASED)
        generation.size = generation.base = size
        generation.base_index = 1
        return generation

    @property
    def content_type(self) -> str | None:
        headers = self._headers
        if headers is not None:
            self._headers = None
            for name, value in headers:
                if name.lower() == b"content-type":
                    self._content_type = bytes(value).decode("latin-1")
                    break
        return self._content_type

    def append(self, data: bytes) -> None:
        if not self.running:
            raise RuntimeError(
                f"generation {self.id} is {self.status.value}; it takes no more output"
            )
        self.size += len(data)
        self.chunks.append(data)
        if self.waiters:
            self.wake()

    def append_frame(self, data: bytes) -> None:
        """Append a frame of the exchange's own (not the app's output) after the output."""
        if self.frames_at is None:
            self.frames_at = self.size
        self.append(data)

    @property
    def output_size(self) -> int:
        """The bytes the app produced: the log's size before any frame of the exchange's."""
        frames_at = self.frames_at
        return self.size if frames_at is None else frames_at

    def finish(self, status: Status, error: str | None = None) -> bool:
        """Record the final status once; later calls are ignored and return False."""
        if not self.running:
            return False
        self.status = status
        self.running = False
        self.error = error
        self.finished_at = time.time_ns() // 1000 / 1e6  # now(), inlined
        if self.waiters:
            self.wake()
        on_finish = self.on_finish
        if on_finish is not None:
            on_finish(self)
        return True

    def wake(self) -> None:
        waiters, self.waiters = self.waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def changed(self) -> asyncio.Future[None]:
        """A future of the caller's own, resolved at the next append or finish."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.running:
            if self.waiters is None:
                self.waiters = []
            self.waiters.append(waiter)
        else:
            waiter.set_result(None)
        return waiter

    @property
    def chunk_count(self) -> int:
        return len(self.chunks)

    def chunks_from(self, index: int) -> list[bytes]:
        """The chunks from ``index`` on, as the producer appended them."""
        return self.chunks[index:]

    def stored(self, offset: int) -> None:
        """A store has the bytes before ``offset``: free those no reader in this process
        needs. Readers behind read the store; so does the request's own client for what is
        more than ``reads_back`` behind the log's end, else what it has not received stays; a
        detached generation's client is gone."""
        reader = self.reader
        if reader is not None and not self.detached:
            kept = reader.delivered_bytes
            if self.reads_back:
                kept = max(kept, self.size - self.reads_back)
            offset = min(offset, kept)
        if offset > self.base:
            self.release(offset)

    def release(self, offset: int) -> int:
        """Free the chunks that end at or before byte ``offset`` (a store has them, and no
        reader in this process needs them); their slots stay, so chunk indices hold.
        Returns the bytes freed. An event stream keeps its end (``tail_start``) while it
        runs and until its exchange is over (metering reads it there)."""
        if (self.running or self.reader is not None) and self._events():
            offset = min(offset, self.tail_start())
        chunks = self.chunks
        index = self.base_index
        base = start = self.base
        count = len(chunks)
        while index < count:
            size = len(chunks[index])
            if base + size > offset:
                break
            chunks[index] = _RELEASED
            base += size
            index += 1
        self.base, self.base_index = base, index
        return base - start

    def _events(self) -> bool:
        content_type = self.content_type
        return content_type is not None and content_type.startswith("text/event-stream")

    def tail_start(self) -> int:
        """Where an event stream's end starts in memory: just past the blank line before its
        last ``TAIL_EVENTS`` complete events (what follows them included), or
        ``TAIL_LIMIT`` bytes from its end, or ``base``, whichever is latest; but never inside
        an event: one that ``TAIL_LIMIT`` would cut (an image's base64 in the terminal event)
        is kept from its start, for metering to read it by its ends. A blank line split
        between chunks may go unseen, which keeps more, never less."""
        chunks = self.chunks
        index = len(chunks)
        end = self.size
        low = max(self.base, end - TAIL_LIMIT)
        found = 0
        after = b""
        while index > self.base_index and end > low:
            index -= 1
            chunk = chunks[index]
            start = end - len(chunk)
            if after[:1] == b"\n" and chunk.endswith(b"\n"):
                found += 1
                if found > TAIL_EVENTS:
                    return max(end + 1, low)
            position = len(chunk)
            while True:
                position = max(
                    chunk.rfind(b"\n\n", 0, position), chunk.rfind(b"\n\r\n", 0, position)
                )
                if position < 0:
                    break
                found += 1
                if found > TAIL_EVENTS:
                    mark = start + position
                    return max(mark + (2 if chunk[position + 1] == 10 else 3), low)
            after = chunk
            end = start
        return self._event_start(low) if low > self.base else low

    def _event_start(self, offset: int) -> int:
        """Just past the last blank line before ``offset`` in memory (the start of the event
        ``offset`` falls in), or ``base``."""
        chunks = self.chunks
        index = len(chunks)
        end = self.size
        while index > self.base_index:
            index -= 1
            chunk = chunks[index]
            start = end - len(chunk)
            if start < offset:
                limit = min(len(chunk), offset - start)
                position = max(chunk.rfind(b"\n\n", 0, limit), chunk.rfind(b"\n\r\n", 0, limit))
                if position >= 0:
                    return start + position + (2 if chunk[position + 1] == 10 else 3)
            end = start
        return self.base

    def read_back(self, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end``, found from the log's end (a few chunks back, no
        offsets built); ``start`` must be at or past ``base``."""
        chunks = self.chunks
        index = len(chunks)
        offset = self.size
        parts = []
        while index > self.base_index and offset > start:
            index -= 1
            chunk = chunks[index]
            offset -= len(chunk)
            parts.append(chunk)
        parts.reverse()
        return b"".join(parts)[start - offset : end - offset]

    def pieces(self, count: int = 128) -> Iterator[bytes]:
        """The log's bytes in order, ``count`` chunks joined at a time (joined in C, not one
        piece per chunk); all of them in memory (``base`` is 0)."""
        chunks = self.chunks
        for index in range(0, len(chunks), count):
            yield b"".join(chunks[index : index + count])

    def read(self, offset: int, limit: int = _READ_LIMIT) -> bytes:
        """Up to about ``limit`` bytes starting at byte ``offset``; ``Released`` below
        ``base``."""
        if offset >= self.size:
            return b""
        if offset < self.base:
            raise Released(
                f"bytes {offset}..{self.base} of generation {self.id} were released from "
                "memory; read them from the store"
            )
        ends = self._ends
        if ends is None:
            ends = self._ends = []
        if len(ends) < len(self.chunks):
            # Offsets are only needed by readers: extend them lazily, not on every append.
            if len(ends) < self.base_index:
                # Released chunks all end at ``base`` as far as a read is concerned.
                ends.extend([self.base] * (self.base_index - len(ends)))
            end = ends[-1] if ends else 0
            for chunk in self.chunks[len(ends) :]:
                end += len(chunk)
                ends.append(end)
        index = bisect_right(ends, offset)
        start = ends[index - 1] if index else 0
        first = self.chunks[index][offset - start :]
        parts = [first]
        total = len(first)
        index += 1
        while index < len(self.chunks) and total < limit:
            chunk = self.chunks[index]
            parts.append(chunk)
            total += len(chunk)
            index += 1
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def follow(
        self, offset: int, released: Callable[[int], Awaitable[bytes]] | None = None
    ) -> AsyncIterator[bytes]:
        """The bytes from ``offset``, then live until the generation ends; ``released``
        reads from the store what memory let go (below ``base``)."""
        while True:
            if offset < self.base and released is not None:
                data = await released(offset)
            else:
                data = self.read(offset)
            if data:
                offset += len(data)
                yield data
                continue
            if not self.running:
                return
            await self.changed()

    def info(self) -> GenerationInfo:
        return GenerationInfo(
            id=self.id,
            status=self.status,
            policy=self.policy,
            size=self.size,
            status_code=self.status_code,
            content_type=self.content_type,
            created_at=self.created_at,
            finished_at=self.finished_at,
            detached=self.detached,
            error=self.error,
            attempt=self.attempt,
        )
