"""Large bodies through ``install()`` (idempotency, drain) on uvicorn: an SSE event of 10 MB
(an image as base64) and a JSON body of 8 MB (an embeddings batch) are complete
generations with the provider's usage in their records, never failures, and an idempotent
retry replays them instead of running the upstream again; the client gets every byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import UsageRecord, connect, install
from asgi_disconnect.testing import run_server
from tests.apps import as_tester
from tests.unit.test_metering_bounds import big_event, json_body

pytestmark = [pytest.mark.anyio, pytest.mark.server]


def app(runs: list[str], records: list[UsageRecord], db: Path) -> Starlette:
    async def responses(request: Request) -> StreamingResponse:
        runs.append("responses")

        async def body() -> AsyncIterator[bytes]:
            for chunk in big_event(10 << 20):
                yield chunk
                await asyncio.sleep(0)

        return StreamingResponse(body(), media_type="text/event-stream")

    async def embeddings(request: Request) -> StreamingResponse:
        runs.append("embeddings")

        async def body() -> AsyncIterator[bytes]:
            for chunk in json_body(8 << 20):
                yield chunk

        return StreamingResponse(body(), media_type="application/json")

    application = Starlette(
        routes=[
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
        ]
    )
    install(
        application,
        backend=connect(f"sqlite:///{db}"),
        sinks=[records.append],
        idempotency={"max_stored": 64 << 20},
        drain={"signals": False, "drain_token": "op"},
        principal=as_tester,
    )
    return application


@pytest.mark.parametrize(
    ("path", "usage"), [("/v1/responses", (50, 1500)), ("/v1/embeddings", (4096, None))]
)
async def test_a_large_body_is_a_complete_generation_with_the_providers_usage(
    path: str, usage: tuple[int, int | None], tmp_path: Path
) -> None:
    runs: list[str] = []
    records: list[UsageRecord] = []
    with run_server(app(runs, records, tmp_path / "g.db"), server="uvicorn") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            headers = {"idempotency-key": f"big-{path}"}
            first = await client.post(path, headers=headers)
            assert first.status_code == 200
            generation = first.headers["x-generation-id"]
            status = (await client.get(f"/generations/{generation}")).json()
            assert status["status"] == "complete", status
            async with asyncio.timeout(10):
                while not records:
                    await asyncio.sleep(0.02)
            again = await client.post(path, headers=headers)
            assert again.headers.get("idempotent-replayed") == "true"
            assert again.content == first.content
    assert runs == [path.rsplit("/", 1)[1]]  # run once
    (record,) = records
    assert record.outcome == "complete"
    assert record.usage_source == "provider"
    assert (record.input_tokens, record.output_tokens) == usage
    assert record.produced_bytes == len(first.content)
