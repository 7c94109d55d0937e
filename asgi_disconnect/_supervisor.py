"""Owns the tasks that run apps, so a detached generation outlives its request."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

__all__ = ["Supervisor"]

logger = logging.getLogger("asgi_disconnect")


class Supervisor:
    """A set of app tasks whose lifetime is bound to the lifespan, not to requests.

    ``drain`` (at lifespan shutdown) waits for them up to a deadline, then cancels what
    is left; each cancelled generation records itself as ``interrupted``.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started = False
        self.stopping = False
        # Told each time a task ends (a drain waits for the last one).
        self.on_task_done: Callable[[], None] | None = None

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self) -> None:
        self.started = True
        self.stopping = False

    def stop_admitting(self) -> None:
        """Shutdown began: new work is refused from now on."""
        self.stopping = True

    def admit(self) -> None:
        """The lifespan ended: work is admitted again, tied to its request (an app used with
        and without a lifespan, as tests do)."""
        self.stopping = False

    def tasks(self) -> list[asyncio.Task[Any]]:
        """The tasks running now."""
        return list(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if self.on_task_done is not None:
            self.on_task_done()

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for running tasks; cancel the rest; how many."""
        self.stopping = True
        pending = set(self._tasks)
        if not pending:
            return 0
        logger.info("waiting up to %.1fs for %d running generation(s)", timeout, len(pending))
        _, pending = await asyncio.wait(pending, timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            logger.warning("cancelled %d generation(s) still running at shutdown", len(pending))
            await asyncio.wait(pending)
        self.started = False
        return len(pending)
