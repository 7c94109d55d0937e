"""The app the fault tests serve with uvicorn, in a process of their own, configured by
environment. Each handler appends a line to ``FAULTS_RUNS`` when it starts and when it
ends, so a test can count runs across processes, database outages and kills."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import connect, disconnect_policy, install

RUNS = os.environ["FAULTS_RUNS"]
SLEEP = float(os.environ.get("FAULTS_SLEEP", "1.5"))
# Keys named slow-... and mid-... sleep for as long as these say.
SLOW = float(os.environ.get("FAULTS_SLOW", str(SLEEP)))
MID = float(os.environ.get("FAULTS_MID", str(SLEEP)))


def note(event: str, key: str) -> None:
    # One short write in append mode: lines from several processes never interleave.
    with open(RUNS, "a") as runs:
        runs.write(f"{event} {key} {os.getpid()}\n")


async def charge(request: Request) -> JSONResponse:
    key = request.headers["idempotency-key"]
    body = await request.body()
    note("start", key)
    prefix = key.partition("-")[0]
    await asyncio.sleep(SLOW if prefix == "slow" else MID if prefix == "mid" else SLEEP)
    note("end", key)
    # A new charge id per run: a second run can never pass for a replay.
    return JSONResponse({"key": key, "charge": secrets.token_hex(12), "bytes": len(body)})


@disconnect_policy("detach")
async def report(request: Request) -> StreamingResponse:
    count = int(request.query_params.get("n", "100"))
    interval = float(request.query_params.get("interval", "0.02"))

    async def events() -> AsyncIterator[bytes]:
        for i in range(count):
            yield f"data: {i:05d}\n\n".encode()
            await asyncio.sleep(interval)

    return StreamingResponse(events(), media_type="text/event-stream")


async def chat(request: Request) -> StreamingResponse:
    """An OpenAI chat stream without usage (its client did not ask): cancelled when the
    client leaves, estimated from its text."""
    count = int(request.query_params.get("n", "100"))
    interval = float(request.query_params.get("interval", "0.01"))

    async def events() -> AsyncIterator[bytes]:
        for i in range(count):
            yield (
                b'data: {"object":"chat.completion.chunk","model":"fault-model",'
                b'"choices":[{"index":0,"delta":{"content":"tok%d "}}]}\n\n' % i
            )
            await asyncio.sleep(interval)

    return StreamingResponse(events(), media_type="text/event-stream")


app = Starlette(
    routes=[
        Route("/charge", charge, methods=["POST"]),
        Route("/report", report, methods=["POST"]),
        Route("/chat", chat, methods=["POST"]),
    ]
)
install(
    app,
    backend=connect(
        os.environ["FAULTS_PG_URL"],
        lease=float(os.environ.get("FAULTS_BACKEND_LEASE", "15")),
        sweep_interval=0.5,
        connect_timeout=2,
    ),
    idempotency={"lease": float(os.environ.get("FAULTS_CLAIM_LEASE", "30"))},
)
