"""analyze() and StreamMeter against the recorded vectors and their expected figures."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asgi_disconnect import _adapters
from asgi_disconnect.metering import StreamMeter, StreamReport, analyze
from asgi_disconnect.sse import ServerSentEvent, SSEDecoder

DATA = Path(__file__).resolve().parent.parent / "data"
EXPECTED: dict[str, dict[str, Any]] = msgspec.json.decode((DATA / "expected.json").read_bytes())
# expected.json states provider_format "openai_chat" for this one only because the field needs a
# value; its notes say to treat it as not applicable: it is a parser test, not an LLM stream.
NOT_AN_LLM_STREAM = "sse_multiline_data.synthetic.sse"


def stated(report: StreamReport) -> dict[str, Any]:
    """The report in expected.json's terms (its `comment_lines`; `error` as a boolean)."""
    return {
        "provider_format": report.provider_format,
        "terminal_marker_seen": report.terminal_marker_seen,
        "error": report.error is not None,
        "error_type": report.error_type,
        "input_tokens": report.input_tokens,
        "output_tokens": report.output_tokens,
        "finish_reason": report.finish_reason,
        "event_count": report.event_count,
        "comment_lines": report.comment_count,
    }


def expected_figures(name: str) -> dict[str, Any]:
    return {key: value for key, value in EXPECTED[name].items() if key != "notes"}


def split_at(body: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cut % (len(body) + 1) for cut in cuts), len(body)]
    return [body[start:end] for start, end in itertools.pairwise(points)]


def test_every_vector_has_expected_figures() -> None:
    assert sorted(EXPECTED) == sorted(path.name for path in DATA.glob("*.sse"))


@pytest.mark.parametrize("name", sorted(set(EXPECTED) - {NOT_AN_LLM_STREAM}))
def test_analyze_gives_the_expected_figures(name: str) -> None:
    assert stated(analyze((DATA / name).read_bytes())) == expected_figures(name)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_naming_the_provider_gives_the_expected_figures(name: str) -> None:
    expected = expected_figures(name)
    report = analyze((DATA / name).read_bytes(), expected["provider_format"])
    assert stated(report) == expected


def test_a_parser_test_body_is_no_provider_format() -> None:
    report = analyze((DATA / NOT_AN_LLM_STREAM).read_bytes())
    assert report.provider_format is None
    assert stated(report) == expected_figures(NOT_AN_LLM_STREAM) | {"provider_format": None}


def test_without_the_appended_lf_done_is_not_dispatched() -> None:
    body = (DATA / "openai_compat_chat_no_usage.sse").read_bytes()
    report = analyze(body.removesuffix(b"\n"))
    assert not report.terminal_marker_seen
    assert report.event_count == 8
    assert report.finish_reason == "tool_calls"


def test_without_the_appended_lfs_message_stop_is_not_dispatched() -> None:
    body = (DATA / "anthropic_messages_tool_use.sse").read_bytes()
    report = analyze(body.removesuffix(b"\n\n"))
    assert not report.terminal_marker_seen
    assert report.event_count == 14
    assert (report.output_tokens, report.finish_reason) == (65, "tool_use")


def test_a_stream_cut_off_mid_way_has_no_terminal_marker() -> None:
    body = (DATA / "openai_chat_basic.sse").read_bytes()
    report = analyze(body[: len(body) // 2])
    assert not report.terminal_marker_seen
    assert report.usage_source == "none"
    assert report.text.startswith("I'm unable to provide")


def test_usage_source_is_provider_only_when_figures_arrived() -> None:
    assert analyze((DATA / "openai_chat_basic.sse").read_bytes()).usage_source == "provider"
    assert analyze((DATA / "groq_chat_event_error.sse").read_bytes()).usage_source == "none"
    assert analyze(b"").usage_source == "none"


@pytest.mark.parametrize(
    ("name", "model", "text"),
    [
        (
            "openai_chat_basic.sse",
            "gpt-4o-2024-08-06",
            "I'm unable to provide real-time weather updates. To get the current weather in "
            "San Francisco, I recommend checking a reliable weather website or a weather app.",
        ),
        ("openai_chat_tool_call.sse", "gpt-4o-2024-08-06", ""),
        ("openai_responses_text.sse", "gpt-4o-2024-08-06", "The capital of France is Paris."),
        ("anthropic_messages_basic.sse", "claude-sonnet-4-5-20250929", "2"),
        (
            "anthropic_messages_tool_use.sse",
            "claude-sonnet-4-20250514",
            "I'll check the current weather in Paris for you.",
        ),
        (
            "anthropic_messages_overloaded_error_midstream.synthetic.sse",
            "claude-3-haiku-20240307",
            "Hello",
        ),
        ("openrouter_chat_comments_usage.sse", "anthropic/claude-4.6-sonnet-20260217", "Hello!"),
        ("openai_compat_chat_no_usage.sse", "claude-haiku-4-5-20251001", "Reading it."),
    ],
)
def test_model_and_output_text(name: str, model: str, text: str) -> None:
    report = analyze((DATA / name).read_bytes())
    assert (report.model, report.text) == (model, text)


def test_cache_and_reasoning_figures_from_the_vectors() -> None:
    basic = analyze((DATA / "openai_chat_basic.sse").read_bytes())
    assert (basic.cache_read_tokens, basic.reasoning_tokens) == (None, 0)
    responses = analyze((DATA / "openai_responses_text.sse").read_bytes())
    assert (responses.cache_read_tokens, responses.reasoning_tokens) == (0, 0)
    anthropic = analyze((DATA / "anthropic_messages_basic.sse").read_bytes())
    assert (anthropic.cache_read_tokens, anthropic.cache_write_tokens) == (0, 0)
    openrouter = analyze((DATA / "openrouter_chat_comments_usage.sse").read_bytes())
    assert (openrouter.cache_read_tokens, openrouter.cache_write_tokens) == (0, 0)


def test_error_payloads() -> None:
    groq = analyze((DATA / "groq_chat_event_error.sse").read_bytes()).error
    assert groq is not None
    assert (groq["type"], groq["code"], groq["status_code"]) == (
        "invalid_request_error",
        "tool_use_failed",
        400,
    )
    overloaded = analyze((DATA / "anthropic_error_only_overloaded.sse").read_bytes())
    assert overloaded.error == {
        "details": None,
        "type": "overloaded_error",
        "message": "Overloaded",
    }
    failed = analyze((DATA / "openai_responses_error_failed.sse").read_bytes()).error
    assert failed is not None
    assert failed["code"] == "insufficient_quota"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_first_event_offset_is_just_past_the_blank_line_that_ended_it(name: str) -> None:
    body = (DATA / name).read_bytes()
    offset = analyze(body).first_event_offset
    assert offset is not None
    assert SSEDecoder().feed(body[: offset - 1]) == []
    assert SSEDecoder().feed(body[:offset]) != []


def test_no_event_no_first_event_offset() -> None:
    assert analyze(b": ping\n\ndata: cut off").first_event_offset is None


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(EXPECTED)),
    cuts=st.lists(st.integers(min_value=0, max_value=30_000), max_size=20),
)
def test_any_chunking_gives_the_same_report(name: str, cuts: list[int]) -> None:
    body = (DATA / name).read_bytes()
    meter = StreamMeter()
    for chunk in split_at(body, cuts):
        meter.feed(chunk)
    assert meter.report() == analyze(body)


def test_the_meter_counts_events_as_they_arrive() -> None:
    assert StreamMeter().provider_format is None
    meter = StreamMeter()
    meter.feed(b'data: {"object":"chat.completion.chunk","choices":[]}\n\n')
    assert (meter.event_count, meter.provider_format) == (1, "openai_chat")
    meter.feed(b"data: [DO")
    assert meter.event_count == 1
    meter.feed(b"NE]\n\n")
    assert meter.event_count == 2
    assert meter.report().terminal_marker_seen


def test_a_decode_error_is_recorded_and_later_bytes_ignored() -> None:
    meter = StreamMeter(max_event_bytes=64)
    meter.feed(b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n')
    meter.feed(b"data: " + b"x" * 100 + b"\n\n")
    meter.feed(b"data: [DONE]\n\n")
    report = meter.report()
    assert report.error_type == "sse_decode_error"
    assert report.error is not None
    assert "64" in report.error["message"]
    assert (report.event_count, report.terminal_marker_seen, report.text) == (1, False, "Hi")


def test_an_overlong_event_is_skipped_and_the_stream_read_on() -> None:
    """An event larger than the meter's window (an image as base64) is skipped unread, never
    an error; the events after it, usage and [DONE] included, are read."""
    meter = StreamMeter()
    meter.feed(b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n')
    meter.feed(b'data: {"choices":[{"index":0,"delta":{"content":"')
    for _ in range(17):
        meter.feed(b"x" * 65536)
    meter.feed(b'"}}]}\n\n')
    meter.feed(b'data: {"choices":[],"usage":{"prompt_tokens":50,"completion_tokens":1500}}\n\n')
    meter.feed(b"data: [DONE]\n\n")
    report = meter.report()
    assert report.error is None
    assert report.skipped_events == 1
    assert report.terminal_marker_seen
    assert (report.input_tokens, report.output_tokens) == (50, 1500)
    assert report.text == "a"


def test_a_failing_adapter_stops_metering_without_raising(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(state: _adapters.StreamState, event: ServerSentEvent) -> None:
        raise RuntimeError("bug")

    monkeypatch.setitem(_adapters.ADAPTERS, "gemini", broken)
    meter = StreamMeter("gemini")
    meter.feed(b'data: {"candidates":[]}\n\n')
    meter.feed(b'data: {"candidates":[]}\n\n')
    report = meter.report()
    assert report.error_type == "meter_error"
    assert report.event_count == 1
    assert "metering failed" in caplog.text


def test_the_meter_takes_any_bytes_like_chunk() -> None:
    meter = StreamMeter()
    meter.feed(bytearray(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'))  # type: ignore[arg-type]
    meter.feed(memoryview(b"data: [DONE]\n\n"))  # type: ignore[arg-type]
    assert (meter.report().text, meter.report().terminal_marker_seen) == ("a", True)


def test_an_unknown_provider_is_refused() -> None:
    with pytest.raises(ValueError, match="openai_chat"):
        StreamMeter("openai")
    with pytest.raises(ValueError, match="gemini"):
        analyze(b"", "vertex")


def test_an_empty_body() -> None:
    assert analyze(b"") == StreamReport(
        provider_format=None,
        terminal_marker_seen=False,
        error=None,
        error_type=None,
        input_tokens=None,
        output_tokens=None,
        usage_source="none",
        finish_reason=None,
        event_count=0,
    )


def test_a_stream_that_never_says_its_format_is_not_guessed() -> None:
    body = b"".join(b'data: {"tick": %d}\n\n' % n for n in range(20))
    body += b'data: {"choices":[{"delta":{"content":"late"}}]}\n\n'
    report = analyze(body)
    assert (report.provider_format, report.event_count, report.text) == (None, 21, "")


def test_errors_and_done_are_seen_without_a_format() -> None:
    ticks = b"".join(b'data: {"tick": %d}\n\n' % n for n in range(20))
    report = analyze(ticks + b"event: error\ndata: upstream exploded\n\ndata: [DONE]\n\n")
    assert report.provider_format is None
    assert report.error == {"message": "upstream exploded"}
    assert report.error_type == "error"
    assert report.terminal_marker_seen


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "error", "choices", "usage", "delta", "message", "response"]),
            children,
            max_size=4,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(
    provider=st.sampled_from([None, *_adapters.FORMATS]),
    frames=st.lists(
        st.tuples(
            st.sampled_from(["", "error", "message_start", "response.completed", "ping"]),
            json_values.map(msgspec.json.encode) | st.binary(max_size=40),
        ),
        max_size=8,
    ),
)
def test_the_meter_never_raises(provider: str | None, frames: list[tuple[str, bytes]]) -> None:
    meter = StreamMeter(provider)
    for event, data in frames:
        meter.feed((f"event: {event}\n" if event else "").encode() + b"data: " + data + b"\n\n")
    meter.report()
