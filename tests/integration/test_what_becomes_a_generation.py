"""Only LLM exchanges become generations: ``install()`` (idempotency, drain) added to an
existing FastAPI app, on uvicorn. Its docs, OpenAPI schema, health check, pages and 404s are
stored nowhere and carry no ``x-generation-id``; an event stream, an LLM API's JSON, a
provider's refusal passed on and a route that chose a policy are generations. Work that is
not a generation is still cancelled when its client leaves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse

from asgi_disconnect import UsageRecord, connect, disconnect_policy, install
from asgi_disconnect.testing import request, run_server
from tests.apps import as_tester

pytestmark = [pytest.mark.anyio, pytest.mark.server]

COMPLETION = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "fake-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def existing_app(cancelled: asyncio.Event) -> FastAPI:
    app = FastAPI()

    @app.get("/healthz")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> str:
        return "<h1>hello</h1>"

    @app.get("/slow-page", response_class=PlainTextResponse)
    async def slow_page() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "late"

    @app.post("/v1/chat/completions")
    async def completion() -> JSONResponse:
        return JSONResponse(COMPLETION)

    @app.get("/stats")
    async def stats() -> dict[str, object]:
        return {"n": 3, "usage": "not an llm"}

    @app.get("/quota")
    async def quota() -> dict[str, object]:
        return {"plan": "free", "usage": {"requests": 10, "limit": 100}}

    @app.post("/v1/embed")
    async def embed() -> dict[str, object]:  # no "object", no "choices": its usage says it
        return {"data": [[0.1, 0.2]], "usage": {"prompt_tokens": 2, "total_tokens": 2}}

    @app.post("/v1/limited")
    async def limited() -> JSONResponse:
        return JSONResponse({"error": {"type": "rate_limit", "message": "later"}}, status_code=429)

    @app.post("/v1/stream")
    async def stream() -> StreamingResponse:
        async def events():  # type: ignore[no-untyped-def]
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/export", response_class=PlainTextResponse)
    @disconnect_policy("detach")
    async def export() -> str:
        return "rows"

    return app


async def test_only_llm_exchanges_become_generations(tmp_path: Path) -> None:
    cancelled = asyncio.Event()
    app = existing_app(cancelled)
    db = f"sqlite:///{tmp_path / 'g.db'}"
    records: list[UsageRecord] = []
    install(
        app,
        backend=connect(db),
        sinks=[records.append],
        idempotency=True,
        drain={"signals": False, "drain_token": "op"},
        principal=as_tester,
    )
    with run_server(app, server="uvicorn") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            plain = {
                path: await client.get(path)
                # /stats, /quota: an app's own JSON with a "usage" that is no token counts.
                for path in (
                    "/docs",
                    "/openapi.json",
                    "/healthz",
                    "/",
                    "/nowhere",
                    "/stats",
                    "/quota",
                )
            }
            llm = {
                "/v1/chat/completions": await client.post("/v1/chat/completions"),
                "/v1/embed": await client.post("/v1/embed"),
                "/v1/limited": await client.post("/v1/limited"),
                "/v1/stream": await client.post("/v1/stream"),
                "/export": await client.get("/export"),
            }
        # A page whose client leaves is still cancelled, though it is no generation.
        left = await request(f"{server.url}/slow-page", disconnect_after_seconds=0.3)
        assert left.stopped_by == "disconnect_after_seconds"
        async with asyncio.timeout(5):
            await cancelled.wait()
    for path, response in plain.items():
        assert "x-generation-id" not in response.headers, path
    assert plain["/openapi.json"].status_code == 200
    assert plain["/nowhere"].status_code == 404
    for path, response in llm.items():
        assert response.headers.get("x-generation-id", "").startswith("gen_"), path
    backend = connect(db)
    await backend.open()
    try:
        stored = {info.id for info in await backend.recent(limit=100)}  # type: ignore[attr-defined]
    finally:
        await backend.aclose()
    generations = {response.headers["x-generation-id"] for response in llm.values()}
    assert stored == generations
    # A usage sink is handed no record of what answered and was no LLM exchange; one of each
    # LLM exchange (the export chose a policy, and is no LLM call: it has none).
    assert not [record for record in records if record.route in plain]
    metered = sorted(record.route for record in records if record.route in llm)
    assert metered == sorted(path for path in llm if path != "/export")
