"""A gateway replica for ``benchmarks.takeover`` and tests/integration/test_takeover.py,
served by uvicorn in a process of its own.

``POST /relay/{kind}`` relays the request body to the FakeProvider at
``ASGI_DISCONNECT_PROVIDER`` (the API path by kind) through ``open_stream`` with that
continuation kind, on a detaching route, with the whole stack (``install()``: metering,
idempotency, drain). Every replica registers its own client for the upstream ``"fake"``.
``ASGI_DISCONNECT_FALLBACK`` is the prefill fallback; ``ASGI_DISCONNECT_DRAIN`` (seconds)
is the shutdown deadline; ``ASGI_DISCONNECT_LEASE`` the lease (default 15 s), and
``ASGI_DISCONNECT_FAST=1`` shortens the store's intervals as the tests need. Every caller
is one principal (``ASGI_DISCONNECT_PRINCIPAL``), so a reader reads back what any
request started.
"""

from __future__ import annotations

import os

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import connect, disconnect_policy, install
from asgi_disconnect.upstream import UpstreamStatusError, open_stream

PATHS = {
    "responses": "/v1/responses",
    "continue_final_message": "/v1/chat/completions",
    "restart": "/v1/chat/completions",
    "prefill": "/v1/messages",
}

DRAIN = float(os.environ.get("ASGI_DISCONNECT_DRAIN", "30"))
client = httpx.AsyncClient(
    base_url=os.environ["ASGI_DISCONNECT_PROVIDER"],
    timeout=httpx.Timeout(None, connect=5.0),
    headers={"authorization": "Bearer replica-own-key", "anthropic-version": "2023-06-01"},
)


@disconnect_policy("detach")
async def relay(request: Request) -> Response:
    kind = request.path_params["kind"]
    if kind not in PATHS:
        return JSONResponse({"error": f"unknown kind {kind!r}"}, status_code=404)
    headers = {name: value for name, value in request.headers.items() if name.startswith("x-fake-")}
    headers["content-type"] = "application/json"
    upstream_request = client.build_request(
        "POST", PATHS[kind], content=await request.body(), headers=headers
    )
    try:
        stream = await open_stream(
            client,
            upstream_request,
            upstream="fake",
            continuation=kind,
            fallback=os.environ.get("ASGI_DISCONNECT_FALLBACK", "interrupted"),
        )
    except UpstreamStatusError as exc:
        return JSONResponse(exc.error, status_code=exc.status_code)
    return StreamingResponse(stream, media_type="text/event-stream")


FAST = {
    "flush_interval": 0.02,
    "sweep_interval": 0.2,
    "takeover_interval": 0.2,
    "poll_interval": 0.05,
}
# The defaults but the lease, which the benchmark may shorten, and the tests' intervals.
backend = connect(
    os.environ["ASGI_DISCONNECT_URL"],
    lease=float(os.environ.get("ASGI_DISCONNECT_LEASE", "15.0")),
    **(FAST if os.environ.get("ASGI_DISCONNECT_FAST") == "1" else {}),  # type: ignore[arg-type]
)
PRINCIPAL = os.environ.get("ASGI_DISCONNECT_PRINCIPAL", "bench")

app = Starlette(routes=[Route("/relay/{kind}", relay, methods=["POST"])])
install(
    app,
    backend=backend,
    principal=lambda scope: PRINCIPAL,
    upstreams={"fake": client},
    idempotency=True,
    drain={"deadline": DRAIN},
    shutdown_timeout=DRAIN,
)
