from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import TYPE_CHECKING

import pytest

from asgi_disconnect.testing._fake_provider import FakeProvider
from asgi_disconnect.testing._socket_client import (
    ClientResult,
    _ChunkedDecoder,
    request,
    stalled_request,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine
    from typing import Any

OPENAI = "/v1/chat/completions"
STREAM = json.dumps({"stream": True}).encode()
CHUNKED_BODY = (
    b"5;name=value\r\nhello\r\n1a\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-trailer: 1\r\n\r\n"
)
DECODED = b"helloabcdefghijklmnopqrstuvwxyz"


def run(coroutine: Coroutine[Any, Any, ClientResult]) -> ClientResult:
    return asyncio.run(coroutine)


async def with_server(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    client: Callable[[str], Awaitable[ClientResult]],
) -> ClientResult:
    """Run `client(url)` against a one-off asyncio server on loopback."""
    connections: list[tuple[asyncio.StreamWriter, asyncio.Task[Any]]] = []

    async def tracked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connections.append((writer, task))
        await handler(reader, writer)

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        return await client(f"http://127.0.0.1:{port}/path?q=1")
    finally:
        server.close()
        for writer, _ in connections:
            writer.close()
        if connections:
            await asyncio.wait([task for _, task in connections], timeout=5.0)
        await server.wait_closed()


def scripted(
    pieces: list[bytes], received: list[bytes] | None = None
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A handler that reads the request head, then writes `pieces` one write at a time."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if received is not None:
            received.append(head)
        # The client may hang up first; that is what some tests are about.
        with contextlib.suppress(ConnectionError):
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
            writer.close()
            await writer.wait_closed()

    return handler


def test_complete_streamed_response_is_dechunked(provider: FakeProvider) -> None:
    result = run(request(provider.url + OPENAI, method="POST", body=STREAM))

    assert result.status == 200
    assert result.complete
    assert result.stopped_by == "complete"
    assert result.headers["transfer-encoding"] == "chunked"
    assert ("content-type", "text/event-stream") in result.headers_list
    assert result.body.startswith(b"data: {")
    assert result.body.endswith(b"data: [DONE]\n\n")
    assert b"\r\n" not in result.body
    (record,) = provider.wait_for_requests(1)
    assert record.body == {"stream": True}


def test_content_length_response_is_complete(provider: FakeProvider) -> None:
    result = run(request(provider.url + "/health"))

    assert (result.status, result.body, result.complete) == (200, b"ok", True)


def test_disconnect_after_bytes_counts_dechunked_body_bytes(provider: FakeProvider) -> None:
    headers = {"x-fake-tokens": "10000", "x-fake-rate": "500"}
    result = run(
        request(
            provider.url + OPENAI,
            method="POST",
            headers=headers,
            body=STREAM,
            disconnect_after_bytes=700,
        )
    )

    assert result.status == 200
    assert not result.complete
    assert result.stopped_by == "disconnect_after_bytes"
    assert len(result.body) >= 700
    assert all(block.startswith(b"data: {") for block in result.body.split(b"\n\n")[:-1])
    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert record.tokens_sent < record.tokens_planned


def test_disconnect_when_predicate_holds(provider: FakeProvider) -> None:
    headers = {"x-fake-tokens": "10000", "x-fake-rate": "500"}
    result = run(
        request(
            provider.url + OPENAI,
            method="POST",
            headers=headers,
            body=STREAM,
            disconnect_when=lambda body: b'"tok2 "' in body,
        )
    )

    assert result.stopped_by == "disconnect_when"
    assert b'"tok2 "' in result.body
    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early


def test_disconnect_after_seconds_before_the_response_head(provider: FakeProvider) -> None:
    # Non-streaming: no head is sent until every token was generated, 30 s from now.
    headers = {"x-fake-first-token-delay": "30"}
    result = run(
        request(
            provider.url + OPENAI,
            method="POST",
            headers=headers,
            body=b"{}",
            disconnect_after_seconds=0.2,
        )
    )

    assert result.status is None
    assert result.headers == {}
    assert not result.complete
    assert result.stopped_by == "disconnect_after_seconds"
    assert 0.2 <= result.elapsed < 10
    (record,) = provider.wait_for_requests(1)
    assert record.wait_closed(timeout=5.0)
    assert record.connection_closed_early
    assert record.tokens_sent == 0


def test_timeout_raises() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await reader.read()  # hold the connection open until the client gives up
        writer.close()

    async def client(url: str) -> ClientResult:
        return await request(url, timeout=0.2)

    with pytest.raises(TimeoutError):
        run(with_server(handler, client))


def test_chunked_decoding_over_every_split_of_the_stream() -> None:
    for i, j in itertools.combinations(range(len(CHUNKED_BODY) + 1), 2):
        decoder = _ChunkedDecoder()
        parts = [CHUNKED_BODY[:i], CHUNKED_BODY[i:j], CHUNKED_BODY[j:]]
        decoded = b"".join(decoder.feed(part) for part in parts)
        assert decoded == DECODED, (i, j)
        assert decoder.done


def test_chunked_decoder_rejects_a_bad_size_line() -> None:
    with pytest.raises(ValueError, match="chunk size"):
        _ChunkedDecoder().feed(b"zz\r\n")


def test_request_over_a_byte_by_byte_chunked_response() -> None:
    head = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    response = head + CHUNKED_BODY + b"garbage after the response"
    received: list[bytes] = []

    async def client(url: str) -> ClientResult:
        return await request(url, method="POST", headers={"x-test": "1"}, body=b"{}")

    result = run(with_server(scripted([bytes([b]) for b in response], received), client))

    assert result.status == 200
    assert result.body == DECODED
    assert result.complete
    (request_head,) = received
    assert request_head.startswith(b"POST /path?q=1 HTTP/1.1\r\n")
    assert b"\r\nx-test: 1\r\n" in request_head
    assert b"\r\nContent-Length: 2\r\n" in request_head


def test_disconnect_after_bytes_over_a_chunked_response() -> None:
    pieces = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"]
    pieces += [b"3\r\nabc\r\n"] * 5

    async def client(url: str) -> ClientResult:
        return await request(url, disconnect_after_bytes=4)

    result = run(with_server(scripted(pieces), client))

    assert result.stopped_by == "disconnect_after_bytes"
    assert not result.complete
    assert len(result.body) >= 4
    assert set(result.body) <= set(b"abc")


def test_body_read_until_close_and_early_server_close() -> None:
    async def client(url: str) -> ClientResult:
        return await request(url)

    until_close = run(with_server(scripted([b"HTTP/1.1 200 OK\r\n\r\nall of it"]), client))
    truncated = run(
        with_server(scripted([b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"]), client)
    )

    assert (until_close.body, until_close.complete) == (b"all of it", True)
    assert (truncated.body, truncated.complete) == (b"abc", False)
    assert truncated.stopped_by == "server_closed"


@pytest.mark.parametrize(("abortive", "server_sees"), [(False, "eof"), (True, "reset")])
def test_close_is_normal_or_abortive(abortive: bool, server_sees: str) -> None:
    async def scenario() -> str:
        outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            try:
                outcome.set_result("eof" if await reader.read() == b"" else "data")
            except ConnectionResetError:
                outcome.set_result("reset")
            writer.close()

        async def client(url: str) -> ClientResult:
            result = await request(url, disconnect_after_seconds=0.05, abortive=abortive)
            await asyncio.wait_for(asyncio.shield(outcome), timeout=5.0)
            return result

        await with_server(handler, client)
        return outcome.result()

    assert asyncio.run(scenario()) == server_sees


def test_stalled_client_keeps_the_provider_connection_open_then_resumes(
    provider: FakeProvider,
) -> None:
    # ~7 MB: more than the loopback send buffer can absorb (tcp_wmem max is 4 MiB).
    headers = {"x-fake-tokens": "30000", "x-fake-rate": "inf"}

    async def scenario() -> ClientResult:
        async with await stalled_request(
            provider.url + OPENAI, method="POST", headers=headers, body=STREAM, read_bytes=100
        ) as client:
            assert client.status == 200
            assert client.headers["content-type"] == "text/event-stream"
            assert 100 <= len(client.body) < 100 + 8192
            (record,) = await provider.await_requests(1)
            assert not await record.await_closed(timeout=0.5)
            assert not await client.wait_server_closed(timeout=0)
            assert record.tokens_sent < record.tokens_planned
            assert not record.connection_closed_early
            result = await client.resume(timeout=120.0)
            assert await record.await_closed(timeout=5.0)
            assert record.finished
            return result

    result = asyncio.run(scenario())

    assert result.complete
    assert result.stopped_by == "complete"
    assert result.body.endswith(b"data: [DONE]\n\n")
    assert result.body.count(b'"content":"tok') == 30000


def test_stalled_client_sees_the_server_close(provider: FakeProvider) -> None:
    headers = {"x-fake-error-after": "3"}

    async def scenario() -> tuple[bool, bytes]:
        async with await stalled_request(
            provider.url + OPENAI, method="POST", headers=headers, body=STREAM
        ) as client:
            closed = await client.wait_server_closed(timeout=5.0)
            return closed, client.body

    closed, body = asyncio.run(scenario())

    assert closed
    assert b'"type":"server_error"' in body


def test_stalled_client_waiting_on_an_open_connection_times_out(provider: FakeProvider) -> None:
    headers = {"x-fake-first-token-delay": "30"}

    async def scenario() -> bool:
        async with await stalled_request(
            provider.url + OPENAI, method="POST", headers=headers, body=STREAM
        ) as client:
            closed = await client.wait_server_closed(timeout=0.2)
            await client.close(abortive=True)
            (record,) = await provider.await_requests(1)
            assert await record.await_closed(timeout=5.0)
            assert record.connection_closed_early
            return closed

    assert not asyncio.run(scenario())
