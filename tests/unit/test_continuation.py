"""Continuations without a network: what a relay records, the call that finishes the answer,
and the stitching of that call's events onto the stored ones (recorded provider streams)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from asgi_disconnect._continuation import (
    RESTART_EVENT,
    Continuation,
    background_body,
    decode,
    encode,
    plan,
    recorded,
    response_url,
)

DATA = Path(__file__).resolve().parents[1] / "data"


def vector(name: str) -> bytes:
    return (DATA / name).read_bytes()


def frames(stream: bytes) -> list[bytes]:
    return [frame + b"\n\n" for frame in stream.replace(b"\r\n", b"\n").split(b"\n\n") if frame]


def cut(stream: bytes, fraction: float) -> tuple[bytes, bytes]:
    """The stream cut at the event boundary nearest ``fraction`` of its events."""
    events = frames(stream)
    at = max(1, round(len(events) * fraction))
    return b"".join(events[:at]), b"".join(events[at:])


def stitched(attempt: Any, continuation: bytes, split: int | None) -> bytes:
    stitcher = attempt.stitcher
    if split is None:
        return stitcher.feed(continuation) + stitcher.end()
    out = b"".join(
        stitcher.feed(continuation[i : i + split]) for i in range(0, len(continuation), split)
    )
    return out + stitcher.end()


def data_of(frame: bytes) -> Any:
    lines = [line[5:].strip() for line in frame.split(b"\n") if line.startswith(b"data:")]
    raw = b"\n".join(lines)
    return raw.decode() if raw == b"[DONE]" else json.loads(raw)


def chat(request: str = "a") -> Continuation:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": request}]}
    return recorded(
        "continue_final_message",
        upstream="vllm",
        method="POST",
        url="http://vllm/v1/chat/completions",
        body=json.dumps(body).encode(),
        headers=[("Authorization", "Bearer secret"), ("content-type", "application/json")],
    )


def test_a_recorded_continuation_keeps_no_credential_and_round_trips() -> None:
    continuation = recorded(
        "prefill",
        upstream="anthropic",
        method="post",
        url="https://api.anthropic.com/v1/messages",
        body=b'{"model": "m", "messages": []}',
        headers=[
            ("x-api-key", "sk-ant-secret"),
            ("Authorization", "Bearer x"),
            ("Cookie", "a=b"),
            ("api-key", "azure"),
            ("anthropic-version", "2023-06-01"),
            ("Content-Type", "application/json"),
        ],
        fallback="synthetic",
    )
    assert continuation.headers == (
        ("anthropic-version", "2023-06-01"),
        ("content-type", "application/json"),
    )
    assert b"secret" not in encode(continuation)
    assert decode(encode(continuation)) == continuation


def test_a_responses_relay_asks_for_background_mode() -> None:
    body = json.loads(background_body(b'{"model": "m", "input": "hi", "stream": true}'))
    assert body == {"model": "m", "input": "hi", "stream": True, "background": True, "store": True}
    continuation = recorded(
        "responses", upstream="openai", method="POST", url="https://x/v1/responses", body=b"{}"
    )
    assert json.loads(continuation.body)["background"] is True


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "resume"}, "continuation must be one of"),
        ({"fallback": "retry"}, "fallback must be one of"),
        ({"body": b"not json"}, "must be JSON"),
        ({"body": b"[1, 2]"}, "must be a JSON object"),
        ({"method": "GET"}, "replays a POST"),
        ({"upstream": ""}, "name of its upstream"),
    ],
)
def test_bad_continuations_are_refused_naming_the_problem(
    change: dict[str, Any], message: str
) -> None:
    fields: dict[str, Any] = {
        "kind": "prefill",
        "upstream": "a",
        "method": "POST",
        "url": "http://x/v1/messages",
        "body": b"{}",
        **change,
    }
    with pytest.raises(ValueError, match=message):
        Continuation(**fields)


def test_a_corrupt_stored_continuation_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot be read"):
        decode(b"\x00garbage")


def numbered(stream: bytes) -> bytes:
    """A recorded Responses stream with each event's ``sequence_number``, as the API sends
    them today (the recording predates them)."""
    out = []
    for number, frame in enumerate(frames(stream)):
        out.append(
            frame.replace(b'data: {"type":', b'data: {"sequence_number":%d,"type":' % number)
        )
    return b"".join(out)


@pytest.mark.parametrize("fraction", [0.3, 0.7])
@pytest.mark.parametrize("split", [None, 1, 7])
def test_responses_reattach_gives_back_the_uninterrupted_bytes(
    fraction: float, split: int | None
) -> None:
    whole = numbered(vector("openai_responses_text.sse"))
    stored, rest = cut(whole, fraction)
    continuation = recorded(
        "responses", upstream="openai", method="POST", url="https://x/v1/responses", body=b"{}"
    )
    attempt = plan(continuation, stored)
    assert attempt is not None
    assert attempt.kind == "responses"
    assert attempt.byte_exact
    assert attempt.method == "GET"
    last = max(
        data_of(frame)["sequence_number"]
        for frame in frames(stored)
        if "sequence_number" in data_of(frame)
    )
    response_id = data_of(frames(whole)[0])["response"]["id"]
    assert attempt.url == (
        f"https://x/v1/responses/{response_id}?stream=true&starting_after={last}"
    )
    # The provider sends what follows N (and, defensively, an event at or before N).
    again = frames(stored)[-1] if fraction > 0.5 else b""
    assert stored + stitched(attempt, again + rest, split) == whole
    assert attempt.stitcher.progressed


def test_a_response_url_keeps_the_creating_urls_query() -> None:
    """Azure's OpenAI endpoints need their ``api-version`` on every call: the re-attach and
    the cancel go to the response's path with the query kept."""
    created = "https://r.openai.azure.com/openai/v1/responses/?api-version=preview"
    assert response_url(created, "resp_1", "/cancel") == (
        "https://r.openai.azure.com/openai/v1/responses/resp_1/cancel?api-version=preview"
    )
    assert response_url("http://x/v1/responses", "resp_1", stream="true", starting_after=7) == (
        "http://x/v1/responses/resp_1?stream=true&starting_after=7"
    )
    whole = numbered(vector("openai_responses_text.sse"))
    stored, _ = cut(whole, 0.5)
    continuation = recorded("responses", upstream="azure", method="POST", url=created, body=b"{}")
    attempt = plan(continuation, stored)
    assert attempt is not None
    assert attempt.url.startswith("https://r.openai.azure.com/openai/v1/responses/resp_")
    assert "?api-version=preview&stream=true&starting_after=" in attempt.url


def test_responses_without_a_stored_id_use_the_fallback() -> None:
    continuation = recorded(
        "responses", upstream="openai", method="POST", url="https://x/v1/responses", body=b"{}"
    )
    assert plan(continuation, b"") is None
    restart = msgspec.structs.replace(continuation, fallback="restart")
    attempt = plan(restart, b"")
    assert attempt is not None
    assert attempt.kind == "restart"


def queued_event(name: str, number: int) -> bytes:
    payload = {
        "type": name,
        "sequence_number": number,
        "response": {"id": "resp_1", "status": "queued"},
    }
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode()


def test_a_queued_response_has_not_progressed() -> None:
    continuation = recorded(
        "responses", upstream="openai", method="POST", url="https://x/v1/responses", body=b"{}"
    )
    stored = queued_event("response.created", 0)
    attempt = plan(continuation, stored)
    assert attempt is not None
    queued = queued_event("response.queued", 1)
    assert attempt.stitcher.feed(queued) == queued
    assert not attempt.stitcher.progressed


def chat_stream(texts: list[str], chunk_id: str, *, role: bool = True) -> bytes:
    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        payload = {
            "id": chunk_id,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    head = [event({"role": "assistant", "content": ""})] if role else []
    body = [event({"content": text}) for text in texts]
    return b"".join([*head, *body, event({}, "stop"), b"data: [DONE]\n\n"])


@pytest.mark.parametrize("split", [None, 1, 5])
def test_continue_final_message_stitches_one_stream_with_one_done(split: int | None) -> None:
    tokens = [f"tok{i} " for i in range(10)]
    stored = b"".join(frames(chat_stream(tokens, "chatcmpl-1"))[:5])  # role + four tokens
    attempt = plan(chat(), stored)
    assert attempt is not None
    assert attempt.kind == "continue_final_message"
    body = json.loads(attempt.body or b"")
    assert body["messages"][-1] == {"role": "assistant", "content": "tok0 tok1 tok2 tok3 "}
    assert body["continue_final_message"] is True
    assert body["add_generation_prompt"] is False
    assert body["stream_options"] == {"include_usage": True}
    assert ("authorization", "Bearer secret") not in attempt.headers
    # The server streams the rest under an id of its own, and the usage asked for.
    rest = chat_stream(tokens[4:], "chatcmpl-2").replace(
        b"data: [DONE]",
        b'data: {"id":"chatcmpl-2","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":6}}'
        b"\n\ndata: [DONE]",
    )
    whole = stored + stitched(attempt, rest, split)
    events = [data_of(frame) for frame in frames(whole)]
    assert events.count("[DONE]") == 1
    chunks = [event for event in events if isinstance(event, dict)]
    assert {chunk["id"] for chunk in chunks} == {"chatcmpl-1"}
    assert all("usage" not in chunk for chunk in chunks)  # the relay did not ask for it
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert text == "".join(tokens)
    roles = [chunk for chunk in chunks if chunk["choices"][0]["delta"].get("role")]
    assert len(roles) == 1


def anthropic_stream(texts: list[str]) -> bytes:
    def event(name: str, payload: dict[str, Any]) -> bytes:
        data = json.dumps({"type": name, **payload}, separators=(",", ":")).encode()
        return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"

    return b"".join(
        [
            event("message_start", {"message": {"id": "msg_1", "usage": {"input_tokens": 5}}}),
            event(
                "content_block_start",
                {"index": 0, "content_block": {"type": "text", "text": ""}},
            ),
            event("ping", {}),
            *[
                event(
                    "content_block_delta",
                    {"index": 0, "delta": {"type": "text_delta", "text": text}},
                )
                for text in texts
            ],
            event("content_block_stop", {"index": 0}),
            event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {}}),
            event("message_stop", {}),
        ]
    )


def anthropic_text(stream: bytes) -> str:
    return "".join(
        data_of(frame)["delta"]["text"]
        for frame in frames(stream)
        if frame.startswith(b"event: content_block_delta")
    )


def prefill(fallback: str = "interrupted") -> Continuation:
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    return recorded(
        "prefill",
        upstream="anthropic",
        method="POST",
        url="https://api.anthropic.com/v1/messages",
        body=json.dumps(body).encode(),
        fallback=fallback,
    )


@pytest.mark.parametrize("fraction", [0.3, 0.7])
@pytest.mark.parametrize("split", [None, 1])
def test_prefill_continues_the_open_block_without_its_trailing_whitespace(
    fraction: float, split: int | None
) -> None:
    tokens = [f"tok{i} " for i in range(10)]
    whole = anthropic_stream(tokens)
    events = frames(whole)
    at = 3 + round(10 * fraction)  # message_start, block start, ping, then tokens
    stored = b"".join(events[:at])
    attempt = plan(prefill(), stored)
    assert attempt is not None
    assert attempt.kind == "prefill"
    assert not attempt.byte_exact
    sent = json.loads(attempt.body or b"")
    kept = anthropic_text(stored)
    assert sent["messages"][-1] == {"role": "assistant", "content": kept.rstrip()}
    # The model continues after the prefill: the space the API did not take comes first.
    done = len(kept.rstrip())
    full = "".join(tokens)
    continuation = anthropic_stream([full[done : done + 1], *tokens[len(kept.split()) :]])
    result = stored + stitched(attempt, continuation, split)
    names = [frame.split(b"\n", 1)[0] for frame in frames(result)]
    assert names.count(b"event: message_start") == 1
    assert names.count(b"event: content_block_start") == 1
    assert names.count(b"event: message_stop") == 1
    assert anthropic_text(result) == full
    indices = {data_of(frame).get("index") for frame in frames(result)} - {None}
    assert indices == {0}


def test_prefill_of_a_tool_call_uses_the_fallback() -> None:
    stored = vector("anthropic_messages_tool_use.sse")
    assert plan(prefill(), stored) is None
    attempt = plan(prefill("synthetic"), stored)
    assert attempt is not None
    assert attempt.kind == "synthetic"


def test_a_refused_prefill_goes_synthetic_when_the_route_chose_it() -> None:
    stored = b"".join(frames(anthropic_stream(["Hello ", "world "]))[:4])
    assert plan(prefill(), stored, refused=True) is None
    attempt = plan(prefill("synthetic"), stored, refused=True)
    assert attempt is not None
    assert attempt.kind == "synthetic"
    assert not attempt.byte_exact
    messages = json.loads(attempt.body or b"")["messages"]
    assert messages[-2] == {"role": "assistant", "content": "Hello"}
    assert messages[-1]["role"] == "user"


def test_a_restart_tells_readers_the_earlier_output_is_replaced() -> None:
    stored = b"".join(frames(chat_stream(["a", "b"], "chatcmpl-1"))[:2])
    continuation = msgspec.structs.replace(chat(), kind="restart")
    attempt = plan(continuation, stored)
    assert attempt is not None
    assert attempt.kind == "restart"
    assert attempt.body == continuation.body
    rest = chat_stream(["a", "b"], "chatcmpl-2")
    out = stitched(attempt, rest, None)
    first = frames(out)[0]
    assert first.startswith(b"event: " + RESTART_EVENT.encode())
    assert data_of(first) == {"replaces": len(stored)}
    assert out[len(first) :] == rest


def test_a_continuation_that_ends_mid_event_is_an_error() -> None:
    attempt = plan(chat(), b"")
    assert attempt is not None
    attempt.stitcher.feed(b'data: {"id":"x"')
    with pytest.raises(ValueError, match="middle of an event"):
        attempt.stitcher.end()
