"""What of a generation reached its caller across all the requests that read it.

A usage record's ``delivered_*`` is the request that started the generation: a page that
reloads reads the rest through other requests (``/generations/{id}/stream``, the page's own
server-rendered view). The demo counts those too: the furthest offset of the generation's
log that any of them handed over, and the share of the answer's text that lies before it.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from ..metering import StreamMeter
from ..sse import SSEDecoder

if TYPE_CHECKING:
    from collections.abc import AsyncIterable, AsyncIterator

    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from .. import UsageRecord

__all__ = ["Delivery", "DeliveryMiddleware"]


class _Reach:
    __slots__ = ("meter", "offset", "prompt", "route")

    def __init__(self, prompt: str, route: str) -> None:
        # What was asked, and of which route, for the page that shows it again.
        self.prompt = prompt
        self.route = route
        self.meter = StreamMeter(marks=True)  # the answer's text along the log
        self.offset = 0  # the furthest offset handed to a reader


class Delivery:
    """Per generation (the newest ``limit``): its produced text, and how far it was read."""

    def __init__(self, limit: int = 1000) -> None:
        self._limit = limit
        self._reach: OrderedDict[str, _Reach] = OrderedDict()

    def _entry(self, generation_id: str, prompt: str = "", route: str = "") -> _Reach:
        entry = self._reach.get(generation_id)
        if entry is None:
            entry = self._reach[generation_id] = _Reach(prompt, route)
            while len(self._reach) > self._limit:
                self._reach.popitem(last=False)
        return entry

    async def produced(
        self, generation_id: str, stream: AsyncIterable[bytes], *, prompt: str, route: str
    ) -> AsyncIterator[bytes]:
        """``stream``, unchanged, its bytes read on the way as the generation's log."""
        meter = self._entry(generation_id, prompt, route).meter
        async for chunk in stream:
            meter.feed(chunk)
            yield chunk

    def asked(self, generation_id: str) -> tuple[str, str] | None:
        """The prompt and the route of the generation, if it is one of the newest."""
        entry = self._reach.get(generation_id)
        return (entry.prompt, entry.route) if entry is not None else None

    def reached(self, generation_id: str, offset: int) -> None:
        """A request handed the generation's log up to ``offset`` to its reader."""
        entry = self._entry(generation_id)
        entry.offset = max(entry.offset, offset)

    def of(self, record: UsageRecord) -> tuple[int, int | None]:
        """The bytes and output tokens that reached the record's caller, over all its
        requests: the record's own figures when no later request read further."""
        entry = self._reach.get(record.generation_id or "")
        reached = entry.offset if entry is not None else 0
        if reached <= record.delivered_bytes or record.output_tokens is None:
            return record.delivered_bytes, record.delivered_output_tokens
        if reached >= record.produced_bytes:
            return record.produced_bytes, record.output_tokens
        assert entry is not None
        text = entry.meter.text_chars
        share = (
            entry.meter.text_chars_within(reached) / text
            if text
            else reached / record.produced_bytes
        )
        return reached, min(record.output_tokens, round(record.output_tokens * share))


_STREAM = re.compile(r"/(gen_[A-Za-z0-9_-]+)/stream")


class DeliveryMiddleware:
    """Counts what the resume endpoint (``{prefix}/{id}/stream``) hands to its readers."""

    def __init__(self, app: ASGIApp, *, delivery: Delivery, prefix: str = "/generations") -> None:
        self.app = app
        self.delivery = delivery
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        match = (
            _STREAM.fullmatch(path[len(self.prefix) :]) if path.startswith(self.prefix) else None
        )
        if match is None or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        events = b"last-event-id" in headers or b"text/event-stream" in headers.get(b"accept", b"")
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        read = _ReadOf(self.delivery, match.group(1), events, query.get("offset", "0"))

        async def counted(message: Message) -> None:
            await send(message)
            read.handed(message)

        await self.app(scope, receive, counted)


class _ReadOf:
    """One resume stream: as whole events, each with ``id:`` the offset where it ends, or
    the log's bytes from ``?offset=``."""

    __slots__ = ("decoder", "delivery", "generation_id", "offset", "serving")

    def __init__(self, delivery: Delivery, generation_id: str, events: bool, offset: str) -> None:
        self.delivery = delivery
        self.generation_id = generation_id
        self.decoder = SSEDecoder() if events else None
        self.offset = int(offset) if offset.isdigit() and len(offset) < 19 else 0
        self.serving = False

    def handed(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.serving = message["status"] == 200
            return
        if message["type"] != "http.response.body" or not self.serving:
            return
        body = message.get("body", b"")
        if self.decoder is None:
            self.offset += len(body)
            self.delivery.reached(self.generation_id, self.offset)
            return
        for event in self.decoder.feed(body):
            if event.id is not None and event.id.isdigit():
                self.delivery.reached(self.generation_id, int(event.id))
