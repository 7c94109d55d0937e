"""The demo gateway: a FastAPI app on the whole stack, in front of an OpenAI- or
Anthropic-compatible upstream (FakeProvider by default).

Routes:

- ``POST /v1/chat/completions`` (OpenAI-compatible) and ``POST /v1/messages``
  (Anthropic-compatible): policy ``cancel``, streamed or not, as the request asks;
- ``POST /v1/reports``: long-form, OpenAI-compatible, policy ``detach``;
- ``/generations/...``: status, resume, Stop (the stack's own);
- ``GET /``: the web page; ``POST /ask``: its form, answered as server-rendered HTML;
- ``GET /demo/usage/{id}``: a request's usage record once it is settled (404 before, and
  for another caller's); ``GET /demo/stats``: the live panel's figures;
- ``GET /readyz``, ``POST /drainz``: readiness and drain (with the drain token).

Who a caller is: its credential headers (the package's default), else the page's session
cookie, which ``GET /`` sets; a request with neither is anonymous and reads nothing back.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import json
import secrets
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Form, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from .. import (
    DisconnectMiddleware,
    DrainMiddleware,
    UsageRecord,
    connect,
    default_principal,
    disconnect_policy,
    install,
    metered,
)
from ..sse import SSEDecoder
from ..upstream import UpstreamStatusError, UpstreamStreamError, open_stream
from ._page import page, page_parts

if TYPE_CHECKING:
    from starlette.types import Scope

__all__ = ["make_app"]

# Headers a provider needs that the client sends (auth, API version, content type).
_FORWARDED = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta", "content-type")
_DEFAULT_PROMPT = "Write a short report on why streamed answers should survive a disconnect."
SESSION_COOKIE = "asgi_demo_session"


def _session(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"cookie":
            text: str = value.decode("latin-1")
            for part in text.split(";"):
                key, _, cookie = part.strip().partition("=")
                if key == SESSION_COOKIE and cookie:
                    return cookie
    return None


def demo_principal(scope: Scope) -> str:
    """The caller's credentials (as the package's default), else the page's session."""
    principal = default_principal(scope)
    if principal:
        return principal
    session = _session(scope)
    if session is None:
        return ""
    return "page:" + hashlib.sha256(session.encode()).hexdigest()[:32]


def make_app(
    *,
    upstream: str,
    backend_url: str = "sqlite:///demo-generations.db",
    api_key: str | None = None,
    model: str = "fake-model",
    first_token_timeout: float = 60.0,
    idle_timeout: float = 60.0,
    drain_token: str | None = None,
) -> FastAPI:
    """The gateway, forwarding to ``upstream`` (a base URL; ``api_key`` is sent to it as
    ``Authorization: Bearer`` and ``x-api-key`` when the client sends none). ``POST
    /drainz`` takes ``Authorization: Bearer {drain_token}`` (None: a random one, so no one
    drains it)."""
    usage: dict[str, UsageRecord] = {}
    order: deque[str] = deque()
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(None, connect=10.0))

    def keep(record: UsageRecord) -> None:
        if record.generation_id is None:
            return
        usage[record.generation_id] = record
        order.append(record.generation_id)
        while len(order) > 1000:
            usage.pop(order.popleft(), None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="asgi-disconnect demo gateway", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = ", ".join(".".join(str(p) for p in error["loc"]) for error in exc.errors())
        return _problem(422, "invalid-request", f"Missing or invalid: {fields}.")

    def upstream_headers(request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k in _FORWARDED}
        if api_key is not None:
            headers.setdefault("authorization", f"Bearer {api_key}")
            headers.setdefault("x-api-key", api_key)
        headers.setdefault("content-type", "application/json")
        return headers

    async def relay(request: Request, path: str, body: bytes | None = None) -> Response:
        raw = await request.body() if body is None else body
        try:
            payload = json.loads(raw or b"{}")
        except ValueError:
            return _problem(400, "invalid-json", "The request body is not JSON.")
        if not isinstance(payload, dict):
            return _problem(400, "invalid-json", "The request body is not a JSON object.")
        outgoing = client.build_request(
            "POST", path, content=raw, headers=upstream_headers(request)
        )
        if not payload.get("stream"):
            try:
                answer = await client.send(outgoing)
            except httpx.HTTPError as exc:
                return _problem(502, "upstream-unreachable", f"The upstream failed: {exc}")
            return Response(
                answer.content,
                status_code=answer.status_code,
                media_type=answer.headers.get("content-type", "application/json"),
            )
        try:
            stream = await open_stream(
                client, outgoing, first_token_timeout=first_token_timeout, idle_timeout=idle_timeout
            )
        except UpstreamStatusError as exc:
            error = exc.error if exc.error is not None else {"error": str(exc)}
            headers = {"retry-after": exc.retry_after} if exc.retry_after else None
            return JSONResponse(error, status_code=exc.status_code, headers=headers)
        except (UpstreamStreamError, httpx.HTTPError) as exc:
            return _problem(502, "upstream-unreachable", f"The upstream failed: {exc}")
        return StreamingResponse(stream, media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    @disconnect_policy("cancel")
    async def chat(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions")

    @app.post("/v1/messages")
    @disconnect_policy("cancel")
    async def messages(request: Request) -> Response:
        return await relay(request, "/v1/messages")

    @app.post("/v1/reports")
    @disconnect_policy("detach")
    async def reports(request: Request) -> Response:
        return await relay(request, "/v1/chat/completions")

    @app.get("/", response_class=HTMLResponse)
    async def index(request: Request, g: str | None = None) -> HTMLResponse:
        response = HTMLResponse(page(prompt=_DEFAULT_PROMPT, generation_id=g, model=model))
        if _session(request.scope) is None:
            # The page's identity: what it asks for, it alone reads back, resumes and stops.
            response.set_cookie(
                SESSION_COOKIE, secrets.token_urlsafe(24), httponly=True, samesite="strict"
            )
        return response

    @app.post("/ask")
    @disconnect_policy("detach")
    @metered(False)  # an HTML page: its usage is the upstream call's, not this body's
    async def ask(request: Request, prompt: str = Form(...)) -> Response:
        body = _chat_body(model, prompt)
        outgoing = client.build_request(
            "POST", "/v1/chat/completions", json=body, headers=upstream_headers(request)
        )
        try:
            stream = await open_stream(
                client, outgoing, first_token_timeout=first_token_timeout, idle_timeout=idle_timeout
            )
        except UpstreamStreamError as exc:
            return HTMLResponse(
                page(prompt=prompt, answer="", state="failed", message=str(exc)), status_code=502
            )
        return StreamingResponse(
            _rendered(prompt, model, stream), media_type="text/html; charset=utf-8"
        )

    @app.get("/demo/usage/{generation_id}")
    async def usage_of(request: Request, generation_id: str) -> Response:
        record = usage.get(generation_id)
        caller = demo_principal(request.scope)
        # Another caller's record is one that does not exist, as for the generations.
        if record is None or not caller or record.principal != caller:
            return _problem(404, "usage-not-settled", "No usage record yet: metering…")
        fields = (
            "generation_id", "route", "outcome", "policy", "detached", "usage_source",
            "model", "input_tokens", "output_tokens", "delivered_output_tokens",
            "produced_bytes", "delivered_bytes", "error_type", "finish_reason",
        )  # fmt: skip
        return JSONResponse({name: getattr(record, name) for name in fields})

    @app.get("/demo/stats")
    async def stats() -> dict[str, Any]:
        counters: dict[str, int] = {}
        in_flight = 0
        layer: Any = app.middleware_stack
        while layer is not None:
            if isinstance(layer, DisconnectMiddleware):
                counters = layer.counters.as_dict()
            elif isinstance(layer, DrainMiddleware):
                in_flight = layer.in_flight - 1  # not this request
            layer = getattr(layer, "app", None)
        records = list(usage.values())
        return {
            "in_flight": in_flight,
            "cancelled": counters.get("cancelled", 0) + counters.get("stopped", 0),
            "detached": counters.get("detached", 0),
            "detach_completed": counters.get("detach_completed", 0),
            "billed_output_tokens": sum(r.output_tokens or 0 for r in records),
            "delivered_output_tokens": sum(r.delivered_output_tokens or 0 for r in records),
        }

    install(
        app,
        backend=connect(backend_url),
        sinks=[keep],
        idempotency=True,
        principal=demo_principal,
        drain={"deadline": 30.0, "drain_token": drain_token or secrets.token_urlsafe(24)},
        # The page and the panel are not generations.
        exclude_paths=(r"/$", r"/demo/"),
    )
    return app


def _chat_body(model: str, prompt: str) -> dict[str, Any]:
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}],
    }


async def _rendered(prompt: str, model: str, stream: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The page, server-rendered as the answer arrives: it works without JavaScript. The
    state comes after the answer, so it says how the stream ended."""
    head, _ = page_parts(prompt=prompt, state="streaming", scripted=False, model=model)
    yield head.encode()
    decoder = SSEDecoder()
    done = False
    failure = None
    try:
        async for chunk in stream:
            for event in decoder.feed(chunk):
                if event.data == "[DONE]":
                    done = True
                    continue
                text = _delta(event.data)
                if text:
                    yield html.escape(text).encode()
    except UpstreamStreamError as exc:
        failure = f"The answer failed: {exc}"
    if done and failure is None:
        state, message = "done", "Done."
    else:
        state, message = "failed", failure or "The answer ended before it was complete."
    _, tail = page_parts(prompt=prompt, state=state, message=message, scripted=False, model=model)
    yield tail.encode()


def _delta(data: str) -> str:
    try:
        payload = json.loads(data)
    except ValueError:
        return ""
    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not choices or not isinstance(choices[0], dict):
        return ""
    delta = choices[0].get("delta") or {}
    content = delta.get("content") if isinstance(delta, dict) else None
    return content if isinstance(content, str) else ""


def _problem(status: int, slug: str, detail: str) -> JSONResponse:
    return JSONResponse(
        {"type": f"urn:asgi-disconnect:problem:{slug}", "status": status, "detail": detail},
        status_code=status,
        media_type="application/problem+json",
    )
