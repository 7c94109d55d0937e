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


def test_run_alone_it_logs_a_line_per_call_saying_when_its_client_left() -> None:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asgi_disconnect.testing.fake_provider",
            "--port",
            "0",
            "--tokens",
            "40",
            "--rate",
            "100",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    stdout = process.stdout
    assert stdout is not None
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        match = re.search(r"http://\S+", lines.get(timeout=30))
        assert match is not None
        url = match.group()
        whole = httpx.post(url + OPENAI, json={"stream": True}, timeout=10)
        assert whole.text.endswith("data: [DONE]\n\n")
        assert re.fullmatch(
            r"\d\d:\d\d:\d\d #1 /v1/chat/completions \(stream\): 40 of 40 tokens, "
            r"finished in \d+\.\d\ds\n",
            lines.get(timeout=10),
        )
        with httpx.stream("POST", url + OPENAI, json={"stream": True}, timeout=10) as left:
            next(left.iter_bytes())  # the client leaves after its first bytes
        assert re.fullmatch(
            r"\d\d:\d\d:\d\d #2 /v1/chat/completions \(stream\): the client left after "
            r"\d+ of 40 tokens in \d+\.\d\ds\n",
            lines.get(timeout=10),
        )
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
        assert lines.empty()  # one line a call, no more
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
        "POST /v1/responses",
        "GET  /v1/responses/{id}",
        "POST /v1/responses/{id}/cancel",
        "continue_final_message",
        "x-fake-queued",
        "--background-ttl",
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


# continuations: the OpenAI Responses API, continue_final_message, Anthropic prefill

RESPONSES = "/v1/responses"
EIGHT = "".join(f"tok{i} " for i in range(8))


def names_and_payloads(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for name, data in parse_sse(raw):
        assert name is not None
        payload = json.loads(data)
        assert payload["type"] == name
        events.append((name, payload))
    return events


def test_responses_stream_has_the_recorded_shape(
    provider: FakeProvider, client: httpx.Client
) -> None:
    response = post(client, provider, RESPONSES, {"model": "m", "input": "hi", "stream": True})

    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    events = names_and_payloads(response.content)
    recorded = [name for name, _ in parse_sse((DATA / "openai_responses_text.sse").read_bytes())]
    assert collapse([name for name, _ in events]) == collapse([n or "" for n in recorded])
    assert [payload["sequence_number"] for _, payload in events] == list(range(len(events)))
    deltas = [p["delta"] for name, p in events if name == "response.output_text.delta"]
    assert deltas == [f"tok{i} " for i in range(8)]
    created, completed = events[0][1]["response"], events[-1][1]["response"]
    assert created["id"] == completed["id"] == "resp_fake_1"
    assert created["status"] == "in_progress"
    assert completed["status"] == "completed"
    assert completed["output"] == [
        {
            "type": "message",
            "id": "msg_fake_1",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": EIGHT, "annotations": []}],
        }
    ]
    assert completed["usage"] == {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 8,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 20,
    }
    (record,) = provider.wait_for_requests(1)
    assert record.api == "openai_responses"
    assert record.response_id == "resp_fake_1"
    assert record.finished
    assert record.tokens_sent == record.tokens_generated == 8
    assert provider.output_tokens("resp_fake_1") == 8


def test_responses_max_output_tokens_ends_incomplete(
    provider: FakeProvider, client: httpx.Client
) -> None:
    body = {"input": "hi", "stream": True, "max_output_tokens": 3}
    events = names_and_payloads(post(client, provider, RESPONSES, body).content)

    assert events[-1][0] == "response.incomplete"
    final = events[-1][1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "tok0 tok1 tok2 "


def test_responses_without_streaming_answers_the_response_object(
    provider: FakeProvider, client: httpx.Client
) -> None:
    payload = post(client, provider, RESPONSES, {"input": [{"role": "user", "content": "hi"}]})

    assert payload.json()["status"] == "completed"
    assert payload.json()["output"][0]["content"][0]["text"] == EIGHT
    stored = client.get(provider.url + RESPONSES + "/resp_fake_1")
    assert stored.json() == payload.json()


@pytest.mark.parametrize("cut", [0, 4, 7, 9, 14])
def test_background_reattach_after_a_hang_up_is_byte_identical(
    client: httpx.Client, cut: int
) -> None:
    body = {"model": "m", "input": "hi", "stream": True, "background": True}
    # 6 tokens, 50 ms apart: events 0-4 come first, the deltas are 5-10, then 11-14 at once.
    options: dict[str, Any] = {"tokens": 6, "tokens_per_second": 20, "created_at": 1_700_000_000}
    with FakeProvider(**options) as whole:
        uninterrupted = post(client, whole, RESPONSES, body).content
    with FakeProvider(**options) as provider:
        received = b""
        with client.stream("POST", provider.url + RESPONSES, json=body) as response:
            for chunk in response.iter_bytes():
                received += chunk
                if received.count(b"\n\n") > cut:
                    break
        first = b"".join(event + b"\n\n" for event in received.split(b"\n\n")[: cut + 1])
        (made,) = provider.wait_for_requests(1)
        assert made.wait_closed(timeout=5.0)
        params = {"stream": "true", "starting_after": str(cut)}
        rest = client.get(provider.url + RESPONSES + "/resp_fake_1", params=params)
        billed = provider.output_tokens("resp_fake_1")
        made, reattached = provider.wait_for_requests(2)

    assert json.loads(parse_sse(first)[-1][1])["sequence_number"] == cut
    assert rest.status_code == 200
    assert first + rest.content == uninterrupted
    assert len(names_and_payloads(uninterrupted)) == 15
    if cut < 10:  # left before the last token: the generation went on without it
        assert made.connection_closed_early
        assert made.tokens_sent < 6
    assert billed == made.tokens_generated == 6
    assert reattached.response_id == "resp_fake_1"
    assert reattached.tokens_generated == 0
    assert reattached.finished


def test_without_background_a_hang_up_stops_the_generation(
    provider: FakeProvider, client: httpx.Client
) -> None:
    headers = {"x-fake-tokens": "100000", "x-fake-rate": "1000"}
    with client.stream(
        "POST", provider.url + RESPONSES, json={"stream": True}, headers=headers
    ) as response:
        for line in response.iter_lines():
            if "tok5 " in line:
                break

    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert record.tokens_generated < record.tokens_planned
    assert client.get(provider.url + RESPONSES + "/resp_fake_1").json()["status"] == "cancelled"
    again = client.get(provider.url + RESPONSES + "/resp_fake_1", params={"stream": "true"})
    assert again.status_code == 400
    assert again.json()["error"] == {
        "message": "This response cannot be streamed because it was not created with "
        "background=true.",
        "type": "invalid_request_error",
        "param": "stream",
        "code": "invalid_request_error",
    }


def test_background_needs_store(provider: FakeProvider, client: httpx.Client) -> None:
    body = {"input": "hi", "background": True, "store": False}
    response = post(client, provider, RESPONSES, body)

    assert response.status_code == 400
    assert response.json()["error"]["param"] == "background"
    assert provider.requests == []


def test_background_without_streaming_is_queued_then_completes(
    provider: FakeProvider, client: httpx.Client
) -> None:
    created = post(client, provider, RESPONSES, {"input": "hi", "background": True})
    assert created.json()["status"] == "queued"
    assert created.json()["background"] is True

    events = client.get(provider.url + RESPONSES + "/resp_fake_1", params={"stream": "true"})
    assert names_and_payloads(events.content)[-1][0] == "response.completed"
    assert client.get(provider.url + RESPONSES + "/resp_fake_1").json()["status"] == "completed"
    assert provider.output_tokens("resp_fake_1") == 8


def test_cancel_stops_a_background_response_and_ends_its_live_stream(
    provider: FakeProvider, client: httpx.Client
) -> None:
    headers = {"x-fake-tokens": "1000", "x-fake-rate": "20"}
    body = {"stream": True, "background": True}
    with client.stream("POST", provider.url + RESPONSES, json=body, headers=headers) as response:
        lines = response.iter_lines()
        for line in lines:
            if "tok1 " in line:
                break
        cancelled = client.post(provider.url + RESPONSES + "/resp_fake_1/cancel")
        rest = list(lines)

    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    assert not any("response.completed" in line for line in rest)
    again = client.post(provider.url + RESPONSES + "/resp_fake_1/cancel")
    assert again.json() == cancelled.json()  # idempotent
    assert client.get(provider.url + RESPONSES + "/resp_fake_1").json()["status"] == "cancelled"
    assert 2 <= provider.output_tokens("resp_fake_1") < 1000


def test_a_response_without_background_cannot_be_cancelled(
    provider: FakeProvider, client: httpx.Client
) -> None:
    post(client, provider, RESPONSES, {"input": "hi"})
    refused = client.post(provider.url + RESPONSES + "/resp_fake_1/cancel")

    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "background=true" in refused.json()["error"]["message"]


def test_unknown_and_expired_response_ids_are_404(client: httpx.Client) -> None:
    with FakeProvider(tokens=3, tokens_per_second=0, background_ttl=0) as provider:
        body = {"input": "hi", "stream": True, "background": True}
        assert post(client, provider, RESPONSES, body).status_code == 200
        expired = client.get(provider.url + RESPONSES + "/resp_fake_1")
        unknown = client.get(provider.url + RESPONSES + "/resp_nope", params={"stream": "true"})
        cancel_unknown = client.post(provider.url + RESPONSES + "/resp_nope/cancel")

    assert expired.status_code == unknown.status_code == cancel_unknown.status_code == 404
    assert expired.json() == {
        "error": {
            "message": "Response with id 'resp_fake_1' not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


def test_queued_fault_never_leaves_the_queue(provider: FakeProvider, client: httpx.Client) -> None:
    body = b'{"stream": true, "background": true}'
    with open_raw(provider, RESPONSES, body, "x-fake-queued: 1\r\n") as sock:
        received = read_until(sock, b'"type":"response.queued"')
        while not received.endswith(b"\n\n\r\n"):  # the rest of that event's chunk
            received += sock.recv(65536)
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):  # open, and silent
            received += sock.recv(65536)
        stored = client.get(provider.url + RESPONSES + "/resp_fake_1").json()
        cancelled = client.post(provider.url + RESPONSES + "/resp_fake_1/cancel").json()
        sock.settimeout(10)
        received += read_until(sock, b"0\r\n\r\n")  # the body ends

    events = names_and_payloads(dechunk(received)[0])
    assert [name for name, _ in events] == ["response.created", "response.queued"]
    assert [p["response"]["status"] for _, p in events] == ["queued", "queued"]
    assert stored["status"] == "queued"
    assert cancelled["status"] == "cancelled"
    assert provider.output_tokens("resp_fake_1") == 0


def test_queued_fault_as_an_option(client: httpx.Client) -> None:
    with FakeProvider(queued_forever=True) as provider:
        created = post(client, provider, RESPONSES, {"input": "hi", "background": True})
        stored = client.get(provider.url + RESPONSES + "/resp_fake_1").json()

    assert created.json()["status"] == stored["status"] == "queued"


def chat_pieces(raw: bytes) -> tuple[list[str], dict[str, int]]:
    pieces, usage = [], {}
    for _, data in parse_sse(raw):
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
        if "content" in delta and "role" not in delta:
            pieces.append(delta["content"])
        usage = chunk.get("usage") or usage
    return pieces, usage


@pytest.mark.parametrize(
    ("prefix", "rest", "prefix_tokens"),
    [
        ("tok0 tok1 ", [f"tok{i} " for i in range(2, 8)], 2),
        ("tok0 tok1 to", ["k2 "] + [f"tok{i} " for i in range(3, 8)], 3),
        ("hello world ", [f"tok{i} " for i in range(2, 8)], 2),  # not T's prefix: 2 whole
        (EIGHT, [], 8),
        (
            [{"type": "text", "text": "tok0 "}, {"type": "text", "text": "t"}],
            ["ok1 "] + [f"tok{i} " for i in range(2, 8)],
            2,
        ),
    ],
)
def test_continue_final_message_streams_the_rest(
    provider: FakeProvider,
    client: httpx.Client,
    prefix: str | list[dict[str, str]],
    rest: list[str],
    prefix_tokens: int,
) -> None:
    body = {
        "stream": True,
        "stream_options": {"include_usage": True},
        "continue_final_message": True,
        "add_generation_prompt": False,
        "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": prefix}],
    }
    pieces, usage = chat_pieces(post(client, provider, OPENAI, body).content)

    assert pieces == rest
    assert usage == {
        "prompt_tokens": 12 + prefix_tokens,
        "completion_tokens": len(rest),
        "total_tokens": 12 + prefix_tokens + len(rest),
    }
    assert provider.wait_for_requests(1)[0].tokens_planned == len(rest)


def test_without_continue_final_message_a_final_assistant_message_is_context(
    provider: FakeProvider, client: httpx.Client
) -> None:
    body = {"stream": True, "messages": [{"role": "assistant", "content": "tok0 tok1 "}]}

    assert content_of(post(client, provider, OPENAI, body).content) == EIGHT


def test_continue_final_message_with_add_generation_prompt_is_vllms_400(
    provider: FakeProvider, client: httpx.Client
) -> None:
    body = {
        "continue_final_message": True,
        "add_generation_prompt": True,
        "messages": [{"role": "assistant", "content": "tok0 "}],
    }
    response = post(client, provider, OPENAI, body)
    not_assistant = post(
        client,
        provider,
        OPENAI,
        {"continue_final_message": True, "messages": [{"role": "user", "content": "x"}]},
    )

    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "Cannot set both `continue_final_message` and `add_generation_prompt` "
            "to True.",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    assert not_assistant.status_code == 400
    assert provider.requests == []


@pytest.mark.parametrize(
    "content", ["tok0 tok1", [{"type": "text", "text": "tok0 "}, {"type": "text", "text": "tok1"}]]
)
def test_anthropic_prefill_streams_the_rest(
    provider: FakeProvider, client: httpx.Client, content: str | list[dict[str, str]]
) -> None:
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": content}]
    response = post(client, provider, ANTHROPIC, {"stream": True, "messages": messages})

    events = parse_sse(response.content)
    deltas = [json.loads(d)["delta"]["text"] for n, d in events if n == "content_block_delta"]
    assert deltas == [" "] + [f"tok{i} " for i in range(2, 8)]
    assert json.loads(events[0][1])["message"]["usage"]["input_tokens"] == 14
    assert json.loads(events[-2][1])["usage"]["output_tokens"] == 7
    assert response.content.endswith(b'data: {"type":"message_stop"}\n\n')


@pytest.mark.parametrize(
    ("extra", "content", "message"),
    [
        ({}, "tok0 ", "messages: final assistant content cannot end with trailing whitespace"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            "tok0",
            "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found "
            "`text`. When `thinking` is enabled, a final `assistant` message must start with a "
            "thinking block",
        ),
        (
            {"model": "claude-sonnet-4-6"},
            "tok0",
            "This model does not support assistant message prefill. The conversation must end "
            "with a user message.",
        ),
        ({"model": "claude-opus-4-6-20260101"}, "tok0", "does not support assistant message"),
    ],
)
def test_anthropic_refuses_these_prefills(
    provider: FakeProvider,
    client: httpx.Client,
    extra: dict[str, Any],
    content: str,
    message: str,
) -> None:
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": content}]
    response = post(client, provider, ANTHROPIC, {"stream": True, "messages": messages, **extra})

    assert response.status_code == 400
    payload = response.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == "invalid_request_error"
    assert message in payload["error"]["message"]
    assert provider.requests == []


def test_prefill_refused_models_is_an_option(client: httpx.Client) -> None:
    prefill = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "tok0"}]
    with FakeProvider(tokens=3, tokens_per_second=0, prefill_refused_models={"fake-model"}) as p:
        refused = post(client, p, ANTHROPIC, {"messages": prefill})
        new_model = post(client, p, ANTHROPIC, {"model": "claude-opus-4-6", "messages": prefill})
        user_last = post(client, p, ANTHROPIC, {"messages": prefill[:1]})

    assert refused.status_code == 400
    assert new_model.status_code == 200  # the option replaces the default set
    assert new_model.json()["content"] == [{"type": "text", "text": " tok1 tok2 "}]
    assert user_last.json()["content"] == [{"type": "text", "text": "tok0 tok1 tok2 "}]
