"""The asyncio helpers the middlewares share.

Everything here is asyncio's public API; no coroutine is stepped by hand, and none is
started in one task and finished in another (a timeout or a cancel scope inside it binds to
the task that entered it).
"""

from __future__ import annotations

import asyncio
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Awaitable, Coroutine

__all__ = [
    "as_coroutine",
    "join",
    "shielded",
    "wait_bounded",
]

_COROUTINE = types.CoroutineType


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def as_coroutine(awaitable: Awaitable[Any]) -> Coroutine[Any, Any, Any]:
    """``awaitable`` as a coroutine, which a task can run; a server's ``send`` may return
    any awaitable (granian's is not a coroutine)."""
    if type(awaitable) is _COROUTINE:
        return awaitable
    return _awaited(awaitable)


async def join(task: asyncio.Task[Any]) -> None:
    """Wait for ``task`` to end, however it ends; raise only if we are cancelled."""
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not task.cancelled() or (current is not None and current.cancelling()):
            raise
    except Exception:
        pass


async def wait_bounded(task: asyncio.Task[Any], timeout: float, grace: float = 1.0) -> bool:
    """Wait up to ``timeout`` for ``task``; then cancel it and wait up to ``grace`` more.

    True if it ended. Never raises what the task raised; raises only if we are cancelled.
    """
    if not task.done():
        await asyncio.wait((task,), timeout=timeout)
    if not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=grace)
    return task.done()


async def shielded(coro: Any) -> None:
    """Run ``coro`` to the end even if the caller is cancelled meanwhile, then re-raise."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
