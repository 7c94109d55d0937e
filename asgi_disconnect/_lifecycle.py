"""The process lifecycle of the stack: one owner runs the lifespan protocol for every part.

The outermost middleware of the package that sees the ``lifespan`` scope creates the
``Lifecycle`` and puts it at ``scope["asgi_disconnect"]``; the others find it there and
register their hooks. At ``lifespan.startup`` the owner runs the startup hooks in order
(outermost first); a hook that raises makes the server see ``lifespan.startup.failed`` with
the reason, so it exits instead of serving, and then the hook's error is raised from the
lifespan call. At ``lifespan.shutdown`` it runs, before the app's own shutdown, the phases
in this order:

1. ``stop_admitting``: new requests are refused (503) — drain plugs in here;
2. ``finish``: running generations get until the deadline, then are interrupted;
3. ``flush``: usage emitters write their last records;
4. ``close``: the backend persists what is pending and closes.

A hook that fails is logged and the next one runs: a shutdown always reaches ``close``.

A drain (``DrainMiddleware``, before the server's own shutdown) calls the ``drain``
hooks: each lets its running work end until the deadline, then interrupts what is left.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ._contract import SCOPE_KEY

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ._contract import AttemptObserver

__all__ = ["Lifecycle", "Phase", "lifecycle_of"]

logger = logging.getLogger("asgi_disconnect")

Hook = Callable[[], Awaitable[None] | None]
DrainHook = Callable[[float, int], Awaitable[None]]


class Phase(enum.IntEnum):
    """Shutdown phases, in the order they run."""

    STOP_ADMITTING = 1
    FINISH = 2
    FLUSH = 3
    CLOSE = 4


class _StartupFailed(Exception):
    pass


class Lifecycle:
    """Startup hooks and ordered shutdown phases for one app's stack of middlewares."""

    def __init__(self) -> None:
        self.startup: list[tuple[str, Hook]] = []
        self.shutdown: list[tuple[Phase, int, str, Hook]] = []
        self.drains: list[tuple[str, DrainHook]] = []
        self.parts: list[str] = []
        self.started = False
        self.stopping = False
        self.stopped = False
        # Set by TelemetryMiddleware: it sees the attempts of generations taken over here.
        self.attempts: AttemptObserver | None = None

    def register(
        self,
        part: str,
        *,
        unique: bool = False,
        startup: Hook | None = None,
        drain: DrainHook | None = None,
        **phases: Hook,
    ) -> None:
        """Add ``part``'s hooks; ``phases`` are named after ``Phase`` in lower case;
        ``drain(deadline, retry_after)``: see ``drain``.

        ``unique`` parts may appear once per app: a second one fails the startup.
        """
        if unique and part in self.parts:
            self.startup.append((part, _duplicate(part)))
        self.parts.append(part)
        if startup is not None:
            self.startup.append((part, startup))
        if drain is not None:
            self.drains.append((part, drain))
        for name, hook in phases.items():
            self.shutdown.append((Phase[name.upper()], len(self.shutdown), part, hook))

    async def run_startup(self) -> None:
        for part, hook in self.startup:
            try:
                result = hook()
                if result is not None:
                    await result
            except Exception as exc:
                raise _StartupFailed(f"{part}: {exc}") from exc
        self.started = True

    async def run_shutdown(self) -> None:
        if self.stopped:
            return
        self.stopping = True
        for phase, _, part, hook in sorted(self.shutdown, key=lambda item: item[:2]):
            try:
                result = hook()
                if result is not None:
                    await result
            except Exception:
                logger.exception("%s failed during shutdown (%s)", part, phase.name.lower())
        self.stopped = True

    async def drain(self, deadline: float, retry_after: int) -> None:
        """Let running work end until ``deadline`` (the event loop's clock), then interrupt
        what is left, telling clients to retry after ``retry_after`` seconds."""
        for part, hook in self.drains:
            try:
                await hook(deadline, retry_after)
            except Exception:
                logger.exception("%s failed during a drain", part)

    async def run(
        self, owner: bool, app: ASGIApp, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Pass the lifespan scope on to ``app``: served with the hooks by its ``owner``
        (the outermost part), as it is by every other part."""
        if owner:
            await self.serve(app, scope, receive, send)
        else:
            await app(scope, receive, send)

    async def serve(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the lifespan protocol of ``app`` with this lifecycle's hooks around it."""
        failed = False

        async def lifespan_receive() -> Message:
            nonlocal failed
            message = await receive()
            kind = message["type"]
            if kind == "lifespan.startup":
                try:
                    await self.run_startup()
                except _StartupFailed as exc:
                    failed = True
                    await self.run_shutdown()
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    raise
            elif kind == "lifespan.shutdown":
                await self.run_shutdown()
            return message

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed":
                # The app's own startup failed after ours: release what we opened.
                await self.run_shutdown()
            await send(message)

        try:
            await app(scope, lifespan_receive, lifespan_send)
        except _StartupFailed as exc:
            if not failed or exc.__cause__ is None:
                raise
            # Raised after lifespan.startup.failed, as Starlette's router does: a server
            # that waits for the app to end (TestClient) learns the reason, not a hang.
            raise exc.__cause__ from None
        finally:
            if self.started and not self.stopped:
                # The app left the protocol without a shutdown (it raised): still close.
                await self.run_shutdown()


def _duplicate(part: str) -> Hook:
    def refuse() -> None:
        raise RuntimeError(
            f"{part} is installed twice on this app; each response would carry two "
            "generation ids. Add it once (install() adds it for you)."
        )

    return refuse


def lifecycle_of(scope: Scope) -> tuple[Lifecycle, bool]:
    """The app's lifecycle and whether the caller owns it (created it just now)."""
    found: Any = scope.get(SCOPE_KEY)
    if isinstance(found, Lifecycle):
        return found, False
    lifecycle = scope[SCOPE_KEY] = Lifecycle()
    return lifecycle, True
