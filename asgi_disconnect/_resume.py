"""The resume endpoints: a generation's status, and its bytes from an offset, live."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import time
from base64 import urlsafe_b64encode
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

import anyio
import msgspec

from ._contract import request_state
from ._frames import DRAINED, LINE_END, STOPPED, EventIds, error_frame, event_ends, is_event_stream
from ._problem import send_json, send_problem
from ._records import GenerationInfo, Status

if TYPE_CHECKING:
    from collections.abc import Callable

    from starlette.types import Message, Receive, Scope, Send

    from ._contract import GenerationLog

__all__ = ["ResumeEndpoints", "redact_tokens_in_access_logs"]

logger = logging.getLogger("asgi_disconnect")

# How long an offset past what another replica wrote may wait for the owner's next flush.
_OFFSET_WAIT = 5.0
# Further past than this, it cannot be bytes an owner has yet to flush (it flushes every
# ``flush_interval`` and again at once past ``flush_max_bytes``): out of range at once.
_MAX_AHEAD = 8 << 20
# Any offset with more digits is past anything produced; int() is never asked to parse it.
_DIGITS = 18
_BEYOND = 10**_DIGITS
_ID = re.compile(r"gen_[A-Za-z0-9_-]{24}")
_ACTIONS = ("stream", "cancel", "token")
# A resume token's life unless the middleware says otherwise.
TOKEN_TTL = 300.0
# How long a Stop waits for the generation to end before answering 202.
_STOP_WAIT = 2.0
_encode = msgspec.json.Encoder().encode
_ENDINGS = {
    Status.CANCELLED: ("cancelled", "The generation was cancelled after its client disconnected."),
    Status.INTERRUPTED: ("interrupted", "The generation was interrupted before it finished."),
}


def _info_json(info: GenerationInfo) -> bytes:
    if info.owner is not None:
        info = msgspec.structs.replace(info, owner=None)  # the store's token, not the API's
    return msgspec.json.encode(info)


async def _send_info(send: Send, status: int, info: GenerationInfo, *, head: bool = False) -> None:
    await send_json(send, status, _info_json(info), head=head)


class ResumeEndpoints:
    """``GET {prefix}/{id}``, ``GET {prefix}/{id}/stream?offset=N``,
    ``POST {prefix}/{id}/cancel`` and ``POST {prefix}/{id}/token``."""

    def __init__(
        self,
        backend: GenerationLog,
        principal: Callable[[Scope], str | None],
        *,
        secret: bytes | None = None,
        token_ttl: float = TOKEN_TTL,
    ) -> None:
        self.backend = backend
        self.principal = principal
        # Replicas that share a backend must share the secret for a token made on one to
        # open a stream on another; without one, tokens hold in this process only.
        self.secret = secret if secret is not None else secrets.token_bytes(32)
        self.token_ttl = token_ttl

    def token(self, generation_id: str, principal: str, now: float | None = None) -> str:
        """A token that reads ``generation_id`` as ``principal`` until ``token_ttl`` from
        now: ``{expiry}.{mac}``, the MAC over the id, the principal and the expiry."""
        expires = int((time.time() if now is None else now) + self.token_ttl)
        return f"{expires}.{self._mac(generation_id, principal, expires)}"

    def _mac(self, generation_id: str, principal: str, expires: int) -> str:
        message = f"{generation_id}\n{principal}\n{expires}".encode()
        digest = hmac.new(self.secret, message, hashlib.sha256).digest()
        return urlsafe_b64encode(digest).rstrip(b"=").decode()

    def _token_principal(self, scope: Scope, generation_id: str, owner: str | None) -> bool | None:
        """None without a ``token`` parameter; else whether it reads this generation as
        ``owner``, unexpired. A malformed token, or one for an unknown generation (``owner``
        None), is False: every token that does not verify gets one answer."""
        values = [
            value
            for name, value in parse_qsl(
                scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True
            )
            if name == "token"
        ]
        if not values:
            return None
        expires, dot, mac = values[-1].partition(".")
        if not dot or not expires.isascii() or not expires.isdigit() or len(expires) > 12:
            return False
        if owner is None or int(expires) < time.time():
            return False
        expected = self._mac(generation_id, owner, int(expires))
        # Bytes: compare_digest refuses a str that is not ASCII.
        return hmac.compare_digest(mac.encode("utf-8", "replace"), expected.encode())

    def handles(self, rest: str) -> bool:
        """Whether ``rest`` (the path after the prefix) names a resume endpoint; other paths
        under the prefix stay the app's."""
        if not rest.startswith("/"):
            return False
        generation_id, slash, action = rest[1:].partition("/")
        return (action in _ACTIONS or not slash) and _ID.fullmatch(generation_id) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send, rest: str) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._answer(scope, receive, tracked, rest)
        except Exception as exc:
            if started:
                raise  # a stream already under way: the server ends it
            logger.warning("the generation store failed a %s %s: %s", scope["method"], rest, exc)
            await send_problem(
                send,
                503,
                "generation-store-unavailable",
                "Service Unavailable",
                "The generation store cannot be reached; retry.",
                headers=[(b"retry-after", b"1")],
            )

    async def _answer(self, scope: Scope, receive: Receive, send: Send, rest: str) -> None:
        generation_id, _, action = rest[1:].partition("/")
        if action not in ("", *_ACTIONS) or not _ID.fullmatch(generation_id):
            await send_problem(send, 404, "not-found", "Not Found", "No such resource.")
            return
        allowed = ("POST",) if action in ("cancel", "token") else ("GET", "HEAD")
        if scope["method"] not in allowed:
            await send_problem(
                send,
                405,
                "method-not-allowed",
                "Method Not Allowed",
                f"{scope['method']} is not allowed here; use {allowed[0]}.",
                headers=[(b"allow", ", ".join(allowed).encode())],
            )
            return
        owner = await self.backend.principal_of(generation_id)
        flush_interval = self.backend.flush_interval
        if owner is None and flush_interval is not None:
            # Made a moment ago on another replica, it may not be stored yet: wait for the
            # owner's next flush before saying it does not exist.
            await asyncio.sleep(4 * flush_interval)
            owner = await self.backend.principal_of(generation_id)
        # Another caller's generation is indistinguishable from a missing one. A browser's
        # EventSource cannot send Authorization: a resume token stands for it, to read.
        granted = None
        if allowed[0] == "GET":
            granted = self._token_principal(scope, generation_id, owner)
        if granted is False:
            await send_problem(
                send,
                401,
                "invalid-resume-token",
                "Invalid Resume Token",
                "The resume token is malformed or expired, or was not made for this generation.",
            )
            return
        # An anonymous caller (no credential) owns nothing: only a token reads an anonymous
        # generation.
        caller = request_state(scope, self.principal).principal
        readable = owner is not None and (granted is True or (owner != "" and owner == caller))
        info = await self.backend.get(generation_id) if readable else None
        if info is None:
            await send_problem(
                send,
                404,
                "generation-not-found",
                "Generation Not Found",
                f"No generation {generation_id} is readable by this caller.",
            )
            return
        if action == "":
            await _send_info(send, 200, info, head=scope["method"] == "HEAD")
            return
        if action == "cancel":
            await self._cancel(send, info)
            return
        if action == "token":
            token = self.token(info.id, caller)
            await send_json(send, 200, _encode({"token": token, "expires_in": int(self.token_ttl)}))
            return
        await self._stream(scope, receive, send, info)

    async def _cancel(self, send: Send, info: GenerationInfo) -> None:
        """Stop: the owner stops a running generation wherever it runs. 200 with its status
        once it stopped (within ``_STOP_WAIT``), 202 if it has not yet, 409 if it had
        already ended."""
        if info.status is Status.RUNNING:
            requested = await self.backend.request_cancel(info.id)
            info = await self._until_ended(info, _STOP_WAIT)
            if requested:
                # Stopped (200), or asked of the replica that runs it, which has yet to act.
                await _send_info(send, 200 if info.status is not Status.RUNNING else 202, info)
                return
            if info.status is Status.RUNNING:
                await send_problem(
                    send,
                    503,
                    "stop-unavailable",
                    "Stop Unavailable",
                    f"Generation {info.id} runs where this request cannot reach; retry.",
                    headers=[(b"retry-after", b"1")],
                )
                return
        await send_problem(
            send,
            409,
            "generation-finished",
            "Generation Already Ended",
            f"Generation {info.id} is {info.status.value}; there is nothing to stop.",
        )

    async def _until_ended(self, info: GenerationInfo, patience: float) -> GenerationInfo:
        """The generation as it stands once it ended, or after ``patience`` seconds: its
        rest is followed as a resume reader follows it (woken by each change, where it runs
        here; by the store's shared wake-up, where it runs on another replica), so nothing
        polls. A store that cannot be followed is asked once more."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(patience):
                try:
                    async with contextlib.aclosing(self.backend.follow(info.id, info.size)) as rest:
                        async for _ in rest:
                            pass
                except Exception:
                    logger.debug("generation %s could not be followed to its end", info.id)
        latest = await self.backend.get(info.id)
        return info if latest is None else latest

    def _produced_here(self, generation_id: str) -> bool:
        """Whether this process produces the generation, so its live size is the truth."""
        return self.backend.produces(generation_id)

    async def _event_start(self, generation_id: str, offset: int) -> int:
        """Where the event that byte ``offset`` falls in starts: the end of the last event
        that ended by ``offset``, looked for backwards, 64 KiB at a time then more."""
        window = 64 << 10
        while offset > 0:
            start = max(0, offset - window)
            data = await self._read(generation_id, start, offset)
            skip = 0
            if start > 0:
                # Begin at a line start: past the window's first line end.
                first = LINE_END.search(data)
                skip = len(data) if first is None else first.end()
            ends = event_ends(data[skip:], start + skip)
            if ends:
                return ends[-1]
            if start == 0:
                return 0
            window *= 4
        return 0

    async def _read(self, generation_id: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the generation, all of which exist already."""
        parts: list[bytes] = []
        size = 0
        async with contextlib.aclosing(self.backend.follow(generation_id, start)) as chunks:
            async for data in chunks:
                parts.append(data)
                size += len(data)
                if size >= end - start:
                    break
        return b"".join(parts)[: end - start]

    async def _wait_for_size(
        self, info: GenerationInfo, offset: int, receive: Receive
    ) -> GenerationInfo | None:
        """The generation once the store holds ``offset`` bytes, once it ended, or after
        ``_OFFSET_WAIT``; None if the client left meanwhile."""
        left = False
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                nonlocal left
                while (await receive())["type"] != "http.disconnect":
                    pass
                left = True
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            info = await self.backend.wait_for_size(info, offset, _OFFSET_WAIT)
            tg.cancel_scope.cancel()
        return None if left else info

    async def _stream(
        self, scope: Scope, receive: Receive, send: Send, info: GenerationInfo
    ) -> None:
        # An SSE client (an EventSource, httpx-sse: Accept: text/event-stream) gets whole
        # events with ids; any other client the bytes from the offset, as they are.
        last_event_id = _header(scope, b"last-event-id")
        events = is_event_stream(info.content_type) and bool(
            last_event_id or "text/event-stream" in (_header(scope, b"accept") or "")
        )
        offset = await _asked_offset(scope, send, last_event_id if events else None)
        if offset is None:
            return
        if (
            offset > info.size
            and info.status is Status.RUNNING
            and offset - info.size <= _MAX_AHEAD
            and not self._produced_here(info.id)
        ):
            # The client may have read bytes from the owner that are not durable yet.
            waited = await self._wait_for_size(info, offset, receive)
            if waited is None:
                return
            info = waited
        if offset > info.size:
            shown = "offset" if offset >= _BEYOND else f"offset {offset}"
            await send_problem(
                send,
                416,
                "offset-out-of-range",
                "Offset Out Of Range",
                f"{shown} is past the {info.size} bytes produced so far.",
                headers=[(b"content-range", f"bytes */{info.size}".encode())],
            )
            return
        if events:
            # A client that read ``offset`` bytes holds the events that ended by then; the
            # one it is inside comes again, whole.
            offset = await self._event_start(info.id, offset)
            if offset >= info.size and info.status is not Status.RUNNING:
                # Read to its end: 204 tells an EventSource to stop reconnecting.
                await send({"type": "http.response.start", "status": 204, "headers": []})
                await send({"type": "http.response.body", "body": b""})
                return
        await send(_stream_start(info, offset))
        if scope["method"] == "HEAD":
            await send({"type": "http.response.body", "body": b""})
            return
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(watch_disconnect)
            framer = EventIds(offset) if events else None
            await self._relay(info, offset, framer, send)
            await send(
                {
                    "type": "http.response.body",
                    "body": await self._end(info, framer),
                    "more_body": False,
                }
            )
            tg.cancel_scope.cancel()

    async def _relay(
        self, info: GenerationInfo, offset: int, framer: EventIds | None, send: Send
    ) -> None:
        """The generation's bytes from ``offset`` (as whole events, with ``framer``), live
        until it ends."""
        # A client that left stops following now, not when the iterator is collected.
        async with contextlib.aclosing(self.backend.follow(info.id, offset)) as chunks:
            async for data in chunks:
                if framer is not None:
                    data = framer.feed(data)
                    if not data:
                        continue
                await send({"type": "http.response.body", "body": data, "more_body": True})

    async def _end(self, info: GenerationInfo, framer: EventIds | None) -> bytes:
        """What follows the generation's last bytes: the rest of the framer's last event,
        and an error frame if it did not complete (not for a Stop or a drain, which wrote
        their own)."""
        final = await self.backend.get(info.id)
        tail = framer.rest() if framer is not None else b""
        if (
            final is not None
            and final.status in _ENDINGS
            and final.error != STOPPED
            and final.error != DRAINED
            and is_event_stream(final.content_type)
        ):
            code, message = _ENDINGS[final.status]
            tail += error_frame(
                final.id, code, message, event_id=final.size if framer is not None else None
            )
        return tail


async def _asked_offset(scope: Scope, send: Send, last_event_id: str | None) -> int | None:
    """The offset the client asks for (``?offset=``, or an EventSource's Last-Event-ID: our
    ids are the byte offsets where events end); None once a 400 answered a bad one."""
    if last_event_id:
        offset = _parse_number(last_event_id)
        if offset is None:
            await send_problem(
                send,
                400,
                "invalid-last-event-id",
                "Invalid Last-Event-ID",
                "Last-Event-ID must be an id this endpoint sent: a number of bytes.",
            )
        return offset
    offset = _parse_offset(scope.get("query_string", b""))
    if offset is None:
        await send_problem(
            send,
            400,
            "invalid-offset",
            "Invalid Offset",
            "offset must be a non-negative integer number of bytes.",
        )
    return offset


def _stream_start(info: GenerationInfo, offset: int) -> Message:
    return {
        "type": "http.response.start",
        "status": 200,
        "headers": [
            (b"content-type", (info.content_type or "application/octet-stream").encode("latin-1")),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (b"x-generation-id", info.id.encode()),
            (b"x-generation-offset", str(offset).encode()),
        ],
    }


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _parse_number(value: str) -> int | None:
    """ASCII digits as a number of bytes (too many digits: _BEYOND); None otherwise."""
    if not value.isascii() or not value.isdigit():
        return None
    digits = value.lstrip("0")
    return _BEYOND if len(digits) > _DIGITS else int(digits or "0")


def _parse_offset(query_string: bytes) -> int | None:
    """The offset asked for: None if malformed; a number too big to be a size is _BEYOND."""
    try:
        pairs = parse_qsl(
            query_string.decode("latin-1"), keep_blank_values=True, strict_parsing=False
        )
    except ValueError:
        return None
    values = [value for name, value in pairs if name == "offset"]
    if not values:
        return 0
    if len(values) > 1:
        return None
    return _parse_number(values[0])


_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s\"]*")
# The access loggers of the servers the package is tested under.
ACCESS_LOGGERS = ("uvicorn.access", "hypercorn.access", "granian.access")


class RedactResumeTokens(logging.Filter):
    """Replaces the value of a ``token`` query parameter in access log lines with
    ``[redacted]``: a resume token in a log would read its generation until it expires."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(
            isinstance(arg, str) and "token=" in arg for arg in args
        ):
            record.args = tuple(
                _TOKEN_IN_QUERY.sub(r"\1[redacted]", arg) if isinstance(arg, str) else arg
                for arg in args
            )
        if isinstance(record.msg, str) and "token=" in record.msg:
            record.msg = _TOKEN_IN_QUERY.sub(r"\1[redacted]", record.msg)
        return True


def redact_tokens_in_access_logs() -> None:
    """Put ``RedactResumeTokens`` on the servers' access loggers, once."""
    for name in ACCESS_LOGGERS:
        target = logging.getLogger(name)
        if not any(isinstance(f, RedactResumeTokens) for f in target.filters):
            target.addFilter(RedactResumeTokens())
