"""The resume endpoints under arbitrary paths, methods, callers and query strings.

``DisconnectMiddleware`` with a ``MemoryBackend``, driven in-process, with two finished
generations (Alice's plain-text one, Bob's SSE one). Every request under ``/generations``
either goes to the app or gets one of the documented answers (docs/resume.md, "The
endpoints"): 200, or a refusal in ``application/problem+json`` with its stable ``type``:
400 ``invalid-offset``, 404 ``generation-not-found`` (or ``not-found``), 405
``method-not-allowed``, 416 ``offset-out-of-range``. Nothing raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, disconnect_policy
from asgi_disconnect.testing import DriveResult, drive
from tests.fuzz._settings import fuzz

ALICE = [("authorization", "Bearer alice")]
BOB = [("authorization", "Bearer bob")]
PROBLEM = "urn:asgi-disconnect:problem:"
REFUSALS = {
    400: {PROBLEM + "invalid-offset"},
    404: {PROBLEM + "generation-not-found", PROBLEM + "not-found"},
    405: {PROBLEM + "method-not-allowed"},
    416: {PROBLEM + "offset-out-of-range"},
}
ID_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"


def app() -> Starlette:
    async def text() -> AsyncIterator[bytes]:
        for i in range(20):
            yield f"line {i:04d} of the report\n".encode()

    async def events() -> AsyncIterator[bytes]:
        for i in range(10):
            yield f"data: {i}\n\n".encode()

    @disconnect_policy("cancel")  # a plain-text generation, by its route's choice
    async def report(request: Request) -> StreamingResponse:
        return StreamingResponse(text(), media_type="text/plain")

    async def chat(request: Request) -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    async def anything(request: Request) -> PlainTextResponse:
        return PlainTextResponse("the app's")

    methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"]
    return Starlette(
        routes=[
            Route("/report", report),
            Route("/chat", chat),
            Route("/{rest:path}", anything, methods=methods),
        ]
    )


def marked(inner: ASGIApp) -> ASGIApp:
    """Every response of the app, its router's own 404s and 405s included, says it is the app's."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async def mark(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-app", b"yes")]}
            await send(message)

        await inner(scope, receive, mark)

    return app


@dataclass
class World:
    middleware: DisconnectMiddleware
    alice_id: str
    alice_body: bytes
    bob_id: str


async def make_world() -> World:
    middleware = DisconnectMiddleware(marked(app()), backend=MemoryBackend())
    report = await drive(middleware, path="/report", headers=ALICE)
    chat = await drive(middleware, path="/chat", headers=BOB)
    alice_id, bob_id = report.header("x-generation-id"), chat.header("x-generation-id")
    assert alice_id is not None
    assert bob_id is not None
    return World(middleware, alice_id, report.body, bob_id)


def check(result: DriveResult, method: str) -> None:
    """The answer is the app's or a documented one; refusals are problem+json."""
    assert result.complete
    if result.header("x-app") == "yes":
        return
    assert result.status is not None
    if result.status == 200:
        if method == "HEAD":
            assert result.body == b""
        return
    assert result.status in REFUSALS, (result.status, result.body)
    assert result.header("content-type") == "application/problem+json"
    problem = msgspec.json.decode(result.body)
    assert problem["status"] == result.status
    assert problem["type"] in REFUSALS[result.status]
    if result.status == 405:
        assert result.header("allow") == "GET, HEAD"
    if result.status == 416:
        assert (result.header("content-range") or "").startswith("bytes */")


def offsets() -> st.SearchStrategy[str]:
    digits = st.integers(min_value=0, max_value=10**30).map(str)
    return st.one_of(
        digits,
        st.tuples(st.text("0", max_size=25), digits).map("".join),
        st.integers(min_value=-(10**6), max_value=-1).map(str),
        st.text(st.characters(categories=["Nd"]), min_size=1, max_size=4),  # non-ASCII digits
        st.sampled_from(["", " 1", "1 ", "+1", "1e3", "0x10", "1.0", "%31", "%EF%BC%91", "∞"]),
        st.text(max_size=12),
    )


def queries() -> st.SearchStrategy[bytes]:
    pair = st.one_of(
        offsets().map(lambda value: "offset=" + value),
        st.sampled_from(["offset", "Offset=1", "offset=1=2", "x=1", "", "&&", "offset%3D5"]),
        st.text(max_size=12),
    )
    as_text = st.lists(pair, max_size=4).map("&".join).map(lambda q: q.encode("utf-8"))
    return st.one_of(as_text, st.binary(max_size=40))


@st.composite
def paths(draw: st.DrawFn) -> str:
    tail = draw(
        st.one_of(
            st.sampled_from(["", "/stream", "/stream/", "/", "/other", "/stream/x", "//stream"]),
            st.text(max_size=20),
        )
    )
    head = draw(
        st.one_of(
            st.just("<alice>"),
            st.just("<bob>"),
            st.text(ID_CHARS, min_size=24, max_size=24).map(lambda s: "gen_" + s),
            st.text(max_size=40),
        )
    )
    return "/generations/" + head + tail


@fuzz(300)
@given(
    path=paths(),
    query=queries(),
    method=st.sampled_from(["GET", "GET", "GET", "HEAD", "POST", "DELETE", "PUT", "BREW"]),
    caller=st.sampled_from([ALICE, ALICE, BOB, []]),
)
def test_any_request_under_the_prefix_gets_a_documented_answer(
    path: str, query: bytes, method: str, caller: list[tuple[str, str]]
) -> None:
    async def scenario() -> None:
        world = await make_world()
        target = path.replace("<alice>", world.alice_id).replace("<bob>", world.bob_id)
        result = await drive(
            world.middleware, method=method, path=target, query_string=query, headers=caller
        )
        check(result, method)

    asyncio.run(scenario())


@fuzz(200)
@given(query=queries(), method=st.sampled_from(["GET", "HEAD"]))
def test_the_owner_reading_a_finished_stream_gets_bytes_or_a_clear_refusal(
    query: bytes, method: str
) -> None:
    async def scenario() -> None:
        world = await make_world()
        path = f"/generations/{world.alice_id}/stream"
        result = await drive(
            world.middleware, method=method, path=path, query_string=query, headers=ALICE
        )
        check(result, method)
        assert result.status in (200, 400, 416)
        if result.status == 200 and method == "GET":
            offset = int(result.header("x-generation-offset") or "-1")
            assert result.body == world.alice_body[offset:]

    asyncio.run(scenario())


@example(zeros=19, value=0)
@fuzz(100)
@given(zeros=st.integers(min_value=0, max_value=30), value=st.integers(min_value=0, max_value=1000))
def test_an_offset_is_read_by_its_value_whatever_its_leading_zeros(zeros: int, value: int) -> None:
    async def scenario() -> None:
        world = await make_world()
        result = await drive(
            world.middleware,
            path=f"/generations/{world.alice_id}/stream",
            query_string=f"offset={'0' * zeros}{value}".encode(),
            headers=ALICE,
        )
        if value <= len(world.alice_body):
            assert result.status == 200
            assert result.body == world.alice_body[value:]
        else:
            assert result.status == 416

    asyncio.run(scenario())
