"""A small LLM gateway to curl, disconnect from, and resume.

Two routes forward to an upstream that streams OpenAI-style SSE (FakeProvider, started
in-process unless UPSTREAM_URL is set):

- ``POST /v1/chat/completions``  policy ``cancel``: hang up and the upstream stops;
- ``POST /v1/reports``           policy ``detach``: hang up and it keeps going, then
  resume with ``GET /generations/{id}/stream?offset=N``.

``GET /demo/upstream`` shows what the upstream generated for each call, and whether its
connection was closed early; ``GET /demo/usage`` shows the usage record of each request.
Run: ``python examples/gateway.py`` (port 8000).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from asgi_disconnect import UsageRecord, connect, disconnect_policy, install
from asgi_disconnect.testing import FakeProvider
from asgi_disconnect.upstream import track_response

TOKENS = int(os.environ.get("DEMO_TOKENS", "200"))
RATE = float(os.environ.get("DEMO_TOKENS_PER_SECOND", "20"))

provider: FakeProvider | None = None
client: httpx.AsyncClient
usage: deque[UsageRecord] = deque(maxlen=50)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    global provider, client
    upstream = os.environ.get("UPSTREAM_URL")
    if upstream is None:
        provider = FakeProvider(tokens=TOKENS, tokens_per_second=RATE).start()
        upstream = provider.url
    # The hook ties each upstream response to its request, so a cancel always closes it.
    client = httpx.AsyncClient(
        base_url=upstream, timeout=60, event_hooks={"response": [track_response]}
    )
    try:
        yield
    finally:
        await client.aclose()
        if provider is not None:
            provider.stop()


app = FastAPI(title="asgi-disconnect demo gateway", lifespan=lifespan)


async def forward(body: bytes) -> AsyncIterator[bytes]:
    async with client.stream(
        "POST", "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    ) as upstream:
        async for chunk in upstream.aiter_raw():
            yield chunk


def _body(raw: bytes) -> bytes:
    return (
        raw
        or b'{"model":"fake-model","stream":true,"stream_options":{"include_usage":true},'
        b'"messages":[{"role":"user","content":"hello"}]}'
    )


@app.post("/v1/chat/completions")
@disconnect_policy("cancel")
async def chat(request: Request) -> StreamingResponse:
    return StreamingResponse(forward(_body(await request.body())), media_type="text/event-stream")


@app.post("/v1/reports")
@disconnect_policy("detach")
async def report(request: Request) -> StreamingResponse:
    return StreamingResponse(forward(_body(await request.body())), media_type="text/event-stream")


@app.get("/demo/usage")
async def usage_records() -> list[dict[str, object]]:
    fields = (
        "generation_id",
        "route",
        "outcome",
        "policy",
        "usage_source",
        "output_tokens",
        "delivered_output_tokens",
        "produced_bytes",
        "delivered_bytes",
    )
    return [{name: getattr(r, name) for name in fields} for r in reversed(usage)]


@app.get("/demo/upstream")
async def upstream_calls() -> list[dict[str, object]]:
    if provider is None:
        return []
    return [
        {
            "id": r.id,
            "tokens_planned": r.tokens_planned,
            "tokens_sent": r.tokens_sent,
            "finished": r.finished,
            "connection_closed_early": r.connection_closed_early,
        }
        for r in provider.requests
    ]


# The embedded default: durable, and shared by several worker processes on this machine.
install(
    app,
    backend=connect(os.environ.get("ASGI_DISCONNECT_BACKEND", "sqlite:///demo-generations.db")),
    sinks=[usage.append],
)


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        app, host=os.environ.get("HOST", "127.0.0.1"), port=int(os.environ.get("PORT", "8000"))
    )
