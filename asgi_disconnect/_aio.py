"""Two asyncio helpers the middlewares share."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["join", "shielded"]


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
