"""A request's objects are freed by reference counting when it ends: none waits for the
cyclic garbage collector, which a busy server runs late (its oldest generation rarely), so
cycles hold a burst's memory long after it (the soak saw 200,000 blocks so held)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import time
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import UsageRecord, install
from asgi_disconnect.testing import FakeProvider, drive, lifespan, run_server
from asgi_disconnect.upstream import open_stream, track_response
from benchmarks.retained import chat, report

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("path", ["/chat", "/report"])
@pytest.mark.parametrize("leave", [None, 300], ids=["read", "leave"])
async def test_a_request_leaves_no_cycle_of_the_packages_objects(
    path: str, leave: int | None, tmp_path: Path
) -> None:
    app = Starlette(
        routes=[Route("/chat", chat, methods=["POST"]), Route("/report", report, methods=["POST"])]
    )
    install(
        app, backend=f"sqlite:///{tmp_path / 'g.db'}", sinks=[lambda record: None], idempotency=True
    )
    async with lifespan(app):
        for i in range(3):  # warm: routes learned, statements prepared
            await drive(
                app, method="POST", path=path, body=b"{}",
                headers=[("authorization", "Bearer a"), ("idempotency-key", f"w{i}")],
            )  # fmt: skip
        await asyncio.sleep(0.3)
        with _cycles() as ours:
            for i in range(5):
                await drive(
                    app, method="POST", path=path, body=b"{}", disconnect_after_bytes=leave,
                    headers=[("authorization", "Bearer a"), ("idempotency-key", f"k{i}")],
                )  # fmt: skip
            await asyncio.sleep(0.3)  # detached work ends, its record and claim settle
    assert ours == []


@contextlib.contextmanager
def _cycles() -> Iterator[list[str]]:
    """With the cyclic collector off, run the block; then what of the package it left on
    reference cycles (``_in_cycles``)."""
    gc.collect()
    gc.disable()
    found: list[str] = []
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found.extend(_in_cycles(gc.garbage))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def _ours(o: object) -> bool:
    if isinstance(o, types.FrameType):
        return "/asgi_disconnect/" in o.f_code.co_filename
    return type(o).__module__.startswith("asgi_disconnect")


def _in_cycles(garbage: list[object]) -> list[str]:
    """The package's objects, and frames of its code, that are on a reference cycle: not
    those a cycle of another library's holds (anyio's task group keeps a cancelled task's
    exception in the frame its traceback holds), which it is for that library to break."""
    inside = {id(o) for o in garbage}

    def on_a_cycle(start: object) -> bool:
        seen = {id(start)}
        todo = [start]
        while todo:
            for referent in gc.get_referents(todo.pop()):
                if referent is start:
                    return True
                if id(referent) in inside and id(referent) not in seen:
                    seen.add(id(referent))
                    todo.append(referent)
        return False

    return sorted(
        {
            f"frame {o.f_code.co_name}"
            if isinstance(o, types.FrameType)
            else f"{type(o).__module__}.{type(o).__qualname__}"
            for o in garbage
            if _ours(o) and on_a_cycle(o)
        }
    )


def _relay_app(upstream: str, records: list[UsageRecord], db: Path) -> Starlette:
    """The quickstart's relay: an httpx client, open_stream, a StreamingResponse."""
    clients: list[httpx.AsyncClient] = []

    @contextlib.asynccontextmanager
    async def lifespan_of(app: Starlette) -> AsyncIterator[None]:
        async with httpx.AsyncClient(
            base_url=upstream, event_hooks={"response": [track_response]}
        ) as client:
            clients.append(client)
            yield

    async def chat(request: Request) -> StreamingResponse:
        client = clients[0]
        outgoing = client.build_request(
            "POST", "/v1/chat/completions", content=await request.body(),
            headers={"content-type": "application/json", "x-fake-rate": "100"},
        )  # fmt: skip
        return StreamingResponse(
            await open_stream(client, outgoing), media_type="text/event-stream"
        )

    app = Starlette(routes=[Route("/chat", chat, methods=["POST"])], lifespan=lifespan_of)
    install(app, backend=f"sqlite:///{db}", sinks=[records.append], idempotency=True)
    return app


def _ask(port: int, key: str, *, leave_after: int | None) -> None:
    """POST /chat on a socket of its own; read to the end, or leave after some bytes."""
    body = b'{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}'
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /chat HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer a\r\nidempotency-key: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (key.encode(), len(body), body)
        )
        got = b""
        while b"0\r\n\r\n" not in got:
            data = sock.recv(65536)
            if not data:
                break
            got += data
            if leave_after is not None and len(got) > leave_after:
                break


@pytest.mark.parametrize("leave", [None, 600], ids=["read", "leave"])
def test_a_relayed_stream_under_a_real_server_leaves_no_cycle_of_the_packages_objects(
    leave: int | None, tmp_path: Path
) -> None:
    """Through httpx and open_stream under uvicorn, read whole or left half way (the app
    cancelled): no object of the package and no frame of its code waits for the cyclic
    collector. (The request's state and metering's stream ending held each other; a
    cancelled app's exception, kept by metering and by the inline exchange, held its
    traceback's frames, which held them.)"""
    records: list[UsageRecord] = []
    with FakeProvider(tokens=100, tokens_per_second=100) as provider:
        app = _relay_app(provider.url, records, tmp_path / "g.db")
        with run_server(app, server="uvicorn") as server:
            for i in range(3):  # warm: the route is learned (cancel-only: inline)
                _ask(server.port, f"w{i}", leave_after=None)
            time.sleep(0.5)
            with _cycles() as ours:
                for i in range(5):
                    _ask(server.port, f"k{i}", leave_after=leave)
                time.sleep(1.0)  # each request ends, its record is made
    assert ours == []
    ended = [r.outcome for r in records[3:]]
    assert ended == ["complete" if leave is None else "cancelled"] * 5, ended
