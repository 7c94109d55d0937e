"""A request the page's form makes of the gateway itself, through the whole stack, as the
page's script would: with the page's identity, and answered in full unless it streams."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.types import ASGIApp, Message, Scope

__all__ = ["Answered", "call"]

# What a request of the page's carries over: who the caller is.
_KEPT = (b"cookie", b"authorization", b"x-api-key")


@dataclass
class Answered:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


async def call(
    app: ASGIApp,
    scope: Scope,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    leave: bool | asyncio.Event = False,
    on_head: Callable[[Answered], object] | None = None,
) -> Answered:
    """``method path`` on ``app`` as the caller of ``scope``. ``leave``: a 200 response is
    left once its head arrived, as a client that goes away (under detach it runs on); an
    event: its body is read (and dropped) until the event is set, then left. ``on_head`` is
    called with the status and headers once they arrived."""
    headers = [(name, value) for name, value in scope["headers"] if name in _KEPT]
    headers.append((b"content-type", b"application/json"))
    inner: Scope = {
        "type": "http",
        "asgi": scope.get("asgi", {"version": "3.0"}),
        "http_version": scope.get("http_version", "1.1"),
        "method": method,
        "scheme": scope.get("scheme", "http"),
        "path": path,
        "raw_path": path.encode(),
        "root_path": scope.get("root_path", ""),
        "query_string": b"",
        "headers": headers,
        "client": scope.get("client"),
        "server": scope.get("server"),
        "state": dict(scope.get("state", {})),
    }
    answered = Answered()
    reading = isinstance(leave, asyncio.Event)
    over = leave if isinstance(leave, asyncio.Event) else asyncio.Event()
    requested = False

    async def receive() -> Message:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": body, "more_body": False}
        await over.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answered.status = message["status"]
            answered.headers = {
                name.decode("latin-1"): value.decode("latin-1")
                for name, value in message.get("headers", [])
            }
            if on_head is not None:
                on_head(answered)
            if leave is True and answered.status == 200:
                over.set()
        elif message["type"] == "http.response.body" and not over.is_set():
            if not (reading and answered.status == 200):
                answered.body += message.get("body", b"")
            if not message.get("more_body", False):
                over.set()

    await app(inner, receive, send)
    return answered
