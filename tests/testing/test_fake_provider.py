from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from asgi_disconnect.testing._fake_provider import GARBAGE, FakeProvider, Fault, ProviderRequest

if TYPE_CHECKING:
    from collections.abc import Iterator

DATA = Path(__file__).resolve().parent.parent / "data"
REPO = Path(__file__).resolve().parents[2]
OPENAI = "/v1/chat/completions"
ANTHROPIC = "/v1/messages"
CHUNK_KEYS = {"id", "object", "created", "model", "system_fingerprint", "choices"}
CHOICE_KEYS = {"index", "delta", "logprobs", "finish_reason"}



@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10.0) as http:
        yield http


def parse_sse(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) per dispatched event; enough SSE for these bodies."""
    events: list[tuple[str | None, str]] = []
    for block in raw.decode().split("\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
        if data:
            events.append((name, "\n".join(data)))
    return events


def collapse(kinds: list[str]) -> list[str]:
    """Fold runs of one kind into one entry so recordings of any length compare equal."""
    return [kind for i, kind in enumerate(kinds) if i == 0 or kinds[i - 1] != kind]


def openai_shape(raw: bytes) -> list[str]:
    kinds: list[str] = []
    for name, data in parse_sse(raw):
        assert name is None
        if data == "[DONE]":
            kinds.append("done")
            continue
        chunk = json.loads(data)
        assert set(chunk) - {"usage"} == CHUNK_KEYS
        if not chunk["choices"]:
            assert {"prompt_tokens", "completion_tokens", "total_tokens"} <= set(chunk["usage"])
            kinds.append("usage")
            continue
        (choice,) = chunk["choices"]
        assert set(choice) == CHOICE_KEYS
        if "role" in choice["delta"]:
            assert choice["delta"] == {"role": "assistant", "content": "", "refusal": None}
            kinds.append("role")
        elif choice["finish_reason"] is not None:
            assert choice["delta"] == {}
            kinds.append(f"finish:{choice['finish_reason']}")
        else:
            assert set(choice["delta"]) == {"content"}
            kinds.append("content")
    return collapse(kinds)


def anthropic_shape(raw: bytes) -> list[str]:
    names: list[str] = []
    for name, data in parse_sse(raw):
        assert name is not None
        assert json.loads(data)["type"] == name
        names.append(name)
    return collapse(names)


def content_of(raw: bytes) -> str:
    parts = []
    for _, data in parse_sse(raw):
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        if chunk.get("choices"):
            parts.append(chunk["choices"][0]["delta"].get("content", ""))
        elif chunk.get("type") == "content_block_delta":
            parts.append(chunk["delta"]["text"])
    return "".join(parts)


def post(
    client: httpx.Client,
    provider: FakeProvider,
    path: str,
    body: dict[str, Any],
    **headers: str,
) -> httpx.Response:
    return client.post(
        provider.url + path, json=body, headers={k.replace("_", "-"): v for k, v in headers.items()}
    )


def raw_post(path: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def test_openai_stream_has_the_recorded_framing(
    provider: FakeProvider, client: httpx.Client
) -> None:
    body = {"model": "gpt", "stream": True, "stream_options": {"include_usage": True}}
    response = post(client, provider, OPENAI, body)

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["transfer-encoding"] == "chunked"
    recorded = (DATA / "openai_chat_basic.sse").read_bytes()
    expected = ["role", "content", "finish:stop", "usage", "done"]
    assert openai_shape(recorded) == expected
    assert openai_shape(response.content) == expected
    assert response.content.endswith(b"\n\ndata: [DONE]\n\n")
    assert all(block.startswith(b"data: {") for block in response.content.split(b"\n\n")[:-2])
    assert b'": ' not in response.content  # compact JSON
    assert content_of(response.content) == "".join(f"tok{i} " for i in range(8))
    usage = json.loads(parse_sse(response.content)[-2][1])["usage"]
    assert usage == {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}
    (record,) = provider.wait_for_requests(1)
    assert record.api == "openai_chat"
    assert record.body == body
    assert record.stream
    assert record.finished
    assert record.tokens_sent == record.tokens_planned == 8
    assert not record.connection_closed_early


def test_openai_stream_without_include_usage_has_no_usage_chunk(
    provider: FakeProvider, client: httpx.Client
) -> None:
    response = post(client, provider, OPENAI, {"stream": True})

    assert openai_shape(response.content) == ["role", "content", "finish:stop", "done"]


def test_openai_max_tokens_cuts_with_finish_reason_length(
    provider: FakeProvider, client: httpx.Client
) -> None:
    body = {"stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    response = post(client, provider, OPENAI, body)

    assert openai_shape(response.content) == ["role", "content", "finish:length", "usage", "done"]
    assert content_of(response.content) == "tok0 tok1 tok2 "
    assert provider.wait_for_requests(1)[0].tokens_planned == 3


def test_anthropic_stream_has_the_recorded_framing(
    provider: FakeProvider, client: httpx.Client
) -> None:
    response = post(client, provider, ANTHROPIC, {"stream": True, "max_tokens": 1024})

    expected = [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    recorded = (DATA / "anthropic_messages_basic.sse").read_bytes()
    assert anthropic_shape(recorded) == expected
    assert anthropic_shape(response.content) == expected
    assert response.headers["content-type"] == "text/event-stream"
    events = parse_sse(response.content)
    assert json.loads(events[0][1])["message"]["usage"]["input_tokens"] == 12
    message_delta = json.loads(events[-2][1])
    assert message_delta["delta"]["stop_reason"] == "end_turn"
    assert message_delta["usage"]["output_tokens"] == 8
    assert content_of(response.content) == "".join(f"tok{i} " for i in range(8))
    assert response.content.endswith(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')


def test_anthropic_max_tokens_stops_with_max_tokens(
    provider: FakeProvider, client: httpx.Client
) -> None:
    response = post(client, provider, ANTHROPIC, {"stream": True, "max_tokens": 2})

    events = parse_sse(response.content)
    assert json.loads(events[-2][1])["delta"]["stop_reason"] == "max_tokens"
    assert content_of(response.content) == "tok0 tok1 "


def test_rate_is_honoured(client: httpx.Client) -> None:
    with FakeProvider(tokens=20, tokens_per_second=50) as provider:
        started = time.monotonic()
        response = post(client, provider, OPENAI, {"stream": True})
        elapsed = time.monotonic() - started

    assert content_of(response.content).count("tok") == 20
    assert elapsed >= 0.3


def test_header_overrides_token_count_and_rate(
    provider: FakeProvider, client: httpx.Client
) -> None:
    started = time.monotonic()
    response = post(
        client, provider, ANTHROPIC, {"stream": True}, x_fake_tokens="5", x_fake_rate="20"
    )
    elapsed = time.monotonic() - started

    assert content_of(response.content) == "tok0 tok1 tok2 tok3 tok4 "
    assert elapsed >= 0.15
    assert provider.wait_for_requests(1)[0].tokens_planned == 5


def test_invalid_override_header_is_a_400(provider: FakeProvider, client: httpx.Client) -> None:
    response = post(client, provider, OPENAI, {"stream": True}, x_fake_tokens="many")

    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert provider.requests == []


def test_client_closing_mid_stream_is_recorded_before_the_next_write(
    provider: FakeProvider, client: httpx.Client
) -> None:
    # 20 s between tokens: a hang-up seen within the wait below was not found by a write.
    headers = {"x-fake-tokens": "100", "x-fake-rate": "0.05"}
    with client.stream(
        "POST", provider.url + OPENAI, json={"stream": True}, headers=headers
    ) as response:
        for line in response.iter_lines():
            if "tok0" in line:
                break
    closed_by_client = time.monotonic()

    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert not record.finished
    assert record.tokens_sent == 1 < record.tokens_planned
    assert record.closed_at is not None
    assert record.closed_at - closed_by_client < 5.0


def test_client_closing_a_fast_stream_stops_generation(
    provider: FakeProvider, client: httpx.Client
) -> None:
    headers = {"x-fake-tokens": "100000", "x-fake-rate": "1000"}
    with client.stream(
        "POST", provider.url + ANTHROPIC, json={"stream": True}, headers=headers
    ) as response:
        for line in response.iter_lines():
            if "tok5 " in line:
                break

    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert 6 <= record.tokens_sent < record.tokens_planned


def test_close_during_first_token_delay_is_recorded(
    provider: FakeProvider, client: httpx.Client
) -> None:
    headers = {"x-fake-first-token-delay": "30"}
    with client.stream(
        "POST", provider.url + OPENAI, json={"stream": True}, headers=headers
    ) as response:
        assert response.status_code == 200

    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert record.tokens_sent == 0


@pytest.mark.parametrize(
    ("path", "body", "usage_keys"),
    [
        (OPENAI, {"model": "m"}, {"prompt_tokens", "completion_tokens", "total_tokens"}),
        (ANTHROPIC, {"max_tokens": 100}, {"input_tokens", "output_tokens"}),
    ],
)
def test_non_streaming_response_has_the_real_shape(
    provider: FakeProvider,
    client: httpx.Client,
    path: str,
    body: dict[str, Any],
    usage_keys: set[str],
) -> None:
    response = post(client, provider, path, body)

    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    text = "".join(f"tok{i} " for i in range(8))
    if path == OPENAI:
        assert payload["object"] == "chat.completion"
        assert payload["choices"][0]["message"] == {
            "role": "assistant",
            "content": text,
            "refusal": None,
        }
        assert payload["choices"][0]["finish_reason"] == "stop"
        assert payload["usage"]["completion_tokens"] == 8
    else:
        assert payload["type"] == "message"
        assert payload["content"] == [{"type": "text", "text": text}]
        assert payload["stop_reason"] == "end_turn"
        assert payload["usage"]["output_tokens"] == 8
    assert usage_keys <= set(payload["usage"])
    (record,) = provider.wait_for_requests(1)
    assert not record.stream
    assert record.finished
    assert record.tokens_sent == 8


def test_abandoned_non_streaming_call_is_recorded(provider: FakeProvider) -> None:
    host, port = provider.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw_post(OPENAI, b"{}", "x-fake-tokens: 50\r\nx-fake-rate: 10\r\n"))
        (record,) = provider.wait_for_requests(1)
        assert not record.wait_closed(timeout=0.2)

    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert not record.finished
    assert record.tokens_sent == 0
    assert record.tokens_generated < record.tokens_planned == 50


@pytest.mark.parametrize("path", [OPENAI, ANTHROPIC])
def test_error_injection_ends_the_stream_with_the_provider_error_frame(
    provider: FakeProvider, client: httpx.Client, path: str
) -> None:
    response = post(client, provider, path, {"stream": True}, x_fake_error_after="3")

    assert response.status_code == 200
    events = parse_sse(response.content)
    assert content_of(response.content) == "tok0 tok1 tok2 "
    name, data = events[-1]
    if path == OPENAI:
        assert name is None
        assert json.loads(data)["error"]["type"] == "server_error"
        assert b"[DONE]" not in response.content
    else:
        assert name == "error"
        assert json.loads(data) == {
            "type": "error",
            "error": {"type": "overloaded_error", "message": "Overloaded"},
        }
    assert response.headers["connection"] == "close"
    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.error_sent
    assert record.tokens_sent == 3
    assert not record.finished
    assert not record.connection_closed_early


def test_error_injection_without_streaming_is_an_error_status(
    provider: FakeProvider, client: httpx.Client
) -> None:
    response = post(client, provider, ANTHROPIC, {}, x_fake_error_after="1")

    assert response.status_code == 529
    assert response.json()["error"]["type"] == "overloaded_error"


def test_bad_json_is_a_400(provider: FakeProvider, client: httpx.Client) -> None:
    response = client.post(provider.url + OPENAI, content=b"{not json")

    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert provider.requests == []


def test_unknown_path_is_a_404_and_health_is_ok(
    provider: FakeProvider, client: httpx.Client
) -> None:
    missing = client.post(provider.url + "/v1/completions", json={})
    health = client.get(provider.url + "/health")

    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Invalid URL (POST /v1/completions)"
    assert health.status_code == 200
    assert health.text == "ok"


def test_chunked_request_body_is_rejected(provider: FakeProvider) -> None:
    host, port = provider.url.removeprefix("http://").split(":")
    request = f"POST {OPENAI} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    request += "2\r\n{}\r\n0\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request.encode())
        reply = sock.recv(4096)

    assert reply.startswith(b"HTTP/1.1 411 ")


def test_keep_alive_serves_two_requests_on_one_connection(
    provider: FakeProvider, client: httpx.Client
) -> None:
    first = post(client, provider, OPENAI, {"stream": True})
    second = post(client, provider, ANTHROPIC, {})

    assert first.status_code == second.status_code == 200
    a, b = provider.wait_for_requests(2)
    assert a.connection_id == b.connection_id
    assert a.finished
    assert b.finished


def test_stop_closes_open_connections(client: httpx.Client) -> None:
    provider = FakeProvider(tokens=1000, tokens_per_second=10).start()
    with client.stream("POST", provider.url + OPENAI, json={"stream": True}) as response:
        lines = response.iter_lines()
        assert any("tok0" in line for line in lines)
        provider.stop()
        with pytest.raises(httpx.RemoteProtocolError):
            for _ in lines:
                pass

    (record,) = provider.requests
    assert record.wait_closed(timeout=0)
    assert not record.connection_closed_early
    assert not record.finished
    provider.stop()


def test_wait_for_requests_times_out_and_reset_forgets(
    provider: FakeProvider, client: httpx.Client
) -> None:
    with pytest.raises(TimeoutError):
        provider.wait_for_requests(1, timeout=0.05)
    post(client, provider, OPENAI, {})
    assert len(provider.wait_for_requests(1)) == 1

    provider.reset()

    assert provider.requests == []


def test_async_api_works_from_another_event_loop() -> None:
    async def scenario() -> tuple[list[ProviderRequest], bool]:
        provider = FakeProvider(tokens=3, tokens_per_second=0)
        async with provider, httpx.AsyncClient(timeout=10.0) as http:
            waiting = asyncio.create_task(provider.await_requests(1, timeout=10.0))
            response = await http.post(provider.url + ANTHROPIC, json={"stream": True})
            assert response.status_code == 200
            records = await waiting
            closed = await records[0].await_closed(timeout=10.0)
            with pytest.raises(TimeoutError):
                await provider.await_requests(2, timeout=0.05)
        return records, closed

    records, closed = asyncio.run(scenario())

    assert closed
    assert records[0].finished


def test_cli_serves_until_interrupted() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "asgi_disconnect.testing.fake_provider", "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    stdout = process.stdout
    assert stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        match = re.search(r"http://\S+", lines.get(timeout=30))
        assert match is not None
        health = httpx.get(match.group() + "/health", timeout=10)
        assert health.text == "ok"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        process.wait(timeout=10)
        stdout.close()


# faults


def read_all(sock: socket.socket) -> tuple[bytes, BaseException | None]:
    """Everything the server sends until it closes, and how it closed (None: a clean FIN)."""
    received = b""
    while True:
        try:
            data = sock.recv(65536)
        except OSError as exc:
            return received, exc
        if not data:
            return received, None
        received += data


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        data = sock.recv(65536)
        assert data, f"closed before {marker!r}: {received!r}"
        received += data
    return received


def open_raw(provider: FakeProvider, path: str, body: bytes, headers: str = "") -> socket.socket:
    host, port = provider.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(raw_post(path, body, headers))
    return sock


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The body of a chunked response and whether its terminating chunk arrived."""
    _, _, rest = raw.partition(b"\r\n\r\n")
    body = b""
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return body, True
        body += rest[:size]
        rest = rest[size + 2 :]
    return body, False


@pytest.mark.parametrize(
    ("text", "fault"),
    [
        ("reset-after=20", Fault(kind="reset", after=20)),
        ("stall-after=3", Fault(kind="stall", after=3)),
        ("stall-after=3;seconds=1.5", Fault(kind="stall", after=3, seconds=1.5)),
        (" Stall-After=0 ; seconds=inf ", Fault(kind="stall", after=0)),
        ("garbage-after=7", Fault(kind="garbage", after=7)),
        ("truncate-after=0", Fault(kind="truncate", after=0)),
        ("error-after=2", Fault(kind="error", after=2)),
        ("status=429", Fault(kind="status", status=429)),
        ("none", None),
        ("", None),
    ],
)
def test_fault_text_form_round_trips(text: str, fault: Fault | None) -> None:
    assert Fault.parse(text) == fault
    if fault is not None:
        assert Fault.parse(str(fault)) == fault


@pytest.mark.parametrize(
    "text",
    [
        "reset",
        "reset-after=",
        "reset-after=-1",
        "reset-after=1.5",
        "explode-after=3",
        "status=200",
        "status=600",
        "status=abc",
        "reset-after=3;seconds=2",
        "stall-after=3;seconds=-1",
        "stall-after=3;seconds=nan",
        "stall-after=3;seconds=1;seconds=2",
        "stall-after=3;colour=red",
    ],
)
def test_malformed_fault_is_refused_with_the_grammar(text: str) -> None:
    with pytest.raises(ValueError, match="reset-after=N"):
        Fault.parse(text)


def test_fault_constructor_validates() -> None:
    with pytest.raises(ValueError, match="status"):
        Fault(kind="status", status=302)
    with pytest.raises(ValueError, match="after"):
        Fault(kind="reset", after=-1)


@pytest.mark.parametrize("path", [OPENAI, ANTHROPIC])
def test_reset_after_n_tokens_is_a_tcp_reset(provider: FakeProvider, path: str) -> None:
    with open_raw(provider, path, b'{"stream": true}', "x-fake-fault: reset-after=3\r\n") as sock:
        received, error = read_all(sock)

    assert isinstance(error, ConnectionResetError)
    body, terminated = dechunk(received)
    assert not terminated
    assert content_of(body) == "tok0 tok1 tok2 "
    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.fault == Fault(kind="reset", after=3)
    assert record.fault_applied
    assert record.tokens_sent == 3
    assert not record.finished
    assert not record.connection_closed_early


def test_reset_reaches_an_httpx_client_as_a_read_error(
    provider: FakeProvider, client: httpx.Client
) -> None:
    with pytest.raises(httpx.ReadError):
        post(client, provider, OPENAI, {"stream": True}, x_fake_fault="reset-after=2")


def test_stall_forever_keeps_the_socket_open_until_the_client_leaves(
    provider: FakeProvider,
) -> None:
    with open_raw(provider, OPENAI, b'{"stream": true}', "x-fake-fault: stall-after=2\r\n") as sock:
        received = read_until(sock, b"tok1 ")
        (record,) = provider.wait_for_requests(1)
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):  # open, and silent
            received += sock.recv(65536)
        assert record.fault_applied
        assert not record.wait_closed(timeout=0)

    assert b"tok2" not in received
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert record.tokens_sent == 2


def test_stall_for_seconds_pauses_then_finishes(
    provider: FakeProvider, client: httpx.Client
) -> None:
    started = time.monotonic()
    response = post(
        client, provider, ANTHROPIC, {"stream": True}, x_fake_fault="stall-after=4;seconds=0.4"
    )
    elapsed = time.monotonic() - started

    assert elapsed >= 0.4
    assert content_of(response.content) == "".join(f"tok{i} " for i in range(8))
    assert response.content.endswith(b'data: {"type":"message_stop"}\n\n')
    (record,) = provider.wait_for_requests(1)
    assert record.finished
    assert record.fault_applied


@pytest.mark.parametrize("path", [OPENAI, ANTHROPIC])
def test_garbage_after_n_tokens(provider: FakeProvider, path: str) -> None:
    with open_raw(provider, path, b'{"stream": true}', "x-fake-fault: garbage-after=2\r\n") as sock:
        received, error = read_all(sock)

    assert error is None
    body, terminated = dechunk(received)
    assert terminated
    assert body.endswith(b"\n\n" + GARBAGE)
    assert content_of(body[: -len(GARBAGE)]) == "tok0 tok1 "
    with pytest.raises(UnicodeDecodeError):
        GARBAGE.decode()
    assert b"connection: close" in received.partition(b"\r\n\r\n")[0]
    (record,) = provider.wait_for_requests(1)
    assert record.fault_applied
    assert record.tokens_sent == 2
    assert not record.finished


@pytest.mark.parametrize(
    ("path", "marker"), [(OPENAI, b"data: [DONE]"), (ANTHROPIC, b"message_stop")]
)
def test_truncate_ends_the_body_cleanly_without_the_terminal_marker(
    provider: FakeProvider, client: httpx.Client, path: str, marker: bytes
) -> None:
    body = {"stream": True, "stream_options": {"include_usage": True}}
    response = post(client, provider, path, body, x_fake_fault="truncate-after=5")
    again = post(client, provider, path, body)  # the same connection goes on

    assert response.status_code == 200
    assert content_of(response.content) == "tok0 tok1 tok2 tok3 tok4 "
    assert marker not in response.content
    assert b'finish_reason":"stop' not in response.content
    assert b"usage" not in response.content.partition(b"tok0")[2]
    assert marker in again.content
    first, second = provider.wait_for_requests(2)
    assert first.connection_id == second.connection_id
    assert first.fault_applied
    assert not first.finished
    assert not first.connection_closed_early
    assert first.tokens_sent == 5
    assert second.fault is None
    assert second.finished


def test_fault_after_more_tokens_than_planned_strikes_after_the_last(
    provider: FakeProvider, client: httpx.Client
) -> None:
    response = post(client, provider, OPENAI, {"stream": True}, x_fake_fault="truncate-after=99")

    assert content_of(response.content) == "".join(f"tok{i} " for i in range(8))
    assert b"[DONE]" not in response.content
    assert provider.wait_for_requests(1)[0].fault_applied


def test_error_fault_is_the_provider_error_frame(
    provider: FakeProvider, client: httpx.Client
) -> None:
    response = post(client, provider, ANTHROPIC, {"stream": True}, x_fake_fault="error-after=1")

    assert parse_sse(response.content)[-1][0] == "error"
    (record,) = provider.wait_for_requests(1)
    assert record.error_sent
    assert record.fault_applied
    assert record.tokens_sent == 1


@pytest.mark.parametrize(
    ("path", "status", "kind", "code"),
    [
        (OPENAI, 400, "invalid_request_error", None),
        (OPENAI, 429, "requests", "rate_limit_exceeded"),
        (OPENAI, 500, "server_error", None),
        (ANTHROPIC, 400, "invalid_request_error", None),
        (ANTHROPIC, 429, "rate_limit_error", None),
        (ANTHROPIC, 500, "api_error", None),
        (ANTHROPIC, 529, "overloaded_error", None),
    ],
)
def test_status_fault_answers_the_provider_error_instead_of_streaming(
    provider: FakeProvider,
    client: httpx.Client,
    path: str,
    status: int,
    kind: str,
    code: str | None,
) -> None:
    response = post(client, provider, path, {"stream": True}, x_fake_fault=f"status={status}")

    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    payload = response.json()
    if path == OPENAI:
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert payload["error"]["type"] == kind
        assert payload["error"]["code"] == code
    else:
        assert payload["type"] == "error"
        assert payload["error"]["type"] == kind
        assert payload["error"]["message"]
    assert ("retry-after" in response.headers) == (status in (429, 529))
    (record,) = provider.wait_for_requests(1)
    assert record.fault == Fault(kind="status", status=status)
    assert record.fault_applied
    assert record.error_sent
    assert record.tokens_generated == record.tokens_sent == 0


def test_a_global_fault_and_per_request_headers_serve_a_mix(client: httpx.Client) -> None:
    with FakeProvider(tokens=6, tokens_per_second=0, fault="truncate-after=2") as provider:
        faulty = post(client, provider, OPENAI, {"stream": True})
        healthy = post(client, provider, OPENAI, {"stream": True}, x_fake_fault="none")
        refused = post(client, provider, OPENAI, {"stream": True}, x_fake_fault="status=500")
        records = provider.wait_for_requests(3)

    assert provider.fault == Fault(kind="truncate", after=2)
    assert content_of(faulty.content) == "tok0 tok1 "
    assert healthy.content.endswith(b"data: [DONE]\n\n")
    assert refused.status_code == 500
    assert [str(r.fault) if r.fault else None for r in records] == [
        "truncate-after=2",
        None,
        "status=500",
    ]
    assert [r.fault_applied for r in records] == [True, False, True]


def test_malformed_fault_header_is_a_400_and_not_recorded(
    provider: FakeProvider, client: httpx.Client
) -> None:
    response = post(client, provider, OPENAI, {"stream": True}, x_fake_fault="explode")

    assert response.status_code == 400
    assert "x-fake-fault" in response.json()["error"]["message"]
    assert provider.requests == []


def test_client_leaving_before_the_fault_leaves_it_unapplied(
    provider: FakeProvider, client: httpx.Client
) -> None:
    headers = {"x-fake-fault": "reset-after=50", "x-fake-tokens": "100", "x-fake-rate": "50"}
    with client.stream(
        "POST", provider.url + OPENAI, json={"stream": True}, headers=headers
    ) as response:
        for line in response.iter_lines():
            if "tok0" in line:
                break

    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert not record.fault_applied


def test_non_streaming_faults(provider: FakeProvider, client: httpx.Client) -> None:
    with open_raw(provider, OPENAI, b"{}", "x-fake-fault: reset-after=3\r\n") as sock:
        received, error = read_all(sock)
    garbage = post(client, provider, OPENAI, {}, x_fake_fault="garbage-after=1")
    truncated = post(client, provider, ANTHROPIC, {}, x_fake_fault="truncate-after=1")
    stalled_then_fine = post(client, provider, OPENAI, {}, x_fake_fault="stall-after=2;seconds=0.1")

    assert received == b""
    assert isinstance(error, ConnectionResetError)
    assert garbage.status_code == 200
    assert garbage.content == GARBAGE
    assert truncated.status_code == 200
    with pytest.raises(ValueError, match=r"JSON|Expecting|Unterminated"):
        truncated.json()
    assert stalled_then_fine.json()["usage"]["completion_tokens"] == 8
    reset, mangled, cut, stalled = provider.wait_for_requests(4)
    assert reset.fault_applied
    assert reset.tokens_generated == 3
    assert reset.tokens_sent == 0
    assert mangled.fault_applied
    assert not mangled.finished
    assert cut.fault_applied
    assert stalled.finished


def test_cli_help_lists_routes_defaults_and_faults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asgi_disconnect.testing.fake_provider", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout

    for text in (
        "POST /v1/chat/completions",
        "POST /v1/messages",
        "GET  /health",
        "(default: 200.0)",
        "x-fake-fault",
        "reset-after=N",
        "stall-after=N[;seconds=S]",
        "garbage-after=N",
        "truncate-after=N",
        "status=CODE",
    ):
        assert text in out


def test_cli_fault_applies_to_every_request() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asgi_disconnect.testing.fake_provider",
            "--port",
            "0",
            "--fault",
            "status=429",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    stdout = process.stdout
    assert stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(stdout.readline()), daemon=True).start()
    try:
        line = lines.get(timeout=30)
        assert "fault status=429" in line
        match = re.search(r"http://\S+", line)
        assert match is not None
        response = httpx.post(match.group() + OPENAI, json={"stream": True}, timeout=10)
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()
        process.wait(timeout=10)
        stdout.close()


def test_cli_refuses_a_malformed_fault() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asgi_disconnect.testing.fake_provider", "--fault", "explode"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 2
    assert "invalid fault 'explode'" in result.stderr
