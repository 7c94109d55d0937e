"""The asyncio helpers the middlewares share, and the one rule for stepping coroutines.

The rule: a coroutine that one task starts and another task finishes must, from its first
step, see the task and the context that will finish it. An outer ``send`` wrapper may arm
``asyncio.timeout`` or enter an anyio cancel scope: both bind to ``current_task()`` when
entered, and a timer that fires later cancels that task. :func:`step_as` takes a step under
the finishing task's identity and context, so such a timer cancels the task that awaits
the send, never the producer that happened to start it. Everything that steps a server's
``send`` by hand goes through :func:`step_as` and :class:`Resume`; nothing else does.

The one exception, for speed: a ``send`` that :func:`binds_nothing` (a server's own, alone
or behind Starlette's error middleware) is stepped in the producer's task as it is, because
nothing in it captures the task or the context.
"""

from __future__ import annotations

import asyncio
import types
from asyncio import tasks as _tasks
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Awaitable, Coroutine, Generator
    from contextvars import Context

__all__ = [
    "DONE",
    "Resume",
    "as_coroutine",
    "binds_nothing",
    "join",
    "shielded",
    "step_as",
    "wait_bounded",
]

_enter_task = _tasks._enter_task
_leave_task = _tasks._leave_task
_COROUTINE = types.CoroutineType
# The running task of a loop: a dict lookup where asyncio keeps one (3.11 to 3.13).
_running: dict[Any, Any] | None = getattr(_tasks, "_current_tasks", None)


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def as_coroutine(awaitable: Awaitable[Any]) -> Coroutine[Any, Any, Any]:
    """``awaitable`` as a coroutine that can be stepped with ``send``; a server's ``send``
    may return any awaitable (granian's is not a coroutine)."""
    if type(awaitable) is _COROUTINE:
        return awaitable
    return _awaited(awaitable)


# Servers whose own ``send`` is a coroutine that waits on plain futures and events, never
# on the running task. (granian's binds nothing either, but is not a coroutine.)
_PLAIN_SERVERS = ("uvicorn.", "hypercorn.")


def _errors_send_code() -> Any:
    from starlette.middleware.errors import ServerErrorMiddleware

    for const in ServerErrorMiddleware.__call__.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "_send":
            return const
    return None


_ERRORS_SEND = _errors_send_code()


def binds_nothing(send: Any) -> bool:
    """Whether ``send`` is a coroutine function known to bind nothing to the task or
    context that runs it: a server's own (uvicorn, hypercorn), alone or behind Starlette's
    ``ServerErrorMiddleware``, which only notes that the response started."""
    for _ in range(4):
        owner = getattr(send, "__self__", None)
        if owner is not None:
            return type(owner).__module__.startswith(_PLAIN_SERVERS)
        code = getattr(send, "__code__", None)
        if code is None or code is not _ERRORS_SEND:
            return False
        send = send.__closure__[code.co_freevars.index("send")].cell_contents
    return False


DONE: Any = object()
"""What :func:`step_as` returns when the coroutine finished in that step."""


def step_as(
    task: asyncio.Task[Any],
    context: Context,
    coro: Coroutine[Any, Any, Any],
    loop: asyncio.AbstractEventLoop,
) -> Any:
    """Take the first step of ``coro`` as ``task`` (of ``loop``) would, in its context.

    Returns what the coroutine now waits on, which only ``task`` may go on with (through
    :class:`Resume`), or :data:`DONE` if it finished in this step; raises what it raised.
    """
    running = _running
    if running is None:
        return _step_as_entered(task, context, coro, loop)
    # asyncio's own record of the running task, swapped and restored in place.
    current = running.get(loop)
    running[loop] = task
    try:
        return context.run(coro.send, None)
    except StopIteration:
        return DONE
    finally:
        if current is None:
            del running[loop]
        else:
            running[loop] = current


def _step_as_entered(
    task: asyncio.Task[Any],
    context: Context,
    coro: Coroutine[Any, Any, Any],
    loop: asyncio.AbstractEventLoop,
) -> Any:
    current = asyncio.current_task(loop)
    if current is not None:
        _leave_task(loop, current)
    _enter_task(loop, task)
    try:
        return context.run(coro.send, None)
    except StopIteration:
        return DONE
    finally:
        _leave_task(loop, task)
        if current is not None:
            _enter_task(loop, current)


class Resume:
    """Go on, in the awaiting task, with a coroutine stepped before (see :func:`step_as`).

    ``throw``: an exception that reached the awaiting task before it could resume the
    coroutine (a cancellation aimed at the send); it is thrown into the coroutine first.
    """

    __slots__ = ("coro", "throw", "waiting_on")

    def __init__(self, coro: Any, waiting_on: Any, throw: BaseException | None = None) -> None:
        self.coro = coro
        self.waiting_on = waiting_on
        self.throw = throw

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self.coro
        value = self.waiting_on
        if self.throw is not None:
            try:
                value = coro.throw(self.throw)
            except StopIteration as stop:
                return stop.value
        while True:
            try:
                sent = yield value
            except BaseException as exc:
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


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
