"""Session pins through the whole stack while PostgreSQL stops: a client that leaves
mid-answer retries on the same provider; while the database is down no request reaches any
provider (503, nothing spent twice); after the restart each session is still bound where it
was."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import BackendUnavailable, SessionPins, connect, install
from asgi_disconnect.testing import FakeProvider, request, run_server
from asgi_disconnect.upstream import open_stream
from tests.faults.cluster import Cluster

pytestmark = [pytest.mark.anyio, pytest.mark.server]

BODY = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def gateway(url: str, providers: dict[str, str], default: list[str]) -> Starlette:
    backend = connect(url)
    pins = SessionPins(backend)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None))

    async def chat(request: Request) -> Response:
        session = request.headers["x-session-id"]
        try:
            name = await pins.provider_for(session, default=default[0])
        except BackendUnavailable:
            return JSONResponse(
                {"type": "urn:example:pins-unavailable"},
                status_code=503,
                headers={"retry-after": "1"},
                media_type="application/problem+json",
            )
        outgoing = client.build_request(
            "POST", f"{providers[name]}/v1/chat/completions", json={**BODY, "user": session}
        )
        upstream = await open_stream(client, outgoing)
        return StreamingResponse(upstream, media_type="text/event-stream")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = Starlette(routes=[Route("/chat", chat, methods=["POST"])], lifespan=lifespan)
    install(app, backend=backend, idempotency=True, drain={"signals": False})
    return app


def sessions_of(provider: FakeProvider) -> list[Any]:
    return [call.body["user"] for call in provider.requests]


async def test_pins_hold_across_a_disconnect_and_a_database_restart(
    cluster: Cluster, fault_url: str
) -> None:
    default = ["a"]
    auth = {"authorization": "Bearer tenant"}
    with (
        FakeProvider(tokens=200, tokens_per_second=200) as a,
        FakeProvider(tokens=200, tokens_per_second=200) as b,
    ):
        app = gateway(fault_url, {"a": a.url, "b": b.url}, default)
        with run_server(app) as server:
            # Turn 1 of session s1: the client leaves mid-answer, then retries.
            cut = await request(
                f"{server.url}/chat",
                method="POST",
                headers={**auth, "x-session-id": "s1"},
                body=b"{}",
                disconnect_after_bytes=500,
            )
            assert not cut.body.endswith(b"[DONE]\n\n")
            default[0] = "b"  # a cutover while the client reconnects
            async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=auth) as client:
                retried = await client.post("/chat", content=b"{}", headers={"x-session-id": "s1"})
                assert retried.content.endswith(b"data: [DONE]\n\n")
                assert sessions_of(a) == ["s1", "s1"]
                assert sessions_of(b) == []
                cluster.stop()
                try:
                    down = [
                        await client.post("/chat", content=b"{}", headers={"x-session-id": s})
                        for s in ("s1", "s2")
                    ]
                finally:
                    cluster.start()
                assert [r.status_code for r in down] == [503, 503]
                assert all(r.headers["retry-after"] == "1" for r in down)
                assert len(a.requests) == 2
                assert b.requests == []
                await asyncio.sleep(0.2)
                again = await client.post("/chat", content=b"{}", headers={"x-session-id": "s1"})
                fresh = await client.post("/chat", content=b"{}", headers={"x-session-id": "s2"})
                assert again.status_code == fresh.status_code == 200
    assert sessions_of(a) == ["s1", "s1", "s1"]  # still bound where it was
    assert sessions_of(b) == ["s2"]  # a new session, after the cutover
