"""Event-aligned resume on recorded provider streams: every event once, none torn.

An SSE client (``Accept: text/event-stream``, or a ``Last-Event-ID``) gets whole events
with ids; any other client gets the bytes from its offset as they are (tests/unit/
test_resume.py).

For every byte offset N of a recorded OpenAI and Anthropic stream, a client that parsed
bytes [0, N) with a WHATWG parser and then resumes, by its byte count or by the last event
id a resume stream gave it, holds exactly the original's events, in order, with their
event types, none twice, none torn. An EventSource that follows the spec's reconnect rules
stops once it has read a finished generation to its end (204).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, default_principal
from asgi_disconnect._log import Generation, Status
from asgi_disconnect.sse import SSEDecoder
from asgi_disconnect.testing import drive
from tests.apps import Probe, sse_app

pytestmark = pytest.mark.anyio

DATA = Path(__file__).parents[1] / "data"
ALICE = [("authorization", "Bearer alice")]
SSE = ("accept", "text/event-stream")
VECTORS = ["openai_chat_basic.sse", "anthropic_messages_basic.sse", "openai_chat_tool_call.sse"]


def events_of(body: bytes) -> list[tuple[str, str]]:
    return [(event.event, event.data) for event in SSEDecoder().feed(body)]


async def stored(body: bytes) -> tuple[DisconnectMiddleware, str]:
    backend = MemoryBackend()
    generation = Generation(
        "gen_" + "V" * 24,
        principal=default_principal({"headers": [(b"authorization", b"Bearer alice")]}),
        content_type="text/event-stream",
    )
    backend.register(generation)
    # In pieces, as a provider's chunks would arrive.
    for start in range(0, len(body), 97):
        generation.append(body[start : start + 97])
    generation.finish(Status.COMPLETE)
    return DisconnectMiddleware(sse_app(Probe()), backend=backend), generation.id


async def resume(
    mw: DisconnectMiddleware, generation_id: str, *, offset: int = 0, last_id: str | None = None
) -> tuple[int, bytes]:
    headers = [*ALICE, SSE]
    if last_id is not None:
        headers.append(("last-event-id", last_id))
    result = await drive(
        mw,
        path=f"/generations/{generation_id}/stream",
        query_string=f"offset={offset}".encode(),
        headers=headers,
    )
    assert result.status is not None
    return result.status, result.body


@pytest.mark.parametrize("name", VECTORS)
async def test_resuming_from_every_byte_count_gives_every_event_once(name: str) -> None:
    body = (DATA / name).read_bytes()
    original = events_of(body)
    assert len(original) > 3
    mw, generation_id = await stored(body)
    for n in range(len(body) + 1):
        client = SSEDecoder()
        held = [(event.event, event.data) for event in client.feed(body[:n])]
        status, rest = await resume(mw, generation_id, offset=n)
        if status == 204:
            assert held == original, n  # it had everything: nothing more to send
            continue
        assert status == 200
        # A reconnecting client starts a new parse: what it had pending is dropped.
        held += events_of(rest)
        assert held == original, n


@pytest.mark.parametrize("name", VECTORS)
async def test_resuming_from_every_last_event_id_gives_every_event_once(name: str) -> None:
    body = (DATA / name).read_bytes()
    original = events_of(body)
    mw, generation_id = await stored(body)
    status, framed = await resume(mw, generation_id)
    assert status == 200
    assert events_of(framed) == original
    for n in range(len(framed) + 1):
        client = SSEDecoder()
        held = [(event.event, event.data) for event in client.feed(framed[:n])]
        if not client.last_event_id:
            continue  # no id yet: it would resume by its byte count, as above
        status, rest = await resume(mw, generation_id, last_id=client.last_event_id)
        if status == 204:
            assert held == original, n
            continue
        assert status == 200
        held += events_of(rest)
        assert held == original, n


async def test_an_event_source_stops_after_the_end() -> None:
    """The spec's reconnect loop: open, read, reconnect with Last-Event-ID; a finished
    generation read to its end answers 204, and an EventSource stops there."""
    body = (DATA / "openai_chat_basic.sse").read_bytes()
    mw, generation_id = await stored(body)
    opened = 0
    held: list[tuple[str, str]] = []
    last_id: str | None = None
    while True:
        opened += 1
        assert opened < 5, "it keeps reconnecting"
        status, data = await resume(mw, generation_id, last_id=last_id)
        if status == 204:
            break
        client = SSEDecoder()
        held += [(event.event, event.data) for event in client.feed(data)]
        last_id = client.last_event_id or last_id
    assert opened == 2
    assert held == events_of(body)


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", " 1 2", "\u00b2"])
async def test_a_last_event_id_we_did_not_send_is_a_clear_400(value: str) -> None:
    body = (DATA / "openai_chat_basic.sse").read_bytes()
    mw, generation_id = await stored(body)
    result = await drive(
        mw,
        path=f"/generations/{generation_id}/stream",
        headers=[*ALICE, SSE, ("last-event-id", value)],
    )
    assert result.status == 400
    assert result.header("content-type") == "application/problem+json"
    assert b"urn:asgi-disconnect:problem:invalid-last-event-id" in result.body


async def test_a_client_that_is_not_an_sse_client_gets_the_bytes_as_they_are() -> None:
    body = (DATA / "anthropic_messages_basic.sse").read_bytes()
    mw, generation_id = await stored(body)
    result = await drive(
        mw,
        path=f"/generations/{generation_id}/stream",
        query_string=b"offset=7",
        headers=[*ALICE, ("accept", "*/*")],
    )
    assert result.status == 200
    assert result.body == body[7:]
    assert result.header("x-generation-offset") == "7"
