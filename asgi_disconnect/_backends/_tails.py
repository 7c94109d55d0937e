"""Generations produced by other processes, followed in the store for readers in this one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Protocol

from .._errors import BackendUnavailable
from .._records import Status

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from .._records import GenerationInfo

__all__ = ["StoreTails", "TailSource"]

logger = logging.getLogger("asgi_disconnect")


class TailSource(Protocol):
    """What the tails ask of a store: a generation's row, its bytes, and a wait for it to
    change (a notification on PostgreSQL, one poller per store on SQLite)."""

    async def info(self, generation_id: str) -> tuple[GenerationInfo, str] | None:
        """The generation's info and its principal, or None if it is unknown or expired."""

    async def read(self, generation_id: str, offset: int, limit: int) -> bytes:
        """About ``limit`` of its stored bytes from ``offset``; b"" past its rows."""

    async def changed(self, generation_id: str, seen: tuple[str, int]) -> tuple[str, int] | None:
        """Wait until the generation may have moved on from ``seen`` (status, size): what
        it is now, or None when the store does not say (ask ``info``). The store bounds the
        wait itself, so that a notice it missed costs at most that long."""


class _Tail:
    """A generation produced elsewhere, followed once for every reader in this process.

    One task looks at the store when it changed and reads what it gained; the latest piece
    read stays here, so readers that kept up take it without a query. A reader behind the
    piece reads the store on its own until it catches up.
    """

    __slots__ = (
        "end",
        "error",
        "final",
        "gone",
        "piece",
        "readers",
        "ready",
        "start",
        "state",
        "waiters",
    )

    def __init__(self) -> None:
        self.start = 0  # the latest piece spans [start, end)
        self.end = 0
        self.piece = b""
        # (status, size) as the store last gave them
        self.state: tuple[str, int] = (Status.RUNNING.value, 0)
        self.ready = False  # the first look at the store is done
        self.final = False  # it ended and every byte of it was read
        self.gone = False  # unknown or expired
        self.error: BaseException | None = None
        self.readers = 0
        self.waiters: list[asyncio.Future[None]] = []

    def changed(self) -> asyncio.Future[None]:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        return waiter

    def wake(self) -> None:
        waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class StoreTails:
    """The generations this process follows in the store, one ``_Tail`` each.

    The first reader of a generation starts the task that polls it; the last reader to
    leave stops it. ``len()`` is the number of generations followed now.
    """

    def __init__(self, store: TailSource, url: str) -> None:
        self._store = store
        self._url = url
        self._following: dict[str, tuple[_Tail, asyncio.Task[None]]] = {}

    def __len__(self) -> int:
        return len(self._following)

    async def follow(self, generation_id: str, offset: int) -> AsyncGenerator[bytes, None]:
        """The generation's bytes from ``offset`` as the store gains them, to its end."""
        entry = self._join(generation_id)
        tail = entry[0]
        try:
            while True:
                self._check(generation_id, tail)
                if not tail.ready:
                    data = b""
                elif tail.start <= offset < tail.end:
                    data = tail.piece[offset - tail.start :]
                elif offset < tail.start:
                    # Behind the shared piece: catch up on its own.
                    data = await self._store.read(generation_id, offset, 1 << 20)
                    if not data:
                        return  # its rows are gone: expired and reaped
                else:
                    data = b""
                if data:
                    offset += len(data)
                    yield data
                    continue
                if tail.gone or (tail.final and offset >= tail.end):
                    return
                await tail.changed()
        finally:
            self._leave(generation_id, entry)

    async def wait_for_size(
        self, generation_id: str, size: int, timeout: float
    ) -> tuple[str, int] | None:
        """(status, size) once the store holds ``size`` bytes of the generation, once it
        ended, or after ``timeout`` seconds; None if it is unknown or expired. Waiting costs
        no query of its own: the generation's tail looks at the store for every reader."""
        entry = self._join(generation_id)
        tail = entry[0]
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    while not tail.gone and not tail.final:
                        self._check(generation_id, tail)
                        status, stored = tail.state
                        if tail.ready and (stored >= size or status != Status.RUNNING):
                            break
                        await tail.changed()
            self._check(generation_id, tail)
        finally:
            self._leave(generation_id, entry)
        return None if tail.gone or not tail.ready else tail.state

    def _join(self, generation_id: str) -> tuple[_Tail, asyncio.Task[None]]:
        """The generation's tail, started by its first reader, with one more reader."""
        entry = self._following.get(generation_id)
        if entry is None or entry[0].error is not None:
            tail = _Tail()
            task = asyncio.ensure_future(self._poll(generation_id, tail))
            entry = self._following[generation_id] = (tail, task)
        entry[0].readers += 1
        return entry

    def _leave(self, generation_id: str, entry: tuple[_Tail, asyncio.Task[None]]) -> None:
        """One reader fewer; the last one stops the tail."""
        tail, task = entry
        tail.readers -= 1
        if not tail.readers and self._following.get(generation_id) is entry:
            del self._following[generation_id]
            task.cancel()

    def _check(self, generation_id: str, tail: _Tail) -> None:
        if tail.error is not None:
            raise BackendUnavailable(
                f"following {generation_id} in {self._url} failed: {tail.error}"
            ) from tail.error

    async def _poll(self, generation_id: str, tail: _Tail) -> None:
        """Look at the store for ``tail`` each time it changed; read what it gained, once."""
        store = self._store
        # (status, size) as a change notice gave it; None: ask the store.
        state: tuple[str, int] | None = None
        try:
            while True:
                if state is None:
                    found = await store.info(generation_id)
                    if found is None:
                        tail.gone = True
                        return
                    state = (found[0].status.value, found[0].size)
                status, size = state
                moved, tail.state = state != tail.state, state
                if not tail.ready:
                    # Readers read what is stored so far themselves, from their own offsets.
                    tail.start = tail.end = size
                    tail.ready = True
                    tail.wake()
                while tail.end < size:
                    data = await store.read(generation_id, tail.end, 1 << 20)
                    if not data:
                        break  # expired meanwhile, or rows short of the size
                    tail.start, tail.piece = tail.end, data
                    tail.end += len(data)
                    moved = False
                    tail.wake()
                if moved:
                    tail.wake()  # the size or status changed, no bytes came: tell the waiters
                # The final status and the last rows are written in one transaction.
                if status != Status.RUNNING:
                    if tail.end < size:
                        logger.warning(
                            "generation %s is stored as %d bytes but its rows end at %d",
                            generation_id,
                            size,
                            tail.end,
                        )
                    tail.final = True
                    return
                state = await store.changed(generation_id, state)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            tail.error = exc
        finally:
            tail.wake()

    async def aclose(self) -> None:
        """Stop following: every reader still waiting is told the store was closed."""
        tails, self._following = self._following, {}
        for tail, task in tails.values():
            task.cancel()
            tail.error = BackendUnavailable(f"{self._url} was closed")
        await asyncio.gather(*(task for _, task in tails.values()), return_exceptions=True)
        for tail, _ in tails.values():
            tail.wake()
