"""Drive an ASGI app in-process with a client that disconnects or stops reading."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable

    from starlette.types import ASGIApp, Message

__all__ = ["DriveResult", "drive", "lifespan"]


@dataclass
class DriveResult:
    """What the simulated client saw."""

    status: int | None = None
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False
    disconnected: bool = False
    messages: list[Message] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode("latin-1")
        for key, value in self.headers:
            if key.lower() == wanted:
                return value.decode("latin-1")
        return None


async def drive(
    app: ASGIApp,
    *,
    method: str = "GET",
    path: str = "/",
    query_string: bytes = b"",
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    body_chunks: Iterable[bytes] | None = None,
    disconnect_after_bytes: int | None = None,
    disconnect_after_seconds: float | None = None,
    stop_reading_after_bytes: int | None = None,
    spec_version: str = "2.3",
    timeout: float = 10.0,
) -> DriveResult:
    """Call ``app`` once as a server would, with a client that misbehaves on request.

    - ``disconnect_after_bytes``: the client goes away once that many body bytes arrived;
    - ``disconnect_after_seconds``: it goes away after that long, even before headers;
    - ``stop_reading_after_bytes``: from then on ``send`` blocks, like a full socket
      buffer, until the client goes away.

    After the client went away, ``send`` returns silently (spec 2.3) or raises
    ``OSError`` (spec 2.4+), and ``receive`` returns ``http.disconnect``. Returns when the
    app returns; raises ``TimeoutError`` after ``timeout`` seconds.
    """
    result = DriveResult()
    gone = asyncio.Event()
    response_done = asyncio.Event()
    parts = list(body_chunks) if body_chunks is not None else [body]
    raise_on_gone = tuple(int(x) for x in spec_version.split(".")) >= (2, 4)

    def go_away() -> None:
        result.disconnected = True
        gone.set()

    async def receive() -> Message:
        if parts:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}
        waiters = [asyncio.ensure_future(gone.wait()), asyncio.ensure_future(response_done.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            if raise_on_gone:
                raise OSError("client disconnected")
            return
        if (
            stop_reading_after_bytes is not None
            and message["type"] == "http.response.body"
            and len(result.body) >= stop_reading_after_bytes
        ):
            await gone.wait()
            if raise_on_gone:
                raise OSError("client disconnected")
            return
        result.messages.append(message)
        if message["type"] == "http.response.start":
            result.status = message["status"]
            result.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            result.body += message.get("body", b"")
            if not message.get("more_body", False):
                result.complete = True
                response_done.set()
            if disconnect_after_bytes is not None and len(result.body) >= disconnect_after_bytes:
                go_away()

    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec_version},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query_string,
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    timer = None
    if disconnect_after_seconds is not None:
        timer = asyncio.get_running_loop().call_later(disconnect_after_seconds, go_away)
    try:
        async with asyncio.timeout(timeout):
            await app(scope, receive, send)
    finally:
        if timer is not None:
            timer.cancel()
    return result


@contextlib.asynccontextmanager
async def lifespan(app: ASGIApp, *, timeout: float = 10.0) -> AsyncIterator[None]:
    """Run ``app``'s lifespan startup on entry and its shutdown on exit."""
    to_app: asyncio.Queue[Message] = asyncio.Queue()
    from_app: asyncio.Queue[Message] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, to_app.get, from_app.put))

    async def expect(kind: str) -> None:
        async with asyncio.timeout(timeout):
            getter = asyncio.ensure_future(from_app.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()
                raise RuntimeError(f"the app's lifespan ended before {kind}")
            message = getter.result()
        if message["type"] != kind:
            raise RuntimeError(f"lifespan: expected {kind}, got {message}")

    await to_app.put({"type": "lifespan.startup"})
    await expect("lifespan.startup.complete")
    try:
        yield
    finally:
        await to_app.put({"type": "lifespan.shutdown"})
        await expect("lifespan.shutdown.complete")
        await task
