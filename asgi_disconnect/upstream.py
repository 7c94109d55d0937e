"""Upstream streams: tied to the request that opened them, and watched while they run.

Cancelling an app's task does not always close its upstream: an async generator
suspended at ``yield`` keeps its ``async with client.stream(...)`` open until garbage
collection. Responses registered here are closed when the request's policy cancels.
Register every response of your own client with one line::

    client = httpx.AsyncClient(event_hooks={"response": [track_response]})

``open_stream`` opens a provider's event stream and watches it: a refused request is
an ``UpstreamStatusError`` before any byte reaches the client; a first event that
does not come, a silence between events, an error event or a body that ends without the
protocol's terminal marker raise the matching ``UpstreamStreamError``, which
DisconnectMiddleware turns into an ``event: error`` frame of that ``error_type`` (or, before
the response started, a ``502``/``504`` ``application/problem+json`` answer of that type),
logged in one line, never raised to the server; an upstream that cannot be reached is an
``UpstreamUnreachable``::

    try:
        upstream = await open_stream(client, client.build_request("POST", url, json=body),
                                     first_token_timeout=30, idle_timeout=60)
    except UpstreamStatusError as exc:
        return JSONResponse(exc.error, status_code=exc.status_code)
    return StreamingResponse(upstream, media_type="text/event-stream")
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import TYPE_CHECKING, Any

import msgspec

from ._aio import shielded
from ._contract import current_state
from ._errors import (
    FirstTokenTimeout,
    IdleTimeout,
    TruncatedStream,
    UpstreamStatusError,
    UpstreamStreamError,
    UpstreamUnreachable,
)
from ._llm_stream import StreamMeter

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable

    from ._contract import Closable

logger = logging.getLogger("asgi_disconnect")

__all__ = [
    "FirstTokenTimeout",
    "IdleTimeout",
    "TruncatedStream",
    "UpstreamStatusError",
    "UpstreamStream",
    "UpstreamStreamError",
    "UpstreamUnreachable",
    "open_stream",
    "track",
    "track_response",
]


def track(upstream: Closable) -> bool:
    """Close ``upstream`` if the current request is cancelled; False outside a request."""
    state = current_state.get()
    if state is None:
        return False
    state.track(upstream)
    return True


async def track_response(response: Closable) -> None:
    """An httpx (or httpx2) ``response`` event hook that calls ``track``."""
    if track(response):
        _describe(getattr(response, "request", None))


# Provider hosts, by the names of the OpenTelemetry GenAI conventions (gen_ai.provider.name).
_PROVIDER_HOSTS = {
    "api.openai.com": "openai",
    "api.anthropic.com": "anthropic",
    "api.groq.com": "groq",
    "openrouter.ai": "openrouter",
    "generativelanguage.googleapis.com": "gcp.gemini",
    "api.mistral.ai": "mistral_ai",
    "api.deepseek.com": "deepseek",
    "api.x.ai": "x_ai",
    "api.perplexity.ai": "perplexity",
    "api.cohere.com": "cohere",
}


class _RequestBody(msgspec.Struct):
    model: Any = None


_REQUEST_BODY = msgspec.json.Decoder(_RequestBody)


def _describe(request: Any) -> None:
    """Keep the upstream request's body for metering (an input estimate when the provider's
    usage never comes), and tell an observer of the current request (telemetry) the model
    asked for and the provider's name."""
    state = current_state.get()
    if state is None or request is None:
        return
    try:
        body = request.content  # raises for a streamed body: then nothing is known
    except Exception:
        return
    if state.request_body is None and isinstance(body, bytes):
        state.request_body = body
    if state.marks is None:
        return
    try:
        host = request.url.host
    except Exception:
        return
    state.provider_name = state.provider_name or _PROVIDER_HOSTS.get(host)
    if state.request_model is None and body[:1] == b"{":
        try:
            model = _REQUEST_BODY.decode(body).model
        except msgspec.DecodeError:
            return
        if isinstance(model, str):
            state.request_model = model


_ERROR_BODY = 64 << 10


class _ChatRequest(msgspec.Struct):
    stream: Any = None
    messages: Any = None
    stream_options: Any = None


_CHAT_REQUEST = msgspec.json.Decoder(_ChatRequest)
_ENCODE = msgspec.json.Encoder().encode


def _asking_for_usage(client: Any, request: Any) -> Any | None:
    """``request`` rewritten to ask the provider for usage (OpenAI Chat Completions,
    ``stream_options.include_usage``), or None when it asks already or is not such a call."""
    try:
        body = request.content
    except Exception:
        return None  # a streamed body: left as it is
    if not isinstance(body, bytes) or body[:1] != b"{":
        return None
    try:
        call = _CHAT_REQUEST.decode(body)
    except msgspec.DecodeError:
        return None
    options = call.stream_options
    if call.stream is not True or not isinstance(call.messages, list):
        return None
    if options is not None and not isinstance(options, dict):
        return None
    if options and options.get("include_usage") is True:
        return None
    payload = msgspec.json.decode(body)
    payload["stream_options"] = {**(options or {}), "include_usage": True}
    headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
    return client.build_request(
        request.method, request.url, headers=headers, content=_ENCODE(payload)
    )


def _without_usage(event: bytes) -> bytes | None:
    """One event of a stream that asked for usage, as it would have been without: None for
    the usage chunk (``"choices":[]`` and a ``usage``), else without ``"usage":null``."""
    if b'"usage"' not in event:
        return event
    if b'"choices":[]' in event and b'"usage":{' in event:
        return None
    return event.replace(b',"usage":null', b"", 1)


async def open_stream(
    client: Any,
    request: Any,
    *,
    first_token_timeout: float | None = 30.0,
    idle_timeout: float | None = 60.0,
    provider: str | None = None,
    ask_for_usage: bool = False,
    upstream: str | None = None,
    continuation: str | None = None,
    fallback: str = "interrupted",
) -> UpstreamStream:
    """Send ``request`` with ``client`` (an ``httpx.AsyncClient``, or httpx2's) and return
    its event stream, an async iterator of the body's bytes, unchanged.

    ``ask_for_usage``: an OpenAI Chat Completions stream whose caller did not ask for usage
    (``stream_options.include_usage``) is sent asking for it, so its usage record carries
    the provider's counts; the caller gets exactly the bytes it would have got without (the
    usage chunk and the ``"usage":null`` of the other chunks are taken out). A caller that
    asked gets the usage as it asked.

    A non-2xx status raises ``UpstreamStatusError`` here, before the caller starts
    its own response. ``first_token_timeout`` runs from now to the first event (not to the
    headers), ``idle_timeout`` between events; keep-alive comments are not events. The
    response is tracked on the current request (``track``) and closed, shielded, on
    every way out of the iteration. Give the client a read timeout longer than both (or
    none): these are the ones that tell a slow stream from a dead one.

    ``continuation``: how another replica finishes the generation of a detaching route if
    this process dies (or drains) before it ends, with its own client registered as
    ``upstream`` (``install(upstreams={name: client})`` on every replica):

    - ``"responses"``: OpenAI Responses. The request is sent in background mode
      (``background``, ``store``), so the provider keeps generating; the new owner
      re-attaches by the response id and the last sequence number the log holds: the same
      bytes, no second bill. A Stop or a cancel uses the provider's cancel endpoint.
    - ``"continue_final_message"``: an OpenAI-compatible server that continues a final
      assistant message (vLLM, SGLang): the request again, with the stored text as that
      message.
    - ``"prefill"``: Anthropic Messages, the stored text as the assistant's prefill; where
      the model refuses prefill, ``fallback`` decides: ``"synthetic"`` (ask the model to go
      on from the stored text; not byte-exact), ``"restart"`` or ``"interrupted"``.
    - ``"restart"``: the request again from the start; readers get an
      ``asgi_disconnect.restart`` event saying the earlier output is replaced.

    Only the method, URL, JSON body and non-credential headers are stored, never a key; the
    stream is relayed in whole events, so the log always ends at an event's end.
    """
    loop = asyncio.get_running_loop()
    recorded = None
    if continuation is not None:
        recorded = _continuation_of(client, request, continuation, upstream, fallback)
        request = recorded[1]
    first_deadline = None if first_token_timeout is None else loop.time() + first_token_timeout
    hide_usage = False
    if ask_for_usage:
        rewritten = _asking_for_usage(client, request)
        if rewritten is not None:
            request, hide_usage = rewritten, True
    try:
        async with asyncio.timeout_at(first_deadline):
            response = await client.send(request, stream=True)
    except TimeoutError:
        raise FirstTokenTimeout(
            f"the upstream sent no headers within {first_token_timeout:g} s"
        ) from None
    except _transport_errors() as exc:
        raise UpstreamUnreachable(f"the upstream could not be reached: {exc!r}") from exc
    if track(response):
        _describe(request)
    state = current_state.get()
    if recorded is not None and state is not None and 200 <= response.status_code < 300:
        state.continue_with(recorded[0])
    if not 200 <= response.status_code < 300:
        try:
            async with asyncio.timeout_at(first_deadline):
                body = await _read_some(response, _ERROR_BODY)
        except TimeoutError:
            body = b""
        finally:
            await shielded(response.aclose())
        raise UpstreamStatusError(
            response.status_code, _decoded(body), response.headers.get("retry-after")
        )
    stream = UpstreamStream(
        response,
        first_deadline,
        idle_timeout,
        provider,
        hide_usage=hide_usage,
        whole_events=recorded is not None,
    )
    if continuation == "responses":
        # A background response outlives its connection: cancelling means asking the
        # provider (with this request's own headers, which are not stored).
        background = _BackgroundResponse(client, request, stream)
        stream.abandoned = background.cancel_at_provider
        track(background)
    return stream


def _continuation_of(
    client: Any, request: Any, kind: str, upstream: str | None, fallback: str
) -> tuple[tuple[str, bytes], Any]:
    """What the generation records for a takeover, and the request to send (in background
    mode for ``"responses"``)."""
    from ._continuation import background_body, encode, recorded

    if not upstream:
        raise ValueError(
            "open_stream(continuation=...) needs upstream=, the name every replica registers "
            "its client for this upstream under (install(upstreams={name: client}))"
        )
    try:
        body = request.content
    except Exception:
        raise ValueError(
            "open_stream(continuation=...) needs a request whose body is in memory (JSON), "
            "not a streamed body"
        ) from None
    if kind == "responses":
        body = background_body(body)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() != "content-length"]
        request = client.build_request(request.method, request.url, headers=headers, content=body)
    record = recorded(
        kind,
        upstream=upstream,
        method=request.method,
        url=str(request.url),
        body=body,
        headers=tuple(request.headers.items()),
        fallback=fallback,
        trace=_traceparent(),
    )
    return (upstream, encode(record)), request


def _traceparent() -> str | None:
    """The current span's W3C ``traceparent``, where OpenTelemetry is installed: the spans of
    the attempts that finish the generation elsewhere link to it."""
    try:
        from opentelemetry.trace import get_current_span
    except ImportError:
        return None
    context = get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


class _BackgroundResponse:
    """A tracked OpenAI background response: closing it for a cancel or a Stop asks the
    provider to cancel it (``POST .../responses/{id}/cancel``), unless it ended."""

    def __init__(self, client: Any, request: Any, stream: UpstreamStream) -> None:
        self.http = client
        self.request = request
        self.stream = stream

    async def aclose(self) -> None:
        await self.stream.aclose()
        await self.cancel_at_provider()

    async def cancel_at_provider(self) -> None:
        from ._continuation import response_url

        stream = self.stream
        response_id = stream.response_id
        if response_id is None or stream.meter.ending() == "complete":
            return
        headers = [(k, v) for k, v in self.request.headers.items() if k.lower() != "content-length"]
        url = response_url(str(self.request.url), response_id, "/cancel")
        cancel = self.http.build_request("POST", url, headers=headers, content=b"")
        response = await self.http.send(cancel)
        if response.status_code >= 300:
            logger.warning(
                "the provider refused to cancel background response %s: %s %s",
                response_id,
                response.status_code,
                response.text[:500],
            )


class UpstreamStream:
    """A provider's event stream as it arrives, checked as it goes (see ``open_stream``)."""

    def __init__(
        self,
        response: Any,
        first_deadline: float | None,
        idle_timeout: float | None,
        provider: str | None,
        *,
        hide_usage: bool = False,
        whole_events: bool = False,
    ) -> None:
        self.response = response
        self.meter = StreamMeter(provider)
        self._whole_events = whole_events
        # An OpenAI Responses stream's id, once its first event named it (whole events only).
        self.response_id: str | None = None
        # Called when the stream is given up for a timeout (a background response's cancel).
        self.abandoned: Callable[[], Awaitable[None]] | None = None
        self._first_deadline = first_deadline
        self._idle_timeout = idle_timeout
        self._hide_usage = hide_usage
        self._pending = b""  # hiding usage: the event under way

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iterate()

    async def aclose(self) -> None:
        await self.response.aclose()

    async def _iterate(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        meter = self.meter
        raw = self.response.aiter_raw()
        last_event = 0.0
        try:
            while True:
                if not meter.event_count:
                    deadline = self._first_deadline
                elif self._idle_timeout is not None:
                    deadline = last_event + self._idle_timeout
                else:
                    deadline = None
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await raw.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if self.abandoned is not None:
                        # A background response that stopped progressing (one that stays
                        # queued, say) would still run and bill: the provider cancels it.
                        await shielded(self.abandoned())
                    if not meter.event_count:
                        raise FirstTokenTimeout("the upstream sent no event in time") from None
                    raise IdleTimeout(
                        f"the upstream sent no event for {self._idle_timeout:g} s"
                    ) from None
                except UpstreamStreamError:
                    raise
                except Exception as exc:
                    # Reset, or closed mid-body: it ended before its terminal marker.
                    raise TruncatedStream(f"the upstream connection broke: {exc!r}") from exc
                before = meter.event_count
                meter.feed(chunk)
                if meter.event_count != before:
                    last_event = loop.time()
                if self._hide_usage:
                    chunk = self._hidden(chunk)
                    if not chunk:
                        continue
                elif self._whole_events:
                    chunk = self._whole(chunk)
                    if not chunk:
                        continue
                yield chunk
            if self._pending:
                yield self._pending
                self._pending = b""
            if self._hide_usage:
                self._hand_over_usage()
            ending = meter.ending()
            if ending == "error":
                report = meter.report()
                raise UpstreamStreamError("the upstream sent an error event", error=report.error)
            if ending == "truncated":
                raise TruncatedStream("the upstream body ended without its terminal marker")
        finally:
            await shielded(self.response.aclose())

    def _whole(self, chunk: bytes) -> bytes:
        """The whole events ``chunk`` completes, the rest kept for the next one."""
        data = self._pending + chunk if self._pending else chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        self._pending = data[end:]
        whole = data[:end]
        if self.response_id is None and b"response.created" in whole:
            self.response_id = _response_id(whole)
        return whole

    def _hidden(self, chunk: bytes) -> bytes:
        """``chunk`` as the caller would have had it without asking for usage: whole events
        only, each through ``_without_usage``."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2 :]
        kept = [
            shown
            for event in data[: end + 2].split(b"\n\n")[:-1]
            if (shown := _without_usage(event + b"\n\n")) is not None
        ]
        return b"".join(kept)

    def _hand_over_usage(self) -> None:
        """The usage the caller did not see goes to its request's record."""
        state = current_state.get()
        report = self.meter.report()
        if state is not None and report.usage_source == "provider":
            state.upstream_usage = report


class _Created(msgspec.Struct):
    response: Any = None


_CREATED = msgspec.json.Decoder(_Created)


def _response_id(events: bytes) -> str | None:
    """The response id of an OpenAI Responses stream's ``response.created`` event."""
    for event in events.split(b"\n\n"):
        if b"response.created" not in event:
            continue
        for line in event.splitlines():
            if line.startswith(b"data:"):
                try:
                    response = _CREATED.decode(line[5:].strip()).response
                except msgspec.DecodeError:
                    return None
                if isinstance(response, dict) and isinstance(response.get("id"), str):
                    return str(response["id"])
    return None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """What a client that could not reach its upstream raises: the ``TransportError`` of
    httpx and of httpx2 (those imported: the client in hand is one of them), and ``OSError``."""
    errors: list[type[BaseException]] = [OSError]
    for library in ("httpx", "httpx2"):
        module = sys.modules.get(library)
        error = getattr(module, "TransportError", None) if module is not None else None
        if isinstance(error, type) and issubclass(error, BaseException):
            errors.append(error)
    return tuple(errors)


async def _read_some(response: Any, limit: int) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        parts.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return b"".join(parts)[:limit]


def _decoded(body: bytes) -> Any:
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace")
