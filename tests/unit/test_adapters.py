"""The provider adapters: detection and the fields each wire format carries."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_disconnect._adapters import ADAPTERS, FORMATS, StreamState, detect
from asgi_disconnect.metering import StreamReport, analyze
from asgi_disconnect.sse import ServerSentEvent


def frame(payload: Any, event: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


def stream(*frames: bytes, provider: str | None = None) -> StreamReport:
    return analyze(b"".join(frames), provider)


@pytest.mark.parametrize(
    ("event", "data", "expected"),
    [
        ("message", '{"object":"chat.completion.chunk","choices":[]}', "openai_chat"),
        ("message", '{"choices":[{"delta":{"content":"x"}}]}', "openai_chat"),
        ("message", "[DONE]", "openai_chat"),
        ("response.created", "{}", "openai_responses"),
        ("message", '{"type":"response.output_text.delta","delta":"x"}', "openai_responses"),
        ("message", '{"type":"error","sequence_number":3,"code":"x"}', "openai_responses"),
        ("message_start", "{}", "anthropic_messages"),
        ("message", '{"type": "message_start", "message": {}}', "anthropic_messages"),
        ("error", '{"type":"error","error":{"type":"overloaded_error"}}', "anthropic_messages"),
        ("message", '{"candidates":[{"content":{"parts":[{"text":"x"}]}}]}', "gemini"),
        ("message", '{"usageMetadata":{"promptTokenCount":3}}', "gemini"),
        ("message", '{"error":{"code":429,"status":"RESOURCE_EXHAUSTED"}}', "gemini"),
        ("message", '{"error":{"type":"server_error","code":null}}', "openai_chat"),
        ("ping", '{"type": "ping"}', None),
        ("message", '{"foo": true}', None),
        ("message", "not json", None),
        ("message", "{not json", None),
        ("message", "[1, 2]", None),
    ],
)
def test_detect(event: str, data: str, expected: str | None) -> None:
    assert detect(ServerSentEvent(event=event, data=data)) == expected


# OpenAI Chat Completions.


def chat(**fields: Any) -> bytes:
    return frame({"object": "chat.completion.chunk", **fields})


def test_chat_usage_with_cache_and_reasoning_tokens() -> None:
    usage = {
        "prompt_tokens": 1200,
        "completion_tokens": 300,
        "prompt_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 64},
        "completion_tokens_details": {"reasoning_tokens": 256},
    }
    report = stream(
        chat(model="o3", choices=[{"delta": {"content": "Hi"}, "finish_reason": None}]),
        chat(choices=[{"delta": {}, "finish_reason": "stop"}]),
        chat(choices=[], usage=usage),
        frame("[DONE]"),
    )
    assert (report.input_tokens, report.output_tokens) == (1200, 300)
    assert (report.cache_read_tokens, report.cache_write_tokens) == (1024, 64)
    assert report.reasoning_tokens == 256
    assert (report.model, report.text, report.finish_reason) == ("o3", "Hi", "stop")
    assert report.usage_source == "provider"
    assert report.terminal_marker_seen


def test_chat_error_object_in_a_data_frame() -> None:
    error = {"message": "The server had an error", "type": "server_error", "code": None}
    report = stream(chat(choices=[{"delta": {"content": "x"}}]), frame({"error": error}))
    assert (report.error, report.error_type) == (error, "server_error")
    assert not report.terminal_marker_seen


def test_chat_error_frame_that_is_not_json() -> None:
    report = stream(chat(choices=[]), frame("Internal Server Error", "error"))
    assert (report.error, report.error_type) == ({"message": "Internal Server Error"}, "error")


def test_the_first_error_is_kept() -> None:
    report = stream(
        chat(choices=[]),
        frame({"error": {"code": "first"}}),
        frame({"error": {"code": "second"}}, "error"),
    )
    assert report.error_type == "first"


def test_chat_fields_of_the_wrong_type_do_not_hide_an_error() -> None:
    report = stream(
        chat(choices=[{"delta": {"content": ["a", "list"]}}]),
        chat(choices=5, error={"code": "rate_limit_exceeded"}),
        chat(usage="none"),
        provider="openai_chat",
    )
    assert report.error_type == "rate_limit_exceeded"
    assert (report.event_count, report.text, report.input_tokens) == (3, "", None)


# OpenAI Responses.


def responses(kind: str, **fields: Any) -> bytes:
    return frame({"type": kind, **fields}, kind)


def test_responses_usage_details() -> None:
    usage = {
        "input_tokens": 5000,
        "input_tokens_details": {"cached_tokens": 4096},
        "output_tokens": 800,
        "output_tokens_details": {"reasoning_tokens": 512},
    }
    report = stream(
        responses("response.created", response={"model": "o4-mini", "status": "in_progress"}),
        responses("response.output_text.delta", delta="Hello"),
        responses("response.output_text.delta", delta=" there"),
        responses("response.completed", response={"status": "completed", "usage": usage}),
    )
    assert (report.input_tokens, report.output_tokens) == (5000, 800)
    assert (report.cache_read_tokens, report.reasoning_tokens) == (4096, 512)
    assert (report.model, report.text, report.finish_reason) == (
        "o4-mini",
        "Hello there",
        "completed",
    )
    assert report.terminal_marker_seen
    assert report.error is None


def test_responses_incomplete_gives_its_reason() -> None:
    report = stream(
        responses("response.created", response={"status": "in_progress"}),
        responses(
            "response.incomplete",
            response={
                "status": "incomplete",
                "incomplete_details": {"reason": "max_output_tokens"},
                "usage": {"input_tokens": 10, "output_tokens": 16},
            },
        ),
    )
    assert (report.finish_reason, report.terminal_marker_seen) == ("max_output_tokens", True)
    assert (report.error, report.output_tokens) == (None, 16)


def test_responses_failed_alone_is_an_error() -> None:
    error = {"code": "server_error", "message": "The model failed"}
    report = stream(
        responses("response.created", response={}),
        responses("response.failed", response={"status": "failed", "error": error}),
    )
    assert (report.error, report.error_type, report.finish_reason) == (
        error,
        "server_error",
        "failed",
    )


def test_responses_failed_without_an_error_object() -> None:
    report = stream(
        responses("response.created", response={}),
        responses("response.failed", response={"status": "failed", "error": None}),
    )
    assert report.error_type == "response_failed"


def test_responses_flat_error_event_without_event_names() -> None:
    body = frame({"type": "response.created", "response": {}}) + frame(
        {"type": "error", "code": "rate_limit_exceeded", "message": "Slow down", "param": None}
    )
    report = analyze(body)
    assert (report.provider_format, report.error_type) == (
        "openai_responses",
        "rate_limit_exceeded",
    )


# Anthropic Messages.


def anthropic(kind: str, **fields: Any) -> bytes:
    return frame({"type": kind, **fields}, kind)


def test_anthropic_cache_tokens_and_final_input_from_message_delta() -> None:
    start_usage = {
        "input_tokens": 12,
        "cache_creation_input_tokens": 2048,
        "cache_read_input_tokens": 8192,
        "output_tokens": 1,
    }
    report = stream(
        anthropic("message_start", message={"model": "claude-opus-4-1", "usage": start_usage}),
        anthropic("content_block_start", index=0, content_block={"type": "thinking"}),
        anthropic(
            "content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "Hm"}
        ),
        anthropic("content_block_delta", index=1, delta={"type": "text_delta", "text": "Yes"}),
        anthropic("ping"),
        anthropic(
            "message_delta",
            delta={"stop_reason": "max_tokens"},
            usage={"input_tokens": 14, "output_tokens": 90},
        ),
        anthropic("message_stop"),
    )
    assert (report.input_tokens, report.output_tokens) == (14, 90)
    assert (report.cache_write_tokens, report.cache_read_tokens) == (2048, 8192)
    assert (report.text, report.finish_reason, report.model) == (
        "Yes",
        "max_tokens",
        "claude-opus-4-1",
    )
    assert report.terminal_marker_seen


def test_anthropic_error_frame_that_is_not_json() -> None:
    report = stream(anthropic("message_start", message={}), frame("overloaded", "error"))
    assert report.error_type == "error"


# Google Gemini.


def gemini(**fields: Any) -> bytes:
    return frame(fields)


def test_gemini_stream() -> None:
    report = stream(
        gemini(
            candidates=[{"content": {"parts": [{"text": "Thinking...", "thought": True}]}}],
            modelVersion="gemini-2.5-pro",
        ),
        gemini(candidates=[{"content": {"parts": [{"text": "Hello"}, {"text": ", world"}]}}]),
        gemini(
            candidates=[{"content": {"parts": [{"text": "!"}]}, "finishReason": "STOP"}],
            usageMetadata={
                "promptTokenCount": 40,
                "candidatesTokenCount": 12,
                "thoughtsTokenCount": 30,
                "cachedContentTokenCount": 32,
                "totalTokenCount": 82,
            },
        ),
    )
    assert report.provider_format == "gemini"
    assert (report.text, report.finish_reason, report.model) == (
        "Hello, world!",
        "STOP",
        "gemini-2.5-pro",
    )
    # Thinking tokens are billed as output, as OpenAI's completion_tokens include them.
    assert (report.input_tokens, report.output_tokens, report.reasoning_tokens) == (40, 42, 30)
    assert report.cache_read_tokens == 32
    assert report.terminal_marker_seen


def test_gemini_without_a_final_finish_reason_is_cut_off() -> None:
    report = stream(gemini(candidates=[{"content": {"parts": [{"text": "Hel"}]}}]))
    assert (report.provider_format, report.terminal_marker_seen) == ("gemini", False)


def test_gemini_blocked_prompt() -> None:
    report = stream(gemini(promptFeedback={"blockReason": "SAFETY"}), provider="gemini")
    assert (report.finish_reason, report.terminal_marker_seen) == ("SAFETY", True)


def test_gemini_error() -> None:
    error = {"code": 429, "message": "Resource exhausted", "status": "RESOURCE_EXHAUSTED"}
    report = stream(gemini(candidates=[]), gemini(error=error))
    assert (report.error, report.error_type) == (error, "RESOURCE_EXHAUSTED")


# Every adapter, any payload.

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "error",
                    "choices",
                    "delta",
                    "content",
                    "usage",
                    "message",
                    "response",
                    "candidates",
                    "parts",
                    "text",
                    "usageMetadata",
                    "prompt_tokens",
                    "input_tokens",
                    "status",
                ]
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=16,
)
event_names = st.sampled_from(
    [
        "message",
        "error",
        "message_start",
        "message_delta",
        "content_block_delta",
        "response.created",
        "response.output_text.delta",
        "response.completed",
        "response.failed",
        "ping",
    ]
)


@settings(max_examples=200, deadline=None)
@given(
    provider=st.sampled_from(FORMATS),
    events=st.lists(
        st.tuples(
            event_names, json_values.map(lambda v: msgspec.json.encode(v).decode()) | st.text()
        ),
        max_size=6,
    ),
)
def test_adapters_never_raise(provider: str, events: list[tuple[str, str]]) -> None:
    state = StreamState(provider)
    for name, data in events:
        ADAPTERS[provider](state, ServerSentEvent(event=name, data=data))
    assert state.error is None or isinstance(state.error, dict)
