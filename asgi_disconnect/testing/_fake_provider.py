"""A loopback HTTP/1.1 server imitating the streaming OpenAI Chat, OpenAI Responses and
Anthropic Messages APIs.

It records every API call and, crucially, notices a client that hangs up while a response is
being generated (a concurrent reader sees EOF), so tests can assert that abandoned upstream calls
really stopped. It can also misbehave as real upstreams do (a ``Fault``, per request or for
every request): reset the connection, stall, send garbage, end without the terminal marker, or
answer an HTTP error status instead of streaming.

It also speaks the shapes a gateway uses to finish a generation another process started:

- OpenAI Responses background mode: ``background: true`` (with ``store``) runs the generation
  inside the provider whoever listens; ``GET /v1/responses/{id}?stream=true&starting_after=N``
  re-attaches (the kept events after N, then the live ones, byte for byte as first sent),
  ``POST /v1/responses/{id}/cancel`` cancels, and ``x-fake-queued: 1`` leaves one queued
  forever, a fault seen on the real API;
- vLLM/SGLang ``continue_final_message`` and Anthropic prefill: a final assistant message P
  is continued, streaming only what follows P in the deterministic text, with the requests the
  providers refuse (both generation flags, prefill with trailing whitespace, with thinking on,
  or on a model that takes none) answered with their 400s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from types import TracebackType

__all__ = ["GARBAGE", "FakeProvider", "Fault", "FaultKind", "ProviderRequest"]

# INFO: a line per call when it ends (the provider run alone shows them).
logger = logging.getLogger("asgi_disconnect.testing.fake_provider")

OPENAI_CHAT = "openai_chat"
ANTHROPIC_MESSAGES = "anthropic_messages"
OPENAI_RESPONSES = "openai_responses"
_ROUTES = {
    "/v1/chat/completions": OPENAI_CHAT,
    "/v1/messages": ANTHROPIC_MESSAGES,
    "/v1/responses": OPENAI_RESPONSES,
}
# GET /v1/responses/{id} and POST /v1/responses/{id}/cancel
_RESPONSE_PATH = re.compile(r"/v1/responses/([^/]+)(/cancel)?")
_MAX_HEAD = 64 * 1024
_MAX_BODY = 16 * 1024 * 1024
_REASONS = {
    100: "Continue",
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    409: "Conflict",
    411: "Length Required",
    413: "Content Too Large",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
    529: "Overloaded",
}
_DIGITS = re.compile(r"[0-9]+")


def _dumps(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _token_text(index: int) -> str:
    return f"tok{index} "


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Signal:
    """A lock guarding shared state plus a wake-up that threads and any event loop can wait on."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    def notify(self) -> None:
        """Wake every waiter; the caller holds `lock`."""
        self.lock.notify_all()
        for loop, future in self._waiters:
            with contextlib.suppress(RuntimeError):  # that waiter's loop is already closed
                loop.call_soon_threadsafe(_resolve, future)

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        with self.lock:
            return self.lock.wait_for(predicate, timeout)

    async def wait_async(self, predicate: Callable[[], bool], timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            future: asyncio.Future[None] = loop.create_future()
            waiter = (loop, future)
            with self.lock:
                if predicate():
                    return True
                self._waiters.add(waiter)
            try:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                await asyncio.wait_for(future, remaining)
            except TimeoutError:
                with self.lock:
                    return predicate()
            finally:
                with self.lock:
                    self._waiters.discard(waiter)


FaultKind = Literal["reset", "stall", "garbage", "truncate", "error", "status"]
_AFTER_KINDS: tuple[FaultKind, ...] = ("reset", "stall", "garbage", "truncate", "error")
_FAULT_GRAMMAR = (
    "none | reset-after=N | stall-after=N[;seconds=S] | garbage-after=N | truncate-after=N"
    " | error-after=N | status=CODE (400-599)"
)
# What a proxy in front of a provider sends in its place: not UTF-8, not an event stream.
GARBAGE = (
    b"\x00\xde\xad\xbe\xef\xff\xfe not an event stream\r\n"
    b"<html><body><h1>502 Bad Gateway</h1></body></html>\r\n"
)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """How a response misbehaves. ``Fault.parse`` reads the ``x-fake-fault`` header's form.

    - ``reset-after=N``: after N tokens the connection is reset (TCP RST, ``SO_LINGER`` 0);
    - ``stall-after=N;seconds=S``: after N tokens nothing is sent for S seconds, the socket
      open, then the stream goes on; without ``seconds`` (or ``inf``) it stalls until the
      client or the server closes;
    - ``garbage-after=N``: after N tokens, bytes that are no event stream (`GARBAGE`), then
      the end of the body and of the connection;
    - ``truncate-after=N``: after N tokens the chunked body ends cleanly, without the finish,
      usage and terminal frames (``data: [DONE]``, ``message_stop``);
    - ``error-after=N``: after N tokens, the provider's own mid-stream error frame;
    - ``status=CODE``: that HTTP status (400-599) with the provider's JSON error body (and
      ``retry-after`` for 429, 503 and 529) instead of a response.

    ``N`` past the response's token count means after its last token; ``after=0`` is after
    the preamble frames, before the first token. For a call without ``"stream": true`` the
    tokens are counted as they are generated: ``reset`` and ``stall`` happen before the
    response, ``garbage`` replaces its JSON body and ``truncate`` sends the first half of it.
    """

    kind: FaultKind
    after: int = 0
    seconds: float = math.inf
    status: int = 500

    def __post_init__(self) -> None:
        if self.kind not in (*_AFTER_KINDS, "status"):
            raise ValueError(f"unknown fault kind {self.kind!r}; one of: {_FAULT_GRAMMAR}")
        if self.after < 0:
            raise ValueError(f"after must not be negative, got {self.after}")
        if not self.seconds >= 0:  # NaN too
            raise ValueError(f"seconds must not be negative, got {self.seconds}")
        if not 400 <= self.status <= 599:
            raise ValueError(f"status must be 400-599, got {self.status}")

    @classmethod
    def parse(cls, text: str) -> Fault | None:
        """``"reset-after=20"`` -> ``Fault(kind="reset", after=20)``; ``"none"`` -> None."""
        spec = text.strip().lower()
        if spec in ("", "none"):
            return None
        head, *params = (part.strip() for part in spec.split(";"))
        name, _, value = head.partition("=")
        options: dict[str, str] = {}
        for param in params:
            key, eq, option = param.partition("=")
            if not eq or key.strip() != "seconds" or name != "stall-after" or "seconds" in options:
                raise ValueError(f"unexpected {param!r} in fault {text!r}; {_FAULT_GRAMMAR}")
            options["seconds"] = option.strip()
        try:
            if name == "status":
                return cls(kind="status", status=_strict_int(value))
            kind = name.removesuffix("-after")
            if kind == name or kind not in _AFTER_KINDS:
                raise ValueError(f"unknown fault {name!r}")
            seconds = float(options.get("seconds", "inf"))
            return cls(kind=kind, after=_strict_int(value), seconds=seconds)
        except ValueError as exc:
            raise ValueError(f"invalid fault {text!r} ({exc}); {_FAULT_GRAMMAR}") from None

    def __str__(self) -> str:
        if self.kind == "status":
            return f"status={self.status}"
        text = f"{self.kind}-after={self.after}"
        if self.kind == "stall" and not math.isinf(self.seconds):
            text += f";seconds={self.seconds:g}"
        return text


def _strict_int(value: str) -> int:
    value = value.strip()
    if not _DIGITS.fullmatch(value):
        raise ValueError(f"expected a non-negative integer, got {value!r}")
    return int(value)


class ProviderRequest:
    """One recorded API call; the server thread updates its fields (under a lock) as it goes.

    `closed_at` is when the exchange ended: the response finished, the error frame was sent,
    the client hung up, or the server stopped. `tokens_generated` counts tokens produced so far
    (for a non-streaming call they are only sent, all at once, at the end). `fault` is the
    fault chosen for this call (the ``x-fake-fault`` header, else the provider's), and
    `fault_applied` whether the response got that far and misbehaved. `response_id` is the
    Responses API response a call made, read or cancelled (``resp_fake_1``), else None: a
    background response goes on generating after its POST hung up, and a re-attached GET
    generates nothing (`FakeProvider.output_tokens` sums a response's tokens over its calls).
    """

    def __init__(
        self,
        *,
        id: int,
        connection_id: int,
        path: str,
        api: str,
        body: dict[str, Any],
        stream: bool,
        tokens_planned: int,
        fault: Fault | None,
        signal: _Signal,
        response_id: str | None = None,
    ) -> None:
        self.id = id
        self.response_id = response_id
        self.connection_id = connection_id
        self.path = path
        self.api = api
        self.body = body
        self.stream = stream
        self.tokens_planned = tokens_planned
        self.tokens_generated = 0
        self.tokens_sent = 0
        self.finished = False
        self.error_sent = False
        self.connection_closed_early = False
        self.fault = fault
        self.fault_applied = False
        self.started_at = time.monotonic()
        self.closed_at: float | None = None
        self._signal = signal

    def __repr__(self) -> str:
        return (
            f"ProviderRequest(id={self.id}, api={self.api!r}, stream={self.stream}, "
            f"tokens_planned={self.tokens_planned}, tokens_generated={self.tokens_generated}, "
            f"tokens_sent={self.tokens_sent}, finished={self.finished}, "
            f"error_sent={self.error_sent}, "
            f"connection_closed_early={self.connection_closed_early}, "
            f"fault={None if self.fault is None else str(self.fault)!r}, "
            f"fault_applied={self.fault_applied}, closed_at={self.closed_at})"
        )

    def _is_closed(self) -> bool:
        return self.closed_at is not None

    def wait_closed(self, timeout: float = 10.0) -> bool:
        """Block until the exchange ended (either side closed or the response finished)."""
        return self._signal.wait(self._is_closed, timeout)

    async def await_closed(self, timeout: float = 10.0) -> bool:
        """Like `wait_closed`, without blocking the caller's event loop."""
        return await self._signal.wait_async(self._is_closed, timeout)

    def _count(self, *, generated: int = 0, sent: int = 0) -> None:
        with self._signal.lock:
            self.tokens_generated += generated
            self.tokens_sent += sent

    def _apply_fault(self) -> None:
        with self._signal.lock:
            self.fault_applied = True
            self._signal.notify()

    def _end(self, *, finished: bool = False, error: bool = False, early: bool = False) -> None:
        with self._signal.lock:
            if self.closed_at is not None:
                return
            self.finished = finished
            self.error_sent = error
            self.connection_closed_early = early
            self.closed_at = time.monotonic()
            self._signal.notify()
        logger.info("%s", self)

    def __str__(self) -> str:
        """The call in one line, as the provider run alone logs it when it ends."""
        ended = self.closed_at if self.closed_at is not None else time.monotonic()
        tokens = f"{self.tokens_generated} of {self.tokens_planned} tokens"
        if self.connection_closed_early:
            how = f"the client left after {tokens}"
        elif self.error_sent:
            how = f"an error after {tokens}"
        elif self.finished:
            how = f"{tokens}, finished"
        else:
            how = f"ended after {tokens}"
        fault = f"; fault {self.fault}" if self.fault_applied else ""
        stream = " (stream)" if self.stream else ""
        return f"#{self.id} {self.path}{stream}: {how} in {ended - self.started_at:.2f}s{fault}"


@dataclass(frozen=True)
class _Plan:
    tokens: int
    cut_by_max_tokens: bool
    seconds_per_token: float
    first_token_delay: float
    error_after: int | None
    include_usage: bool
    fault: Fault | None
    # The token index at which a reset, stall, garbage or truncate fault strikes.
    fault_at: int | None
    # What each token says: ``tok{i} `` for i in range(tokens), or what is left of that text
    # after a prefix the request gave (continue_final_message, Anthropic prefill).
    texts: tuple[str, ...] = ()
    # Tokens the request's prefix adds to the input tokens billed.
    prefix_tokens: int = 0


@dataclass(frozen=True)
class _HttpRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool
    query: str = ""


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _ClientGone(ConnectionError):
    pass


def _head(status: int, headers: list[tuple[str, str]], *, keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}", "server: fake-provider"]
    lines += [f"{name}: {value}" for name, value in headers]
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _full_response(
    status: int, body: bytes, content_type: str, *, keep_alive: bool, extra: list[tuple[str, str]]
) -> bytes:
    headers = [("content-type", content_type), ("content-length", str(len(body))), *extra]
    return _head(status, headers, keep_alive=keep_alive) + body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_ANTHROPIC_KINDS = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
_OPENAI_KINDS = {
    401: ("invalid_request_error", "invalid_api_key"),
    429: ("requests", "rate_limit_exceeded"),
}


def _error_json(api: str, status: int, message: str) -> dict[str, Any]:
    if api == ANTHROPIC_MESSAGES:
        default = "api_error" if status >= 500 else "invalid_request_error"
        kind = _ANTHROPIC_KINDS.get(status, default)
        return {"type": "error", "error": {"type": kind, "message": message}}
    default_kind = "server_error" if status >= 500 else "invalid_request_error"
    kind, code = _OPENAI_KINDS.get(status, (default_kind, None))
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class _Refused(Exception):
    """A request the provider refuses with ``status`` and its own JSON error ``payload``."""

    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        super().__init__(status, payload)
        self.status = status
        self.payload = payload


# vLLM's ChatCompletionRequest.check_generation_prompt (vllm/entrypoints/openai/protocol.py),
# answered as a 400 in vLLM's error shape.
_VLLM_BOTH_FLAGS = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


def _vllm_error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}


# Anthropic's 400 invalid_request_error messages, as the API returns them (quoted in many
# client bug reports): a final assistant message is a prefill the answer continues.
_ANTHROPIC_TRAILING_WHITESPACE = (
    "messages: final assistant content cannot end with trailing whitespace"
)
_ANTHROPIC_THINKING_PREFILL = (
    "Expected `thinking` or `redacted_thinking`, but found `text`. When `thinking` is enabled,"
    " a final `assistant` message must start with a thinking block (preceeding the lastmost set"
    " of `tool_use` and `tool_result` blocks). We recommend you include thinking blocks from"
    " previous turns. To avoid this requirement, disable `thinking`. Please consult our"
    " documentation at https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
)
_ANTHROPIC_NO_PREFILL = (
    "This model does not support assistant message prefill."
    " The conversation must end with a user message."
)
# Anthropic's migration guide: "Prefilling assistant messages returns a 400 error on Claude
# 4.6 models" (Opus 4.6, Sonnet 4.6).
DEFAULT_PREFILL_REFUSED_MODELS = frozenset({"claude-opus-4-6", "claude-sonnet-4-6"})


def _anthropic_invalid(message: str) -> dict[str, Any]:
    return _error_json(ANTHROPIC_MESSAGES, 400, message)


def _model_in(model: str, names: frozenset[str]) -> bool:
    """``model`` is one of ``names`` or a dated version of one (``claude-opus-4-6-20260101``)."""
    return any(model == name or model.startswith(name + "-") for name in names)


def _text_of(content: object) -> str:
    """A message's text: a string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


# How this fake tokenizes any text: a piece ends after each space, and a last piece may have
# none; "tok0 tok1 to" is the three tokens "tok0 ", "tok1 " and "to".
_PIECES = re.compile(r"[^ ]* |[^ ]+")


def _continuation(prefix: str, tokens: int) -> tuple[tuple[str, ...], int]:
    """What an answer of ``tokens`` tokens streams after ``prefix``, and the prefix's tokens.

    When the prefix starts the whole text T (``tok0 tok1 … tok{n-1} ``), the rest of T, split
    where T's tokens end (the first piece may be the rest of a token the prefix cut). Otherwise
    the answer goes on from as many tokens as the prefix has whole (space-ended) pieces: after
    "hello world " it streams ``tok2 tok3 …``.
    """
    full = [_token_text(index) for index in range(tokens)]
    pieces = _PIECES.findall(prefix)
    if "".join(full).startswith(prefix):
        rest: list[str] = []
        consumed = 0
        for text in full:
            if consumed + len(text) > len(prefix):
                rest.append(text[max(len(prefix) - consumed, 0) :])
            consumed += len(text)
        return tuple(rest), len(pieces)
    whole = sum(1 for piece in pieces if piece.endswith(" "))
    return tuple(full[whole:]), len(pieces)


def _fault_message(api: str, status: int, model: str) -> str:
    """What the provider says for that status, near enough to the real messages."""
    if status == 429:
        if api == ANTHROPIC_MESSAGES:
            return "This request would exceed your organization's rate limit."
        return (
            f"Rate limit reached for {model} in organization org-fake on requests per min "
            "(RPM): Limit 3, Used 3, Requested 1. Please try again in 20s."
        )
    if status == 529:
        return "Overloaded"
    if status >= 500:
        if api == ANTHROPIC_MESSAGES:
            return "Internal server error"
        return "The server had an error while processing your request. Sorry about that!"
    return f"The request was refused with {status} (injected by x-fake-fault)."


class _Format(Protocol):
    def preamble(self) -> list[bytes]: ...
    def token(self, text: str) -> bytes: ...
    def epilogue(self, plan: _Plan) -> list[bytes]: ...
    def error_frame(self) -> bytes: ...
    def error_response(self) -> tuple[int, dict[str, Any]]: ...
    def complete(self, plan: _Plan) -> dict[str, Any]: ...


class _OpenAIChat:
    def __init__(self, request_id: int, model: str, input_tokens: int) -> None:
        self._id = f"chatcmpl-fake{request_id:08d}"
        self._created = int(time.time())
        self._model = model
        self._input_tokens = input_tokens

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        chunk = {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "system_fingerprint": "fp_fake",
            "choices": choices,
            **extra,
        }
        return b"data: " + _dumps(chunk) + b"\n\n"

    @staticmethod
    def _choice(delta: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
        return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]

    def _usage(self, plan: _Plan) -> dict[str, int]:
        total = self._input_tokens + plan.tokens
        return {
            "prompt_tokens": self._input_tokens,
            "completion_tokens": plan.tokens,
            "total_tokens": total,
        }

    def preamble(self) -> list[bytes]:
        delta = {"role": "assistant", "content": "", "refusal": None}
        return [self._event(self._choice(delta, None))]

    def token(self, text: str) -> bytes:
        return self._event(self._choice({"content": text}, None))

    def epilogue(self, plan: _Plan) -> list[bytes]:
        finish = "length" if plan.cut_by_max_tokens else "stop"
        frames = [self._event(self._choice({}, finish))]
        if plan.include_usage:
            frames.append(self._event([], usage=self._usage(plan)))
        frames.append(b"data: [DONE]\n\n")
        return frames

    def error_frame(self) -> bytes:
        message = "The server had an error while processing your request. Sorry about that!"
        return b"data: " + _dumps({"error": {"message": message, "type": "server_error"}}) + b"\n\n"

    def error_response(self) -> tuple[int, dict[str, Any]]:
        message = "The server had an error while processing your request. Sorry about that!"
        return 500, _error_json(OPENAI_CHAT, 500, message)

    def complete(self, plan: _Plan) -> dict[str, Any]:
        text = "".join(plan.texts)
        return {
            "id": self._id,
            "object": "chat.completion",
            "created": self._created,
            "model": self._model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "length" if plan.cut_by_max_tokens else "stop",
                }
            ],
            "usage": self._usage(plan),
            "system_fingerprint": "fp_fake",
        }


class _AnthropicMessages:
    def __init__(self, request_id: int, model: str, input_tokens: int) -> None:
        self._id = f"msg_fake{request_id:08d}"
        self._model = model
        self._input_tokens = input_tokens

    @staticmethod
    def _event(name: str, data: bytes) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None) -> dict[str, Any]:
        return {
            "model": self._model,
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
        }

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {
            "input_tokens": self._input_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": output_tokens,
        }

    @staticmethod
    def _stop_reason(plan: _Plan) -> str:
        return "max_tokens" if plan.cut_by_max_tokens else "end_turn"

    def preamble(self) -> list[bytes]:
        message = {**self._message([], None), "usage": self._usage(1)}
        text_block = {"type": "text", "text": ""}
        block = {"type": "content_block_start", "index": 0, "content_block": text_block}
        return [
            self._event("message_start", _dumps({"type": "message_start", "message": message})),
            self._event("content_block_start", _dumps(block)),
            # The live API sends this one frame with a space after the colon.
            self._event("ping", b'{"type": "ping"}'),
        ]

    def token(self, text: str) -> bytes:
        delta = {"type": "text_delta", "text": text}
        return self._event(
            "content_block_delta",
            _dumps({"type": "content_block_delta", "index": 0, "delta": delta}),
        )

    def epilogue(self, plan: _Plan) -> list[bytes]:
        delta = {"stop_reason": self._stop_reason(plan), "stop_sequence": None}
        message_delta = {"type": "message_delta", "delta": delta, "usage": self._usage(plan.tokens)}
        return [
            self._event("content_block_stop", _dumps({"type": "content_block_stop", "index": 0})),
            self._event("message_delta", _dumps(message_delta)),
            self._event("message_stop", _dumps({"type": "message_stop"})),
        ]

    def error_frame(self) -> bytes:
        return self._event("error", _dumps(self.error_response()[1]))

    def error_response(self) -> tuple[int, dict[str, Any]]:
        return 529, _error_json(ANTHROPIC_MESSAGES, 529, "Overloaded")

    def complete(self, plan: _Plan) -> dict[str, Any]:
        text = "".join(plan.texts)
        message = self._message([{"type": "text", "text": text}], self._stop_reason(plan))
        return {**message, "usage": self._usage(plan.tokens)}


# OpenAI Responses API (POST /v1/responses). The stream's events follow a recorded real one
# (tests/data/openai_responses_text.sse) plus the `sequence_number` every event now carries.
_DELTA_EVENT = b"event: response.output_text.delta\n"
_TERMINAL = ("completed", "incomplete", "cancelled", "failed")
# OpenAI's 404 for an unknown or expired response id (as quoted by a user of the API).
_RESPONSE_NOT_FOUND = "Response with id '{}' not found."
# OpenAI's 400 for GET ?stream=true on a response made without background=true (the body is
# quoted in openai/openai-ruby#214).
_NOT_STREAMABLE = (
    "This response cannot be streamed because it was not created with background=true."
)
# Not verified: the wording of OpenAI's refusals of background without store, and of a cancel
# of a response made without background, was not found; the rules themselves are documented.
_BACKGROUND_NEEDS_STORE = "Background mode requires store=true."
_CANCEL_NOT_BACKGROUND = "Only responses created with background=true can be cancelled."


def _openai_error(
    message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


class _ResponseRun:
    """One Responses API response: the events generated so far (each one whole SSE event, kept
    so a re-attached reader gets the very bytes the first one got), its status and the task
    generating it. Lives on the provider's event loop."""

    def __init__(
        self,
        *,
        number: int,
        model: str,
        created_at: int,
        body: dict[str, Any],
        plan: _Plan,
        input_tokens: int,
        record: ProviderRequest,
        queued_forever: bool,
    ) -> None:
        self.id = f"resp_fake_{number}"
        self.item_id = f"msg_fake_{number}"
        self.model = model
        self.created_at = created_at
        self.body = body
        self.plan = plan
        self.input_tokens = input_tokens
        self.record = record
        self.queued_forever = queued_forever
        self.background = body.get("background") is True
        self.store = body.get("store") is not False
        self.status = "queued" if self.background or queued_forever else "in_progress"
        self.text = ""
        self.item_status: str | None = None  # no output item yet
        self.content_started = False
        self.events: list[bytes] = []
        self.ended_at: float | None = None
        self.task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    def emit(self, kind: str, **fields: Any) -> None:
        event = {"type": kind, "sequence_number": len(self.events), **fields}
        self.events.append(b"event: " + kind.encode() + b"\ndata: " + _dumps(event) + b"\n\n")
        self._notify()

    def end(self, status: str) -> None:
        if self.ended:
            return
        self.status = status
        self.ended_at = time.monotonic()
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def changed(self, seen: int) -> None:
        """Return once there are more than ``seen`` events or the response ended."""
        wake = self._wake
        if len(self.events) > seen or self.ended:
            return
        await wake.wait()

    def _part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def item(self) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.item_id,
            "status": self.item_status,
            "role": "assistant",
            "content": [self._part()] if self.content_started else [],
        }

    def usage(self) -> dict[str, Any]:
        output = self.plan.tokens
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + output,
        }

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands."""
        instructions = self.body.get("instructions")
        max_output_tokens = self.body.get("max_output_tokens")
        done = self.status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": self.background,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if self.status == "incomplete" else None
            ),
            "instructions": instructions if isinstance(instructions, str) else None,
            "max_output_tokens": max_output_tokens if isinstance(max_output_tokens, int) else None,
            "model": self.model,
            "output": [] if self.item_status is None else [self.item()],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "store": self.store,
            "temperature": 1.0,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": self.usage() if done else None,
            "user": None,
            "metadata": {},
        }

    async def generate(self) -> None:
        """Make the response's events at the plan's pace, independent of any connection."""
        plan = self.plan
        self.emit("response.created", response=self.snapshot())
        if self.status == "queued":
            self.emit("response.queued", response=self.snapshot())
        if self.queued_forever:
            await asyncio.Future()  # a known provider fault: it never leaves the queue
        self.status = "in_progress"
        self.emit("response.in_progress", response=self.snapshot())
        self.item_status = "in_progress"
        self.emit("response.output_item.added", output_index=0, item=self.item())
        self.content_started = True
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        part = {"type": "output_text", "text": "", "annotations": []}
        self.emit("response.content_part.added", **where, part=part)
        start = asyncio.get_running_loop().time() + plan.first_token_delay
        for index, text in enumerate(plan.texts):
            await _sleep_until(start + index * plan.seconds_per_token)
            self.record._count(generated=1)
            self.text += text
            self.emit("response.output_text.delta", **where, delta=text)
        status = "incomplete" if plan.cut_by_max_tokens else "completed"
        self.emit("response.output_text.done", **where, text=self.text)
        self.emit("response.content_part.done", **where, part=self._part())
        self.item_status = status
        self.emit("response.output_item.done", output_index=0, item=self.item())
        self.status = status
        self.emit(f"response.{status}", response=self.snapshot())
        self.end(status)


async def _follow(
    connection: _Connection,
    run: _ResponseRun,
    record: ProviderRequest,
    start: int,
    keep_alive: bool,
) -> bool:
    """Stream ``run``'s events from index ``start``: the kept ones, then the live ones until
    it ends (completed, incomplete or cancelled: then the body just ends)."""
    headers = [
        ("content-type", "text/event-stream"),
        ("cache-control", "no-cache"),
        ("transfer-encoding", "chunked"),
        ("x-request-id", f"req_fake_{record.id}"),
    ]
    await connection.send(_head(200, headers, keep_alive=keep_alive))
    index = start
    while True:
        while index < len(run.events):
            event = run.events[index]
            index += 1
            await connection.send(_chunk(event))
            if event.startswith(_DELTA_EVENT):
                record._count(sent=1)
        if run.ended:
            break
        await run.changed(index)
    record._end(finished=run.status in ("completed", "incomplete"))
    await connection.send(b"0\r\n\r\n")
    return keep_alive


async def _watched(
    connection: _Connection, record: ProviderRequest, work: Coroutine[Any, Any, bool]
) -> bool:
    """Run ``work`` (which answers on ``connection``) until it ends or the client hangs up;
    return whether the connection stays open for another request."""
    producer = asyncio.create_task(work)
    hang_up = asyncio.create_task(connection.gone.wait())
    try:
        await asyncio.wait((producer, hang_up), return_when=asyncio.FIRST_COMPLETED)
    finally:
        hang_up.cancel()
        producer.cancel()
        await asyncio.wait((producer,))
        record._end(early=not connection.server_closing)
    if producer.cancelled():
        return False
    error = producer.exception()
    if error is None:
        return producer.result()
    if not isinstance(error, ConnectionError):
        raise error
    return False


class _Connection:
    """One client connection; a background reader notices the client hanging up at any time."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, connection_id: int
    ) -> None:
        self.id = connection_id
        self.writer = writer
        self.gone = asyncio.Event()
        self.server_closing = False
        self._reader = reader
        self._buffer = bytearray()
        self._changed = asyncio.Event()
        # A zero high-water mark makes drain() wait until the kernel accepted every byte.
        writer.transport.set_write_buffer_limits(high=0)
        self._read_task = asyncio.create_task(self._read_forever())

    async def _read_forever(self) -> None:
        try:
            while chunk := await self._reader.read(65536):
                self._buffer += chunk
                self._changed.set()
        except OSError:
            pass
        finally:
            self.gone.set()
            self._changed.set()

    async def _wait_for(self, predicate: Callable[[], bool]) -> bool:
        while not predicate():
            if self.gone.is_set():
                return False
            self._changed.clear()
            await self._changed.wait()
        return True

    async def read_request(self) -> _HttpRequest | None:
        """The next request, or None when the client closed the connection first."""

        def head_arrived() -> bool:
            del self._buffer[: len(self._buffer) - len(self._buffer.lstrip(b"\r\n"))]
            if self._buffer.find(b"\r\n\r\n") < 0 and len(self._buffer) > _MAX_HEAD:
                raise _HttpError(431, "request head too large")
            return self._buffer.find(b"\r\n\r\n") >= 0

        if not await self._wait_for(head_arrived):
            return None
        end = self._buffer.find(b"\r\n\r\n")
        head = bytes(self._buffer[:end]).decode("latin-1")
        del self._buffer[: end + 4]
        method, target, version, headers = _parse_head(head)
        path, _, query = target.partition("?")
        length = _content_length(headers)
        if headers.get("expect", "").lower() == "100-continue":
            await self.send(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not await self._wait_for(lambda: len(self._buffer) >= length):
            return None
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        tokens = {token.strip().lower() for token in headers.get("connection", "").split(",")}
        keep_alive = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
        return _HttpRequest(method, path, headers, body, keep_alive, query)

    async def send(self, data: bytes) -> None:
        # Writing to a closed transport only logs warnings, so fail like a socket would.
        if self.writer.transport.is_closing():
            raise _ClientGone("connection closed")
        self.writer.write(data)
        try:
            await self.writer.drain()
        except OSError as exc:
            raise _ClientGone(str(exc)) from exc

    def abort(self) -> None:
        self.server_closing = True
        self.writer.transport.abort()

    async def reset(self) -> None:
        """Close with a TCP RST (``SO_LINGER`` 0) once the bytes written so far left."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            await _wait_unsent(sock)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    async def close(self) -> None:
        self._read_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._read_task
        transport = self.writer.transport
        if transport.get_write_buffer_size() or self.gone.is_set():
            transport.abort()
        else:
            self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def _parse_head(head: str) -> tuple[str, str, str, dict[str, str]]:
    request_line, *lines = head.split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise _HttpError(400, f"malformed request line {request_line!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise _HttpError(400, f"malformed header line {line!r}")
        headers[name.lower()] = value.strip()
    method, target, version = parts
    return method, target, version, headers


def _content_length(headers: dict[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise _HttpError(411, "chunked request bodies are not supported; send Content-Length")
    value = headers.get("content-length", "0")
    if not _DIGITS.fullmatch(value):
        raise _HttpError(400, f"invalid Content-Length {value!r}")
    if int(value) > _MAX_BODY:
        raise _HttpError(413, "request body too large")
    return int(value)


def _header_number(headers: dict[str, str], name: str, default: float) -> float:
    raw = headers.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _HttpError(400, f"header {name} must be a number, got {raw!r}") from None
    if value < 0 or math.isnan(value):
        raise _HttpError(400, f"header {name} must not be negative, got {raw!r}")
    return value


def _header_flag(headers: dict[str, str], name: str) -> bool:
    raw = headers.get(name, "0").strip().lower()
    if raw not in ("0", "1", "true", "false"):
        raise _HttpError(400, f"header {name} must be 1 or 0, got {raw!r}")
    return raw in ("1", "true")


def _check_responses_body(headers: dict[str, str], body: dict[str, Any]) -> None:
    """The Responses API's own request rules (a `_Refused` in its error shape)."""
    del headers
    text = body.get("input")
    if text is not None and not isinstance(text, str | list):
        message = "Invalid type for 'input': expected one of a string or array of input items."
        raise _Refused(400, _openai_error(message, param="input", code="invalid_type"))
    # Documented: background mode requires store=true (store defaults to true).
    if body.get("background") is True and body.get("store") is False:
        raise _Refused(400, _openai_error(_BACKGROUND_NEEDS_STORE, param="background"))


def _header_count(headers: dict[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    if not _DIGITS.fullmatch(raw.strip()):
        raise _HttpError(400, f"header {name} must be a non-negative integer, got {raw!r}")
    return int(raw)


async def _wait_unsent(sock: Any, timeout: float = 1.0) -> None:
    """Wait until the kernel sent what was written: a reset discards bytes still queued."""
    try:
        import fcntl
        import termios
    except ImportError:  # not Linux-like: reset at once
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))
        except OSError:
            return
        if queued[0] == 0:
            return
        await asyncio.sleep(0.001)


async def _sleep_until(deadline: float) -> None:
    delay = deadline - asyncio.get_running_loop().time()
    # Always yield, so a zero-delay stream still lets the reader notice a hang-up.
    await asyncio.sleep(max(delay, 0.0))


def _quiet_exception_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    if isinstance(context.get("exception"), ConnectionError | asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


class FakeProvider:
    """A fake OpenAI/Anthropic streaming endpoint running its own event loop in a daemon thread.

    Routes: ``POST /v1/chat/completions`` (OpenAI Chat Completions), ``POST /v1/messages``
    (Anthropic Messages), ``POST /v1/responses`` (OpenAI Responses, ``input`` not
    ``messages``), all streaming with ``"stream": true``; ``GET /v1/responses/{id}`` (the
    response object, or with ``?stream=true&starting_after=N`` a background response's events
    after sequence number N), ``POST /v1/responses/{id}/cancel``; ``GET /health``.

    A background response is kept ``background_ttl`` seconds after it ends (then 404);
    ``queued_forever`` (or ``x-fake-queued: 1``) leaves Responses API responses queued for
    ever; ``prefill_refused_models`` are the models that answer an Anthropic prefill with a
    400 (default: the Claude 4.6 models); ``created_at`` fixes the Responses API timestamp, so
    two providers stream the same bytes. `output_tokens` tells a response's billed tokens.

    Per-request overrides (request headers): ``x-fake-tokens``, ``x-fake-rate`` (tokens/s,
    0 or ``inf`` for as fast as possible), ``x-fake-first-token-delay`` (seconds),
    ``x-fake-error-after`` (send the provider's mid-stream error frame after that many tokens)
    and ``x-fake-fault`` (a ``Fault`` in its text form, ``reset-after=20``, or ``none``),
    which replaces the provider's ``fault`` for that request, so one provider serves a mix.
    """

    def __init__(
        self,
        *,
        tokens: int = 50,
        tokens_per_second: float = 200.0,
        first_token_delay: float = 0.0,
        input_tokens: int = 12,
        model: str = "fake-model",
        fault: Fault | str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        background_ttl: float = 600.0,
        queued_forever: bool = False,
        prefill_refused_models: frozenset[str] | set[str] = DEFAULT_PREFILL_REFUSED_MODELS,
        created_at: int | None = None,
    ) -> None:
        self.tokens = tokens
        self.tokens_per_second = tokens_per_second
        self.first_token_delay = first_token_delay
        self.input_tokens = input_tokens
        self.model = model
        self.fault = Fault.parse(fault) if isinstance(fault, str) else fault
        self.host = host
        self.port = port
        self.background_ttl = background_ttl
        self.queued_forever = queued_forever
        self.prefill_refused_models = frozenset(prefill_refused_models)
        self.created_at = created_at
        self._runs: dict[str, _ResponseRun] = {}
        self._response_numbers = itertools.count(1)
        self._generations: set[asyncio.Task[None]] = set()
        self._signal = _Signal()
        self._requests: list[ProviderRequest] = []
        self._request_ids = itertools.count(1)
        self._connection_ids = itertools.count(1)
        self._lifecycle = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._startup_error: BaseException | None = None
        self._bound_port: int | None = None
        self._connections: dict[_Connection, asyncio.Task[Any]] = {}

    # lifecycle

    def start(self) -> FakeProvider:
        """Start listening (idempotent) and return self."""
        with self._lifecycle:
            if self._thread is not None:
                return self
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            self._startup_error = None
            thread = threading.Thread(
                target=self._run, args=(loop, ready), name="FakeProvider", daemon=True
            )
            thread.start()
            ready.wait()
            if self._startup_error is not None:
                thread.join()
                raise self._startup_error
            self._thread, self._loop = thread, loop
        return self

    def stop(self) -> None:
        """Close the listener and every open connection; idempotent."""
        with self._lifecycle:
            thread, loop, stopping = self._thread, self._loop, self._stopping
            self._thread = self._loop = None
            if thread is None or loop is None or stopping is None:
                return
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stopping.set)
            thread.join(timeout=30)

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> FakeProvider:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def url(self) -> str:
        if self._bound_port is None or self._thread is None:
            raise RuntimeError("FakeProvider is not running; call start() first")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._bound_port}"

    # recorded requests

    @property
    def requests(self) -> list[ProviderRequest]:
        with self._signal.lock:
            return list(self._requests)

    def reset(self) -> None:
        with self._signal.lock:
            self._requests.clear()

    def output_tokens(self, response_id: str) -> int:
        """Output tokens generated (billed) for a Responses API response over all its calls:
        the POST that made it, however it ended, plus any GET or cancel (which make none)."""
        with self._signal.lock:
            return sum(r.tokens_generated for r in self._requests if r.response_id == response_id)

    def _has_requests(self, n: int) -> Callable[[], bool]:
        return lambda: len(self._requests) >= n

    def wait_for_requests(self, n: int, timeout: float = 10.0) -> list[ProviderRequest]:
        """Block until `n` requests arrived; return the first `n`."""
        if not self._signal.wait(self._has_requests(n), timeout):
            raise TimeoutError(f"{len(self._requests)} of {n} requests arrived within {timeout}s")
        return self.requests[:n]

    async def await_requests(self, n: int, timeout: float = 10.0) -> list[ProviderRequest]:
        """Like `wait_for_requests`, without blocking the caller's event loop."""
        if not await self._signal.wait_async(self._has_requests(n), timeout):
            raise TimeoutError(f"{len(self._requests)} of {n} requests arrived within {timeout}s")
        return self.requests[:n]

    # server thread

    def _run(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        loop.set_exception_handler(_quiet_exception_handler)
        try:
            loop.run_until_complete(self._serve(ready))
        except Exception as exc:  # reported to start() when listening failed
            self._startup_error = exc
        finally:
            ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self, ready: threading.Event) -> None:
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._handle, self.host, self.port)
        self._bound_port = server.sockets[0].getsockname()[1]
        ready.set()
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for connection in self._connections:
                connection.abort()
            for generation in list(self._generations):
                generation.cancel()
            # Aborting wakes every handler (and late ones abort themselves); cancelling them
            # instead trips a 3.11 streams bug that logs the CancelledError.
            others = asyncio.all_tasks() - {asyncio.current_task()}
            if others:
                _, stuck = await asyncio.wait(others, timeout=5.0)
                for task in stuck:
                    task.cancel()
            await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._stopping is None or self._stopping.is_set():
            writer.transport.abort()
            return
        connection = _Connection(reader, writer, next(self._connection_ids))
        self._connections[connection] = task
        try:
            while await self._serve_one(connection):
                pass
        except _HttpError as exc:
            body = _dumps(_error_json(OPENAI_CHAT, exc.status, exc.message))
            response = _full_response(
                exc.status, body, "application/json", keep_alive=False, extra=[]
            )
            with contextlib.suppress(ConnectionError):
                await connection.send(response)
        except ConnectionError:
            pass
        finally:
            del self._connections[connection]
            await connection.close()

    async def _serve_one(self, connection: _Connection) -> bool:
        """Answer one request; return whether the connection stays open for another."""
        request = await connection.read_request()
        if request is None:
            return False
        if request.method == "GET" and request.path == "/health":
            await connection.send(
                _full_response(
                    200, b"ok", "text/plain; charset=utf-8", keep_alive=request.keep_alive, extra=[]
                )
            )
            return request.keep_alive
        stored = _RESPONSE_PATH.fullmatch(request.path)
        # GET /v1/responses/{id}, POST /v1/responses/{id}/cancel
        cancel = stored is not None and stored.group(2) is not None
        if stored is not None and request.method == ("POST" if cancel else "GET"):
            return await self._stored_response(connection, request, stored.group(1))
        api = _ROUTES.get(request.path) if request.method == "POST" else None
        if api is None:
            shape = ANTHROPIC_MESSAGES if "anthropic-version" in request.headers else OPENAI_CHAT
            message = (
                "Not Found"
                if shape == ANTHROPIC_MESSAGES
                else (f"Invalid URL ({request.method} {request.path})")
            )
            return await self._send_error(connection, request, shape, 404, message)
        try:
            body = json.loads(request.body)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            message = "We could not parse the JSON body of your request."
            return await self._send_error(connection, request, api, 400, message)
        try:
            if api == OPENAI_RESPONSES:
                _check_responses_body(request.headers, body)
            plan = self._plan(request.headers, body, api)
        except _HttpError as exc:
            return await self._send_error(connection, request, api, exc.status, exc.message)
        except _Refused as exc:
            return await self._send_json(connection, request, exc.status, exc.payload)
        if api == OPENAI_RESPONSES:
            return await self._create_response(connection, request, body, plan)
        record = self._record(connection, request.path, api, body, plan)
        input_tokens = self.input_tokens + plan.prefix_tokens
        response = _Response(connection, record, plan, self.model, input_tokens)
        return await response.run(request.keep_alive)

    async def _send_json(
        self,
        connection: _Connection,
        request: _HttpRequest,
        status: int,
        payload: dict[str, Any],
        extra: list[tuple[str, str]] | None = None,
    ) -> bool:
        response = _full_response(
            status,
            _dumps(payload),
            "application/json",
            keep_alive=request.keep_alive,
            extra=extra or [],
        )
        await connection.send(response)
        return request.keep_alive

    # Responses API

    def _lookup(self, response_id: str) -> _ResponseRun | None:
        """The stored response, or None if unknown or kept past `background_ttl`."""
        run = self._runs.get(response_id)
        ended_at = None if run is None else run.ended_at
        if ended_at is not None and time.monotonic() - ended_at >= self.background_ttl:
            del self._runs[response_id]
            return None
        return run

    async def _create_response(
        self, connection: _Connection, request: _HttpRequest, body: dict[str, Any], plan: _Plan
    ) -> bool:
        fault = plan.fault
        if (fault is not None and fault.kind != "status") or plan.error_after is not None:
            message = "/v1/responses takes only x-fake-fault: status=CODE (other faults: not yet)."
            return await self._send_error(connection, request, OPENAI_RESPONSES, 400, message)
        try:
            queued = self.queued_forever or _header_flag(request.headers, "x-fake-queued")
        except _HttpError as exc:
            return await self._send_error(connection, request, OPENAI_RESPONSES, 400, exc.message)
        number = next(self._response_numbers)
        record = self._record(
            connection, request.path, OPENAI_RESPONSES, body, plan, f"resp_fake_{number}"
        )
        if plan.fault is not None and plan.fault.kind == "status":
            status = plan.fault.status
            payload = _error_json(
                OPENAI_RESPONSES, status, _fault_message(OPENAI_CHAT, status, self.model)
            )
            extra = [("x-request-id", f"req_fake_{record.id}")]
            if status in (429, 503, 529):
                extra.append(("retry-after", "1"))
            record._apply_fault()
            record._end(error=True)
            return await self._send_json(connection, request, status, payload, extra)
        created_at = int(time.time()) if self.created_at is None else self.created_at
        run = _ResponseRun(
            number=number,
            model=self.model,
            created_at=created_at,
            body=body,
            plan=plan,
            input_tokens=self.input_tokens,
            record=record,
            queued_forever=queued,
        )
        if run.store:
            self._runs[run.id] = run
        task = asyncio.create_task(run.generate())
        run.task = task
        self._generations.add(task)
        task.add_done_callback(self._generations.discard)
        if run.background and not record.stream:
            # Background: answered at once (status "queued"); the generation goes on alone.
            record._end(finished=True)
            extra = [("x-request-id", f"req_fake_{record.id}")]
            return await self._send_json(connection, request, 200, run.snapshot(), extra)
        if record.stream:
            work = _follow(connection, run, record, 0, request.keep_alive)
        else:
            work = self._answer_when_done(connection, request, run, record)
        keep_alive = await _watched(connection, record, work)
        if not run.background and not run.ended:  # the client left: the generation stops
            task.cancel()
            run.end("cancelled")
        return keep_alive

    async def _answer_when_done(
        self,
        connection: _Connection,
        request: _HttpRequest,
        run: _ResponseRun,
        record: ProviderRequest,
    ) -> bool:
        while not run.ended:
            await run.changed(len(run.events))
        body = _dumps(run.snapshot())
        extra = [("x-request-id", f"req_fake_{record.id}")]
        response = _full_response(
            200, body, "application/json", keep_alive=request.keep_alive, extra=extra
        )
        await connection.send(response[:-1])
        record._count(sent=run.plan.tokens)
        record._end(finished=True)
        await connection.send(response[-1:])
        return request.keep_alive

    async def _stored_response(
        self, connection: _Connection, request: _HttpRequest, response_id: str
    ) -> bool:
        """``GET /v1/responses/{id}[?stream=true&starting_after=N]`` and
        ``POST /v1/responses/{id}/cancel``."""
        run = self._lookup(response_id)
        if run is None:
            payload = _openai_error(_RESPONSE_NOT_FOUND.format(response_id))
            return await self._send_json(connection, request, 404, payload)
        query = urllib.parse.parse_qs(request.query)
        stream = request.method == "GET" and query.get("stream", [""])[-1] == "true"
        start = 0
        if stream:
            if not run.background:
                payload = _openai_error(
                    _NOT_STREAMABLE, param="stream", code="invalid_request_error"
                )
                return await self._send_json(connection, request, 400, payload)
            after = query.get("starting_after", [None])[-1]
            if after is not None:
                if not _DIGITS.fullmatch(after):
                    message = f"Invalid 'starting_after': expected an integer, got {after!r}."
                    payload = _openai_error(message, param="starting_after")
                    return await self._send_json(connection, request, 400, payload)
                start = int(after) + 1
        if request.method == "POST" and not run.background:
            payload = _openai_error(_CANCEL_NOT_BACKGROUND)
            return await self._send_json(connection, request, 400, payload)
        record = ProviderRequest(
            id=next(self._request_ids),
            connection_id=connection.id,
            path=request.path,
            api=OPENAI_RESPONSES,
            body={},
            stream=stream,
            tokens_planned=0,
            fault=None,
            signal=self._signal,
            response_id=run.id,
        )
        with self._signal.lock:
            self._requests.append(record)
            self._signal.notify()
        if stream:
            return await _watched(
                connection, record, _follow(connection, run, record, start, request.keep_alive)
            )
        if request.method == "POST" and not run.ended:
            # Cancelling twice is idempotent; a re-attached stream just ends.
            if run.task is not None:
                run.task.cancel()
            run.end("cancelled")
        record._end(finished=True)
        return await self._send_json(connection, request, 200, run.snapshot())

    async def _send_error(
        self, connection: _Connection, request: _HttpRequest, api: str, status: int, message: str
    ) -> bool:
        body = _dumps(_error_json(api, status, message))
        await connection.send(
            _full_response(
                status, body, "application/json", keep_alive=request.keep_alive, extra=[]
            )
        )
        return request.keep_alive

    def _plan(self, headers: dict[str, str], body: dict[str, Any], api: str) -> _Plan:
        override = _header_count(headers, "x-fake-tokens")
        planned = self.tokens if override is None else override
        texts = tuple(_token_text(index) for index in range(planned))
        prefix_tokens = 0
        prefix = self._prefix(api, body)
        if prefix is not None:
            texts, prefix_tokens = _continuation(prefix, planned)
        tokens = len(texts)
        if api == OPENAI_RESPONSES:
            max_tokens = body.get("max_output_tokens")
        else:
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        cut = False
        if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
            cut = 0 <= max_tokens < tokens
            tokens = min(tokens, max_tokens) if cut else tokens
            texts = texts[:tokens]
        rate = _header_number(headers, "x-fake-rate", self.tokens_per_second)
        error_after = _header_count(headers, "x-fake-error-after")
        if error_after is not None and error_after > tokens:
            error_after = None
        fault = self.fault
        raw_fault = headers.get("x-fake-fault")
        if raw_fault is not None:
            try:
                fault = Fault.parse(raw_fault)
            except ValueError as exc:
                raise _HttpError(400, f"header x-fake-fault: {exc}") from None
        fault_at = None
        if fault is not None and fault.kind == "error":
            error_after = min(fault.after, tokens)
        elif fault is not None and fault.kind != "status":
            fault_at = min(fault.after, tokens)
        options = body.get("stream_options")
        return _Plan(
            tokens=tokens,
            cut_by_max_tokens=cut,
            seconds_per_token=0.0 if rate in (0.0, math.inf) else 1.0 / rate,
            first_token_delay=_header_number(
                headers, "x-fake-first-token-delay", self.first_token_delay
            ),
            error_after=error_after,
            include_usage=isinstance(options, dict) and options.get("include_usage") is True,
            fault=fault,
            fault_at=fault_at,
            texts=texts,
            prefix_tokens=prefix_tokens,
        )

    def _prefix(self, api: str, body: dict[str, Any]) -> str | None:
        """The text of a final assistant message the answer continues, or None; a
        `_Refused` for a request shape the provider refuses."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
            last: dict[str, Any] = {}
        else:
            last = messages[-1]
        if api == OPENAI_CHAT:
            if not body.get("continue_final_message"):
                return None  # a final assistant message is only context
            # vLLM's check_generation_prompt, on the raw body: only an explicit true clashes.
            if body.get("add_generation_prompt"):
                raise _Refused(400, _vllm_error(_VLLM_BOTH_FLAGS))
            if last.get("role") != "assistant":
                # Our wording: vLLM's own refusal for this case was not found.
                message = "continue_final_message needs a final message with role 'assistant'."
                raise _Refused(400, _vllm_error(message))
            return _text_of(last.get("content"))
        if api != ANTHROPIC_MESSAGES or last.get("role") != "assistant":
            return None
        content = last.get("content")
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        texts = [
            block["text"]
            for block in blocks
            if isinstance(block, dict) and isinstance(block.get("text"), str)
        ]
        # The order of these checks is ours; the API's own order is not documented.
        if texts and texts[-1] != texts[-1].rstrip():
            raise _Refused(400, _anthropic_invalid(_ANTHROPIC_TRAILING_WHITESPACE))
        thinking = body.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive"):
            index = len(messages) - 1 if isinstance(messages, list) else 0
            message = f"messages.{index}.content.0.type: {_ANTHROPIC_THINKING_PREFILL}"
            raise _Refused(400, _anthropic_invalid(message))
        model = body.get("model")
        model = model if isinstance(model, str) else self.model
        if _model_in(model, self.prefill_refused_models):
            raise _Refused(400, _anthropic_invalid(_ANTHROPIC_NO_PREFILL))
        return "".join(texts)

    def _record(
        self,
        connection: _Connection,
        path: str,
        api: str,
        body: dict[str, Any],
        plan: _Plan,
        response_id: str | None = None,
    ) -> ProviderRequest:
        record = ProviderRequest(
            id=next(self._request_ids),
            connection_id=connection.id,
            path=path,
            api=api,
            body=body,
            stream=body.get("stream") is True,
            tokens_planned=plan.tokens,
            fault=plan.fault,
            signal=self._signal,
            response_id=response_id,
        )
        with self._signal.lock:
            self._requests.append(record)
            self._signal.notify()
        return record


class _Response:
    """One response of the provider: it streams the plan's tokens (or answers once) in the
    request's API, with the plan's faults, and records on ``record`` how it ended."""

    __slots__ = ("connection", "fmt", "model", "plan", "record")

    def __init__(
        self,
        connection: _Connection,
        record: ProviderRequest,
        plan: _Plan,
        model: str,
        input_tokens: int,
    ) -> None:
        self.connection = connection
        self.record = record
        self.plan = plan
        self.model = model
        self.fmt: _Format
        if record.api == OPENAI_CHAT:
            self.fmt = _OpenAIChat(record.id, model, input_tokens)
        else:
            self.fmt = _AnthropicMessages(record.id, model, input_tokens)

    async def run(self, keep_alive: bool) -> bool:
        """Produce the response while watching for the client hanging up; return whether
        the connection stays open for another request."""
        connection, record = self.connection, self.record
        produce = self._stream if record.stream else self._respond_once
        producer = asyncio.create_task(produce(keep_alive))
        hang_up = asyncio.create_task(connection.gone.wait())
        try:
            await asyncio.wait((producer, hang_up), return_when=asyncio.FIRST_COMPLETED)
        finally:
            hang_up.cancel()
            producer.cancel()
            await asyncio.wait((producer,))
            # No-op when the producer already recorded how the response ended.
            record._end(early=not connection.server_closing)
        if producer.cancelled():
            return False
        error = producer.exception()
        if error is None:
            return producer.result()
        if not isinstance(error, ConnectionError):
            raise error
        return False

    async def _stream(self, keep_alive: bool) -> bool:
        connection, record, fmt, plan = self.connection, self.record, self.fmt, self.plan
        fault = plan.fault
        if fault is not None and fault.kind == "status":
            return await self._refuse(fault.status, keep_alive)
        breaks = plan.error_after is not None or (
            fault is not None and fault.kind in ("reset", "garbage")
        )
        keep_alive = keep_alive and not breaks
        headers = [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
            ("transfer-encoding", "chunked"),
            ("x-request-id", f"req_fake_{record.id}"),
        ]
        await connection.send(_head(200, headers, keep_alive=keep_alive))
        for frame in fmt.preamble():
            await connection.send(_chunk(frame))
        start = asyncio.get_running_loop().time() + plan.first_token_delay
        for index in range(plan.tokens + 1):
            await _sleep_until(start + index * plan.seconds_per_token)
            if index == plan.error_after:
                if fault is not None and fault.kind == "error":
                    record._apply_fault()
                await connection.send(_chunk(fmt.error_frame()))
                record._end(error=True)
                await connection.send(b"0\r\n\r\n")
                return False
            if index == plan.fault_at and fault is not None:
                record._apply_fault()
                if fault.kind == "stall":
                    await _stall(connection, fault.seconds)
                    start += fault.seconds
                elif fault.kind == "reset":
                    record._end()
                    await connection.reset()
                    return False
                elif fault.kind == "garbage":
                    await connection.send(_chunk(GARBAGE))
                    record._end()
                    await connection.send(b"0\r\n\r\n")
                    return False
                else:  # truncate: a clean end of the body, with no terminal marker
                    record._end()
                    await connection.send(b"0\r\n\r\n")
                    return keep_alive
            if index == plan.tokens:
                break
            record._count(generated=1)
            await connection.send(_chunk(fmt.token(plan.texts[index])))
            record._count(sent=1)
        for frame in fmt.epilogue(plan):
            await connection.send(_chunk(frame))
        # Recorded before the chunked terminator, so a client that saw the whole response
        # always finds the request finished.
        record._end(finished=True)
        await connection.send(b"0\r\n\r\n")
        return keep_alive

    async def _respond_once(self, keep_alive: bool) -> bool:
        connection, record, fmt, plan = self.connection, self.record, self.fmt, self.plan
        fault = plan.fault
        if fault is not None and fault.kind == "status":
            return await self._refuse(fault.status, keep_alive)
        error = await _generate_whole(connection, record, plan)
        if error is None:  # the connection was reset
            return False
        status, payload = fmt.error_response() if error else (200, fmt.complete(plan))
        body = _dumps(payload)
        mangled = fault is not None and fault.kind in ("garbage", "truncate") and not error
        if mangled:
            assert fault is not None
            record._apply_fault()
            body = GARBAGE if fault.kind == "garbage" else body[: len(body) // 2]
        keep_alive = keep_alive and not error and not (mangled and body is GARBAGE)
        extra = [("x-request-id", f"req_fake_{record.id}")]
        response = _full_response(
            status, body, "application/json", keep_alive=keep_alive, extra=extra
        )
        await connection.send(response[:-1])
        # Recorded before the last byte, so a client that read the whole response always finds
        # the request ended.
        if not error and not mangled:
            record._count(sent=plan.tokens)
        record._end(finished=not error and not mangled, error=error)
        await connection.send(response[-1:])
        return keep_alive

    async def _refuse(self, status: int, keep_alive: bool) -> bool:
        """The ``status`` fault: an HTTP error with the provider's error body, no generation."""
        connection, record = self.connection, self.record
        payload = _error_json(record.api, status, _fault_message(record.api, status, self.model))
        extra = [("x-request-id", f"req_fake_{record.id}")]
        if status in (429, 503, 529):
            extra.append(("retry-after", "1"))
        response = _full_response(
            status, _dumps(payload), "application/json", keep_alive=keep_alive, extra=extra
        )
        record._apply_fault()
        record._end(error=True)
        await connection.send(response)
        return keep_alive


async def _stall(connection: _Connection, seconds: float) -> None:
    """Send nothing for ``seconds`` (forever when infinite), the socket open."""
    if math.isinf(seconds):
        await connection.gone.wait()
        raise _ClientGone("the client closed a stalled stream")
    await asyncio.sleep(seconds)


async def _generate_whole(
    connection: _Connection, record: ProviderRequest, plan: _Plan
) -> bool | None:
    """Make a non-streamed answer's tokens at the plan's pace: True if the plan ends it in
    an error, False if it completes, None if a fault reset the connection."""
    fault = plan.fault
    start = asyncio.get_running_loop().time() + plan.first_token_delay
    for index in range(plan.tokens + 1):
        await _sleep_until(start + index * plan.seconds_per_token)
        if index == plan.error_after:
            if fault is not None and fault.kind == "error":
                record._apply_fault()
            return True
        if index == plan.fault_at and fault is not None and fault.kind in ("reset", "stall"):
            record._apply_fault()
            if fault.kind == "reset":
                record._end()
                await connection.reset()
                return None
            await _stall(connection, fault.seconds)
            start += fault.seconds
        if index < plan.tokens:
            record._count(generated=1)
    return False
