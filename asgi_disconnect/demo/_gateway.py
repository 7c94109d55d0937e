"""The demo gateway: a FastAPI app on the whole stack, in front of an OpenAI- or
Anthropic-compatible upstream (FakeProvider by default).

Routes:

- ``POST /v1/chat/completions`` (OpenAI-compatible) and ``POST /v1/messages``
  (Anthropic-compatible): policy ``cancel``, streamed or not, as the request asks;
- ``POST /v1/reports``: long-form, OpenAI-compatible, policy ``detach``;
- ``/generations/...``: status, resume, Stop (the stack's own);
- ``GET /``: the web page (``?g={id}``: as that generation stands); ``POST /ask``: its form,
  which starts a generation on ``/v1/reports``, or on ``/v1/chat/completions`` when its
  detach box is unchecked (read here while the page keeps reloading), and redirects to it;
  ``POST /stop``: its Stop form, which stops the generation and redirects back;
- ``GET /demo/usage/{id}``: a request's usage record once it is settled (404 before, and
  for another caller's), with what reached the caller over all the requests that read it;
  ``GET /demo/stats``: the live panel's figures; ``GET /demo/chart``: its chart (SVG);
- ``GET /readyz``, ``POST /drainz``: readiness and drain (with the drain token).

Who a caller is: its credential headers (the package's default), else the page's session
cookie, which ``GET /`` sets; a request with neither is anonymous and reads nothing back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Form, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)

from .. import (
    DisconnectMiddleware,
    DrainMiddleware,
    Status,
    UsageRecord,
    connect,
    default_principal,
    disconnect_policy,
    install,
)
from .._problem import problem_body
from ..upstream import UpstreamStatusError, UpstreamStreamError, open_stream
from ._answer import read_answer
from ._delivery import Delivery, DeliveryMiddleware
from ._inner import Answered, call
from ._page import (
    METERING,
    RouteTokens,
    View,
    billed_estimated,
    chart,
    cost_line,
    delivered_estimated,
    render,
)

if TYPE_CHECKING:
    from starlette.types import Scope

    from .. import GenerationReader

__all__ = ["make_app"]

logger = logging.getLogger("asgi_disconnect.demo")

# Headers a provider needs that the client sends (auth, API version, content type).
_FORWARDED = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta", "content-type")
_DEFAULT_PROMPT = "Write a short report on why streamed answers should survive a disconnect."
SESSION_COOKIE = "asgi_demo_session"
# How long after a generation's end its page waits for the usage record.
_SETTLING = 60.0
_GENERATION = re.compile(r"gen_[A-Za-z0-9_-]{1,64}")
# A page without JavaScript reloads every second: one not seen for this long has gone.
_PAGE_GONE = 5.0


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
    backend = connect(backend_url)
    delivery = Delivery()
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
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
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
                return _upstream_failed(request, exc)
            return Response(
                answer.content,
                status_code=answer.status_code,
                media_type=answer.headers.get("content-type", "application/json"),
            )
        try:
            stream = await open_stream(
                client,
                outgoing,
                first_token_timeout=first_token_timeout,
                idle_timeout=idle_timeout,
                ask_for_usage=True,  # the provider's own counts, not an estimate
            )
        except UpstreamStatusError as exc:
            error = exc.error if exc.error is not None else {"error": str(exc)}
            headers = {"retry-after": exc.retry_after} if exc.retry_after else None
            return JSONResponse(error, status_code=exc.status_code, headers=headers)
        except (UpstreamStreamError, httpx.HTTPError) as exc:
            return _upstream_failed(request, exc)
        generation_id = request.scope["asgi_disconnect"].generation_id
        return StreamingResponse(
            delivery.produced(
                generation_id, stream, prompt=_prompt_of(payload), route=request.url.path
            ),
            media_type="text/event-stream",
        )

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

    _Pages(model=model, usage=usage, delivery=delivery, backend=backend).add_routes(app)

    install(
        app,
        backend=backend,
        sinks=[keep],
        idempotency=True,
        principal=demo_principal,
        drain={"deadline": 30.0, "drain_token": drain_token or secrets.token_urlsafe(24)},
        # The page and the panel are not generations.
        exclude_paths=(r"/$", r"/demo/"),
    )
    app.add_middleware(DeliveryMiddleware, delivery=delivery)
    return app


def _chat_body(model: str, prompt: str) -> dict[str, Any]:
    return {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": prompt}],
    }


class _PageReader:
    """Reads a cancel generation for a page without JavaScript, which reloads itself every
    second: the client is the page, so when it has not been seen for ``_PAGE_GONE`` seconds
    the reader leaves, and the policy cancels the generation."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.left = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def follow(
        self, generation_id: str, task: asyncio.Task[Answered], readers: dict[str, _PageReader]
    ) -> None:
        readers[generation_id] = self
        self.seen()

        def over(done: asyncio.Task[Answered]) -> None:
            readers.pop(generation_id, None)
            if self._timer is not None:
                self._timer.cancel()
            if not done.cancelled() and done.exception() is not None:
                logger.error(
                    "reading %s for its page failed", generation_id, exc_info=done.exception()
                )

        task.add_done_callback(over)

    def seen(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(_PAGE_GONE, self.left.set)


class _Pages:
    """The page's routes: what the form starts, stops and shows, read back as its caller."""

    def __init__(
        self,
        *,
        model: str,
        usage: dict[str, UsageRecord],
        delivery: Delivery,
        backend: GenerationReader,
    ) -> None:
        self.model = model
        self.usage = usage
        self.delivery = delivery
        self.backend = backend
        self.app: FastAPI | None = None
        # Cancel generations read here for a page without JavaScript, by id, while they run.
        self.readers: dict[str, _PageReader] = {}

    def add_routes(self, app: FastAPI) -> None:
        self.app = app
        app.get("/", response_class=HTMLResponse)(self.index)
        app.post("/ask")(self.ask)
        app.post("/stop")(self.stop)
        app.get("/demo/usage/{generation_id}")(self.usage_of)
        app.get("/demo/stats")(self.stats)
        app.get("/demo/chart")(self.chart)

    def record_of(self, scope: Scope, generation_id: str) -> UsageRecord | None:
        """The generation's usage record, if it is settled and the caller's."""
        record = self.usage.get(generation_id)
        caller = demo_principal(scope)
        if record is None or not caller or record.principal != caller:
            return None
        return record

    def cost(self, scope: Scope, generation_id: str) -> str:
        record = self.record_of(scope, generation_id)
        if record is None:
            return METERING
        return cost_line(record, self.delivery.of(record)[1])

    def view(self, prompt: str = _DEFAULT_PROMPT, **shown: Any) -> View:
        return View(
            prompt=prompt,
            model=self.model,
            chart=chart(self.routes()),
            stats=self.figures(),
            **shown,
        )

    async def index(self, request: Request, g: str | None = None) -> HTMLResponse:
        if g is None:
            response = HTMLResponse(render(self.view()))
        else:
            response = await self.generation_page(request, g)
        if _session(request.scope) is None:
            # The page's identity: what it asks for, it alone reads back, resumes and stops.
            response.set_cookie(
                SESSION_COOKIE, secrets.token_urlsafe(24), httponly=True, samesite="strict"
            )
        return response

    async def generation_page(self, request: Request, generation_id: str) -> HTMLResponse:
        """The generation as it stands, read back as its caller (anyone else: not found)."""
        caller = demo_principal(request.scope)
        info = await self.backend.get(generation_id)
        owner = await self.backend.principal_of(generation_id) if info is not None else None
        if info is None or not caller or owner != caller:
            message = "No such generation for this page."
            return HTMLResponse(render(self.view(state="failed", message=message)), 404)
        reader = self.readers.get(generation_id)
        if reader is not None:
            reader.seen()  # the page is still there
        answer = read_answer(info, await self.logged(generation_id, info.size))
        self.delivery.reached(generation_id, answer.offset)
        cost = self.cost(request.scope, generation_id)
        # The record follows the generation's end closely; one that never comes is no reason
        # to reload forever.
        metering = cost == METERING and time.time() - (info.finished_at or 0) < _SETTLING
        prompt, route = self.delivery.asked(generation_id) or (_DEFAULT_PROMPT, "")
        shown = self.view(
            prompt or _DEFAULT_PROMPT,
            generation_id=generation_id,
            state=answer.state,
            message=answer.message,
            answer=answer.text,
            offset=answer.offset,
            cost=cost,
            refresh=info.status is Status.RUNNING or metering,
            detach=route != "/v1/chat/completions",
        )
        return HTMLResponse(render(shown))

    async def logged(self, generation_id: str, size: int) -> bytes:
        """The first ``size`` bytes of the generation's log."""
        data = bytearray()
        if size:
            async with contextlib.aclosing(self.backend.follow(generation_id, 0)) as chunks:
                async for chunk in chunks:
                    data += chunk
                    if len(data) >= size:
                        break
        return bytes(data[:size])

    async def ask(
        self, request: Request, prompt: str = Form(...), detach: str | None = Form(None)
    ) -> Response:
        """Start the answer as the page's script would, then show it: the page's address
        names the generation, so a reload reads on. ``detach`` checked: ``/v1/reports``,
        left at once, running on. Unchecked: ``/v1/chat/completions`` (cancel), read here
        for as long as the page keeps reloading itself, and left when it stops: the page
        closed or gone elsewhere, the provider is stopped."""
        body = json.dumps(_chat_body(self.model, prompt)).encode()
        if detach is not None:
            started = await call(
                request.app, request.scope, "POST", "/v1/reports", body, leave=True
            )
        else:
            started = await self.read_for_page(request, body)
        generation_id = started.headers.get("x-generation-id")
        if started.status == 200 and generation_id:
            return RedirectResponse(f"/?g={generation_id}", status_code=303)
        try:
            detail = json.loads(started.body)
        except ValueError:
            detail = {}
        error = detail.get("error") if isinstance(detail, dict) else None
        reason = (
            error.get("message") if isinstance(error, dict) else detail.get("detail")
        ) or started.body.decode("utf-8", "replace")
        message = f"The request failed ({started.status}): {reason}"
        failed = self.view(prompt, state="failed", message=message)
        return HTMLResponse(render(failed), status_code=started.status or 502)

    async def read_for_page(self, request: Request, body: bytes) -> Answered:
        """Start a cancel generation that this process reads on the page's behalf while
        the page reloads itself; its head, or the whole failed answer."""
        loop = asyncio.get_running_loop()
        head: asyncio.Future[Answered] = loop.create_future()
        reader = _PageReader(loop)

        def headed(answered: Answered) -> None:
            if not head.done():
                head.set_result(answered)

        task = loop.create_task(
            call(
                request.app,
                request.scope,
                "POST",
                "/v1/chat/completions",
                body,
                leave=reader.left,
                on_head=headed,
            )
        )
        await asyncio.wait({head, task}, return_when=asyncio.FIRST_COMPLETED)
        answered = head.result() if head.done() else await task
        generation_id = answered.headers.get("x-generation-id")
        if answered.status != 200 or not generation_id:
            return await task  # its body says why
        reader.follow(generation_id, task, self.readers)
        return answered

    async def stop(self, request: Request, g: str = Form(...)) -> Response:
        """The Stop form: stop the generation as its caller, then show the page again."""
        if not _GENERATION.fullmatch(g):
            return _problem(422, "invalid-request", "Missing or invalid: g.")
        await call(request.app, request.scope, "POST", f"/generations/{g}/cancel")
        return RedirectResponse(f"/?g={g}", status_code=303)

    async def usage_of(self, request: Request, generation_id: str) -> Response:
        record = self.record_of(request.scope, generation_id)
        # Another caller's record is one that does not exist, as for the generations.
        if record is None:
            return _problem(404, "usage-not-settled", "No usage record yet: metering…")
        fields = (
            "generation_id", "route", "outcome", "policy", "detached", "usage_source",
            "model", "input_tokens", "output_tokens", "produced_bytes", "error_type",
            "finish_reason",
        )  # fmt: skip
        answer: dict[str, Any] = {name: getattr(record, name) for name in fields}
        delivered_bytes, delivered_tokens = self.delivery.of(record)
        answer |= {
            "delivered_bytes": delivered_bytes,
            "delivered_output_tokens": delivered_tokens,
            # What the request that started it delivered, before any reload.
            "first_request_delivered_output_tokens": record.delivered_output_tokens,
            "summary": cost_line(record, delivered_tokens),
        }
        return JSONResponse(answer)

    def routes(self) -> list[RouteTokens]:
        billed: dict[str, int] = {}
        delivered: dict[str, int] = {}
        estimated: dict[str, tuple[bool, bool]] = {}
        for record in list(self.usage.values()):
            route = record.route
            billed[route] = billed.get(route, 0) + (record.output_tokens or 0)
            tokens = self.delivery.of(record)[1]
            delivered[route] = delivered.get(route, 0) + (tokens or 0)
            marks = estimated.get(route, (False, False))
            estimated[route] = (
                marks[0] or (bool(record.output_tokens) and billed_estimated(record)),
                marks[1] or delivered_estimated(record, tokens),
            )
        return [
            RouteTokens(route, billed[route], delivered[route], *estimated[route])
            for route in sorted(billed)
        ]

    def figures(self) -> dict[str, int]:
        """The live panel's figures: the stack's counters, and output tokens over all routes."""
        counters: dict[str, int] = {}
        in_flight = 0
        layer: Any = self.app.middleware_stack if self.app is not None else None
        while layer is not None:
            if isinstance(layer, DisconnectMiddleware):
                counters = layer.counters.as_dict()
            elif isinstance(layer, DrainMiddleware):
                in_flight = layer.in_flight - 1  # not this request
            layer = getattr(layer, "app", None)
        rows = self.routes()
        return {
            "in_flight": in_flight,
            "cancelled": counters.get("cancelled", 0) + counters.get("stopped", 0),
            "detached": counters.get("detached", 0),
            "detach_completed": counters.get("detach_completed", 0),
            "billed_output_tokens": sum(row.billed for row in rows),
            "delivered_output_tokens": sum(row.delivered for row in rows),
            # Whether each sum holds an estimate (the page marks it ≈).
            "billed_output_tokens_estimated": any(row.billed_estimated for row in rows),
            "delivered_output_tokens_estimated": any(row.delivered_estimated for row in rows),
        }

    async def stats(self) -> dict[str, int]:
        return self.figures()

    async def chart(self) -> Response:
        return Response(chart(self.routes()), media_type="image/svg+xml")


def _prompt_of(payload: dict[str, Any]) -> str:
    """The last message's text, as the page's form sent it."""
    messages = payload.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        content = messages[-1].get("content")
        if isinstance(content, str):
            return content
    return ""


def _problem(status: int, slug: str, detail: str) -> Response:
    return Response(
        problem_body(status, slug, HTTPStatus(status).phrase, detail),
        status_code=status,
        media_type="application/problem+json",
    )


def _upstream_failed(request: Request, exc: Exception) -> Response:
    """A provider that could not be reached or broke off before the stream: a 502 problem,
    and one log line (the request log's line for the generation follows it)."""
    logger.warning(
        "generation %s (%s %s): the upstream failed: %s: %s",
        request.scope["asgi_disconnect"].generation_id,
        request.method,
        request.url.path,
        type(exc).__name__,
        exc,
    )
    return _problem(502, "upstream-unreachable", f"The upstream failed: {exc}")
