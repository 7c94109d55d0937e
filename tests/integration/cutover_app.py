"""A gateway that binds each session to a provider with SessionPins, served by several
uvicorn processes on one PostgreSQL (``CUTOVER_PG``). ``CUTOVER_PROVIDERS``:
``name=url,name=url``; the default provider is read from the file ``CUTOVER_DEFAULT`` at each
request, so a test flips it while the replicas run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import BackendUnavailable, SessionPins, connect, install
from asgi_disconnect.upstream import UpstreamStatusError, open_stream

PROVIDERS = dict(entry.split("=", 1) for entry in os.environ["CUTOVER_PROVIDERS"].split(","))
DEFAULT = Path(os.environ["CUTOVER_DEFAULT"])
backend = connect(os.environ["CUTOVER_PG"])
pins = SessionPins(backend, ttl=600)
client = httpx.AsyncClient(timeout=httpx.Timeout(None))


def current_default() -> str:
    return DEFAULT.read_text().strip()


async def chat(request: Request) -> Response:
    session = request.headers["x-session-id"]
    try:
        provider = await pins.provider_for(session, default=current_default())
    except BackendUnavailable:
        return JSONResponse({"error": "pins unavailable"}, status_code=503)
    body = await request.json()
    faults = {k: v for k, v in request.headers.items() if k.startswith("x-fake-")}
    outgoing = client.build_request(
        "POST", f"{PROVIDERS[provider]}/v1/chat/completions", json=body, headers=faults
    )
    try:
        upstream = await open_stream(client, outgoing)
    except UpstreamStatusError as exc:
        return JSONResponse(exc.error, status_code=exc.status_code)
    return StreamingResponse(
        upstream, media_type="text/event-stream", headers={"x-provider": provider}
    )


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    yield
    await client.aclose()


app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan)
install(app, backend=backend)
