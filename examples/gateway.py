# gateway.py
import os

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from asgi_disconnect import UsageRecord, connect, disconnect_policy, install
from asgi_disconnect.upstream import (
    UpstreamStatusError,
    open_stream,
    track_response,
)

UPSTREAM = os.environ.get("UPSTREAM_URL", "https://api.openai.com")
# What the provider needs from the caller: the key, the body's type, the account headers.
FORWARDED = ("authorization", "content-type", "openai-organization", "openai-project")

client = httpx.AsyncClient(
    base_url=UPSTREAM,
    # Connect and send are bounded; a read may wait as long as a stream needs:
    # open_stream's timeouts below tell a slow stream from a dead one.
    timeout=httpx.Timeout(connect=10.0, read=None, write=30.0, pool=10.0),
    # Each stream holds its upstream connection until it ends; httpx's default pool of 100
    # would keep the 101st waiting for one. Room for 1,000 at once, 100 kept open when idle.
    limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
    # Ties each upstream response to its request, so a cancel always closes it.
    event_hooks={"response": [track_response]},
)
app = FastAPI()


async def relay(request: Request) -> Response:
    headers = {k: v for k, v in request.headers.items() if k in FORWARDED}
    outgoing = client.build_request(
        "POST", "/v1/chat/completions", content=await request.body(), headers=headers
    )
    # 30 s to the first event, 60 s of silence between events; the provider's own usage
    # counts asked for, though the caller gets exactly the bytes it asked for.
    try:
        upstream = await open_stream(
            client, outgoing, first_token_timeout=30, idle_timeout=60, ask_for_usage=True
        )
    except UpstreamStatusError as exc:  # the provider's own 400, 401, 429, 500: passed on
        retry = {"retry-after": exc.retry_after} if exc.retry_after else None
        return JSONResponse(exc.error, status_code=exc.status_code, headers=retry)
    # Unreachable or silent: the stack answers 502/504 (problem+json) and logs one line.
    return StreamingResponse(upstream, media_type="text/event-stream")


@app.post("/v1/chat/completions")
@disconnect_policy("cancel")  # the default: stop paying when nobody reads
async def chat(request: Request) -> Response:
    return await relay(request)


@app.post("/v1/reports")
@disconnect_policy("detach")  # finish it; the client resumes by id
async def report(request: Request) -> Response:
    return await relay(request)


def bill(record: UsageRecord) -> None:
    """One record per request, whatever the client did; write it to your ledger."""
    print(
        f"{record.generation_id} {record.outcome}: {record.input_tokens} in, "
        f"{record.output_tokens} out ({record.usage_source}), "
        f"{record.delivered_output_tokens} delivered"
    )


install(app, backend=connect("sqlite:///generations.db"), sinks=[bill], idempotency=True)
