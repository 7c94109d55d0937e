"""Provider adapters: what each streamed event says about usage, errors and the stream's end.

One handler per wire format reads the events of one stream into a ``StreamState``.
Payloads are decoded with reused msgspec decoders into small typed structs, and only for the
events whose fields are needed; a payload that does not fit its struct is searched for an
error object and otherwise ignored. Handlers never raise on any input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import msgspec

from .sse import ServerSentEvent

__all__ = ["ADAPTERS", "FORMATS", "Adapter", "StreamState", "detect", "error_frame"]

FORMATS: Final = ("openai_chat", "openai_responses", "anthropic_messages", "gemini")

_ANTHROPIC_EVENTS = frozenset(
    {
        "message_start",
        "message_delta",
        "message_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
    }
)
_RESPONSES_TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete"})
_ANY = msgspec.json.Decoder()


class StreamState:
    """What the events of one stream said so far."""

    __slots__ = (
        "cache_read_tokens",
        "cache_write_tokens",
        "error",
        "error_type",
        "finish_reason",
        "input_tokens",
        "model",
        "output_tokens",
        "provider_format",
        "reasoning_tokens",
        "terminal",
        "text",
        "text_chars",
    )

    def __init__(self, provider_format: str | None = None) -> None:
        self.provider_format = provider_format
        self.terminal = False
        self.error: dict[str, Any] | None = None
        self.error_type: str | None = None
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cache_read_tokens: int | None = None
        self.cache_write_tokens: int | None = None
        self.reasoning_tokens: int | None = None
        self.finish_reason: str | None = None
        self.model: str | None = None
        self.text: list[str] = []
        self.text_chars = 0  # the characters in ``text``, kept as pieces are added

    def set_error(self, error: Any, data: str) -> None:
        """Record an error object; the first one is the cause, later ones are consequences."""
        if self.error is not None:
            return
        if isinstance(error, dict):
            self.error = error
        else:
            self.error = {"message": error if isinstance(error, str) and error else data}
        self.error_type = _error_type(self.error)


def _error_type(error: dict[str, Any]) -> str:
    # OpenAI puts the specific reason in `code` (`type` is a category), Anthropic in `type`,
    # Google in `status` (its `code` is the HTTP status).
    for key in ("code", "type", "status"):
        value = error.get(key)
        if isinstance(value, str) and value and value != "error":
            return value
    return "error"


def error_frame(state: StreamState, data: str) -> None:
    """Record an ``event: error`` frame: its ``error`` member, else its whole payload."""
    try:
        payload = _ANY.decode(data)
    except msgspec.DecodeError:
        state.set_error(None, data)
        return
    inner = payload.get("error") if isinstance(payload, dict) else None
    state.set_error(inner if inner else payload, data)


_T = TypeVar("_T")


def _decoded(decoder: msgspec.json.Decoder[_T], state: StreamState, data: str) -> _T | None:
    """``data`` decoded; None for a payload that is not JSON, or that does not fit (whose
    error object, if it carries one, is kept)."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError:
        _fallback(state, data)
    except msgspec.DecodeError:
        pass
    return None


def _fallback(state: StreamState, data: str) -> None:
    """A payload that did not fit its struct: keep its error object, if it carries one."""
    try:
        payload = _ANY.decode(data)
    except msgspec.DecodeError:
        return
    if isinstance(payload, dict) and (payload.get("error") or payload.get("type") == "error"):
        inner = payload.get("error")
        state.set_error(inner if inner else payload, data)


# OpenAI Chat Completions (and the many servers that speak it).


class _ChatDelta(msgspec.Struct, gc=False):
    content: str | None = None


class _ChatChoice(msgspec.Struct, gc=False):
    delta: _ChatDelta | None = None
    finish_reason: str | None = None


class _ChatPromptDetails(msgspec.Struct, gc=False):
    cached_tokens: int | None = None
    cache_write_tokens: int | None = None  # OpenRouter


class _ChatCompletionDetails(msgspec.Struct, gc=False):
    reasoning_tokens: int | None = None


class _ChatUsage(msgspec.Struct, gc=False):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _ChatPromptDetails | None = None
    completion_tokens_details: _ChatCompletionDetails | None = None


class _ChatChunk(msgspec.Struct, gc=False):
    model: str | None = None
    choices: list[_ChatChoice] | None = None
    usage: _ChatUsage | None = None
    error: Any = None


_CHAT = msgspec.json.Decoder(_ChatChunk)


def openai_chat(state: StreamState, event: ServerSentEvent) -> None:
    data = event.data
    if event.event == "error":
        error_frame(state, data)
        return
    chunk = _decoded(_CHAT, state, data)
    if chunk is None:
        return
    if chunk.model and state.model is None:
        state.model = chunk.model
    if chunk.error:
        state.set_error(chunk.error, data)
    if chunk.choices:
        for choice in chunk.choices:
            delta = choice.delta
            if delta is not None and delta.content:
                state.text.append(delta.content)
                state.text_chars += len(delta.content)
            if choice.finish_reason:
                state.finish_reason = choice.finish_reason
    usage = chunk.usage
    if usage is not None:
        if usage.prompt_tokens is not None:
            state.input_tokens = usage.prompt_tokens
        if usage.completion_tokens is not None:
            state.output_tokens = usage.completion_tokens
        prompt = usage.prompt_tokens_details
        if prompt is not None:
            if prompt.cached_tokens is not None:
                state.cache_read_tokens = prompt.cached_tokens
            if prompt.cache_write_tokens is not None:
                state.cache_write_tokens = prompt.cache_write_tokens
        completion = usage.completion_tokens_details
        if completion is not None and completion.reasoning_tokens is not None:
            state.reasoning_tokens = completion.reasoning_tokens


# OpenAI Responses.


class _Typed(msgspec.Struct, gc=False):
    type: str | None = None


class _ResponsesTextDelta(msgspec.Struct, gc=False):
    delta: str | None = None


class _ResponsesInputDetails(msgspec.Struct, gc=False):
    cached_tokens: int | None = None


class _ResponsesOutputDetails(msgspec.Struct, gc=False):
    reasoning_tokens: int | None = None


class _ResponsesUsage(msgspec.Struct, gc=False):
    input_tokens: int | None = None
    output_tokens: int | None = None
    input_tokens_details: _ResponsesInputDetails | None = None
    output_tokens_details: _ResponsesOutputDetails | None = None


class _IncompleteDetails(msgspec.Struct, gc=False):
    reason: str | None = None


class _Response(msgspec.Struct, gc=False):
    model: str | None = None
    status: str | None = None
    usage: _ResponsesUsage | None = None
    error: Any = None
    incomplete_details: _IncompleteDetails | None = None


class _ResponsesLifecycle(msgspec.Struct, gc=False):
    response: _Response | None = None


_TYPED = msgspec.json.Decoder(_Typed)
_RESPONSES_TEXT = msgspec.json.Decoder(_ResponsesTextDelta)
_RESPONSES_LIFECYCLE = msgspec.json.Decoder(_ResponsesLifecycle)


def openai_responses(state: StreamState, event: ServerSentEvent) -> None:
    data = event.data
    kind = event.event
    if kind == "message":
        try:
            kind = _TYPED.decode(data).type or ""
        except msgspec.DecodeError:
            return
    if kind == "response.output_text.delta":
        try:
            delta = _RESPONSES_TEXT.decode(data).delta
        except msgspec.DecodeError:
            return
        if delta:
            state.text.append(delta)
            state.text_chars += len(delta)
    elif kind in _RESPONSES_TERMINAL:
        state.terminal = True
        lifecycle = _decoded(_RESPONSES_LIFECYCLE, state, data)
        if lifecycle is None:
            return
        if lifecycle.response is not None:
            _read_response(state, lifecycle.response, data)
        if kind == "response.failed" and state.error is None:
            state.set_error({"type": "response_failed"}, data)
    elif kind == "error":
        error_frame(state, data)
    elif kind in ("response.created", "response.in_progress") and state.model is None:
        try:
            response = _RESPONSES_LIFECYCLE.decode(data).response
        except msgspec.DecodeError:
            return
        if response is not None:
            state.model = response.model


def _read_response(state: StreamState, response: _Response, data: str) -> None:
    if response.model:
        state.model = response.model
    if response.status:
        reason = response.incomplete_details.reason if response.incomplete_details else None
        state.finish_reason = reason or response.status
    if response.error:
        state.set_error(response.error, data)
    usage = response.usage
    if usage is not None:
        if usage.input_tokens is not None:
            state.input_tokens = usage.input_tokens
        if usage.output_tokens is not None:
            state.output_tokens = usage.output_tokens
        details = usage.input_tokens_details
        if details is not None and details.cached_tokens is not None:
            state.cache_read_tokens = details.cached_tokens
        output_details = usage.output_tokens_details
        if output_details is not None and output_details.reasoning_tokens is not None:
            state.reasoning_tokens = output_details.reasoning_tokens


# Anthropic Messages.


class _AnthropicUsage(msgspec.Struct, gc=False):
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class _AnthropicMessage(msgspec.Struct, gc=False):
    model: str | None = None
    usage: _AnthropicUsage | None = None


class _AnthropicDelta(msgspec.Struct, gc=False):
    type: str | None = None
    text: str | None = None
    stop_reason: str | None = None


class _AnthropicEvent(msgspec.Struct, gc=False):
    type: str | None = None
    message: _AnthropicMessage | None = None
    delta: _AnthropicDelta | None = None
    usage: _AnthropicUsage | None = None
    error: Any = None


_ANTHROPIC = msgspec.json.Decoder(_AnthropicEvent)
_ANTHROPIC_SKIPPED = frozenset({"ping", "content_block_start", "content_block_stop"})


def anthropic_messages(state: StreamState, event: ServerSentEvent) -> None:
    data = event.data
    kind = event.event
    if kind in _ANTHROPIC_SKIPPED:
        return
    # Tool-input and thinking deltas carry nothing metering reads.
    if kind == "content_block_delta" and '"text_delta"' not in data:
        return
    try:
        message = _ANTHROPIC.decode(data)
    except msgspec.ValidationError:
        _fallback(state, data)
        return
    except msgspec.DecodeError:
        if kind == "error":
            state.set_error(None, data)
        return
    if kind == "message":
        kind = message.type or ""
    if kind == "content_block_delta":
        delta = message.delta
        if delta is not None and delta.type == "text_delta" and delta.text:
            state.text.append(delta.text)
            state.text_chars += len(delta.text)
    elif kind == "message_start":
        _anthropic_start(state, message.message)
    elif kind == "message_delta":
        _anthropic_delta(state, message)
    elif kind == "message_stop":
        state.terminal = True
    elif kind == "error" or message.type == "error":
        state.set_error(message.error if message.error else None, data)


def _anthropic_delta(state: StreamState, message: _AnthropicEvent) -> None:
    if message.delta is not None and message.delta.stop_reason:
        state.finish_reason = message.delta.stop_reason
    if message.usage is not None:
        _read_anthropic_usage(state, message.usage, output=True)


def _anthropic_start(state: StreamState, start: _AnthropicMessage | None) -> None:
    if start is None:
        return
    if start.model:
        state.model = start.model
    # message_start's output_tokens is a placeholder; message_delta has the count.
    if start.usage is not None:
        _read_anthropic_usage(state, start.usage, output=False)


def _read_anthropic_usage(state: StreamState, usage: _AnthropicUsage, *, output: bool) -> None:
    if usage.input_tokens is not None:
        state.input_tokens = usage.input_tokens
    if output and usage.output_tokens is not None:
        state.output_tokens = usage.output_tokens
    if usage.cache_read_input_tokens is not None:
        state.cache_read_tokens = usage.cache_read_input_tokens
    if usage.cache_creation_input_tokens is not None:
        state.cache_write_tokens = usage.cache_creation_input_tokens


# Google Gemini (streamGenerateContent?alt=sse).


class _GeminiPart(msgspec.Struct, gc=False):
    text: str | None = None
    thought: bool | None = None


class _GeminiContent(msgspec.Struct, gc=False):
    parts: list[_GeminiPart] | None = None


class _GeminiCandidate(msgspec.Struct, rename="camel", gc=False):
    content: _GeminiContent | None = None
    finish_reason: str | None = None


class _GeminiUsage(msgspec.Struct, rename="camel", gc=False):
    prompt_token_count: int | None = None
    candidates_token_count: int | None = None
    thoughts_token_count: int | None = None
    cached_content_token_count: int | None = None


class _GeminiPromptFeedback(msgspec.Struct, rename="camel", gc=False):
    block_reason: str | None = None


class _GeminiChunk(msgspec.Struct, rename="camel", gc=False):
    candidates: list[_GeminiCandidate] | None = None
    usage_metadata: _GeminiUsage | None = None
    model_version: str | None = None
    prompt_feedback: _GeminiPromptFeedback | None = None
    error: Any = None


_GEMINI = msgspec.json.Decoder(_GeminiChunk)


def gemini(state: StreamState, event: ServerSentEvent) -> None:
    data = event.data
    if event.event == "error":
        error_frame(state, data)
        return
    chunk = _decoded(_GEMINI, state, data)
    if chunk is None:
        return
    if chunk.model_version and state.model is None:
        state.model = chunk.model_version
    if chunk.error:
        state.set_error(chunk.error, data)
    for candidate in chunk.candidates or ():
        content = candidate.content
        if content is not None and content.parts:
            for part in content.parts:
                if part.text and not part.thought:
                    state.text.append(part.text)
                    state.text_chars += len(part.text)
        if candidate.finish_reason:
            state.finish_reason = candidate.finish_reason
            state.terminal = True
    feedback = chunk.prompt_feedback
    if feedback is not None and feedback.block_reason:
        state.finish_reason = feedback.block_reason
        state.terminal = True
    if chunk.usage_metadata is not None:
        _read_gemini_usage(state, chunk.usage_metadata)


def _read_gemini_usage(state: StreamState, usage: _GeminiUsage) -> None:
    if usage.prompt_token_count is not None:
        state.input_tokens = usage.prompt_token_count
    if usage.candidates_token_count is not None or usage.thoughts_token_count is not None:
        # Thinking tokens are billed as output, as OpenAI's completion_tokens count them.
        thoughts = usage.thoughts_token_count or 0
        state.output_tokens = (usage.candidates_token_count or 0) + thoughts
    if usage.thoughts_token_count is not None:
        state.reasoning_tokens = usage.thoughts_token_count
    if usage.cached_content_token_count is not None:
        state.cache_read_tokens = usage.cached_content_token_count


Adapter = Callable[[StreamState, ServerSentEvent], None]

ADAPTERS: Final[dict[str, Adapter]] = {
    "openai_chat": openai_chat,
    "openai_responses": openai_responses,
    "anthropic_messages": anthropic_messages,
    "gemini": gemini,
}


def detect(event: ServerSentEvent) -> str | None:
    """The wire format an event belongs to, or None if it does not tell."""
    name = event.event
    if name.startswith("response."):
        return "openai_responses"
    if name in _ANTHROPIC_EVENTS:
        return "anthropic_messages"
    data = event.data
    if data == "[DONE]":
        return "openai_chat"
    if not data.lstrip().startswith("{"):
        return None
    try:
        payload = _ANY.decode(data)
    except msgspec.DecodeError:
        return None
    kind = payload.get("type")
    if isinstance(kind, str):
        if kind.startswith("response."):
            return "openai_responses"
        if kind in _ANTHROPIC_EVENTS:
            return "anthropic_messages"
        if kind == "error":
            # Responses numbers its events; Anthropic's error frame is otherwise the same.
            return "openai_responses" if "sequence_number" in payload else "anthropic_messages"
    if payload.get("object") == "chat.completion.chunk" or "choices" in payload:
        return "openai_chat"
    if "candidates" in payload or "usageMetadata" in payload:
        return "gemini"
    error = payload.get("error")
    if isinstance(error, dict):
        # Google's error objects carry a `status` name; OpenAI's carry `type`/`code`/`param`.
        return "gemini" if isinstance(error.get("status"), str) else "openai_chat"
    return None
