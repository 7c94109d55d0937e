"""Real servers, real sockets closed mid-stream, a real upstream over TCP."""

from __future__ import annotations

import asyncio
import re

import httpx
import msgspec
import pytest

from asgi_disconnect.testing import FakeProvider, request, run_server, stalled_request
from tests.integration.gateway import make_gateway

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.server,
    pytest.mark.provider(tokens=400, tokens_per_second=200),
]

SERVERS = ["uvicorn", "hypercorn"]


@pytest.fixture(params=SERVERS)
def server(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def tokens_in(body: bytes) -> int:
    """FakeProvider's tokens are "tok0 ", "tok1 ", ..."""
    return len(re.findall(rb"tok\d+ ", body))


async def wait_for_status(url: str, status: str, timeout: float = 10) -> dict[str, object]:
    async with httpx.AsyncClient() as client, asyncio.timeout(timeout):
        while True:
            info = msgspec.json.decode((await client.get(url)).content)
            if info["status"] == status:
                return info  # type: ignore[no-any-return]
            await asyncio.sleep(0.02)


@pytest.mark.parametrize(
    "path",
    ["/in-generator", "/in-endpoint", "/fastapi-sse", "/sse-starlette", "/starlette/in-generator"],
)
async def test_cancel_closes_the_upstream_mid_stream(
    server: str, provider: FakeProvider, path: str
) -> None:
    app, _ = make_gateway(provider.url)
    with run_server(app, server=server) as srv:
        result = await request(srv.url + path, method="POST", disconnect_after_bytes=3000)
        assert result.status == 200
        (upstream,) = await provider.await_requests(1)
        assert await upstream.await_closed(timeout=5)
    assert upstream.connection_closed_early
    assert not upstream.finished
    received = tokens_in(result.body)
    assert 0 < received <= upstream.tokens_sent < upstream.tokens_planned
    ratio = upstream.tokens_sent / received
    print(
        f"{server} {path}: upstream generated {upstream.tokens_sent} tokens, "
        f"client received {received}; ratio {ratio:.2f}"
    )
    # Only what was in flight when the socket closed is billed on top.
    assert upstream.tokens_sent - received < 60


@pytest.mark.parametrize(
    "path", ["/in-generator", "/in-endpoint", "/fastapi-sse", "/non-streaming"]
)
async def test_cancel_before_the_first_token_closes_the_upstream(server: str, path: str) -> None:
    with FakeProvider(tokens=50, first_token_delay=5) as provider:
        app, _ = make_gateway(provider.url)
        with run_server(app, server=server) as srv:
            result = await request(srv.url + path, method="POST", disconnect_after_seconds=0.3)
            (upstream,) = await provider.await_requests(1)
            assert await upstream.await_closed(timeout=3)
    assert tokens_in(result.body) == 0
    assert upstream.connection_closed_early
    assert upstream.tokens_sent == 0


async def test_control_without_the_middleware_a_non_streaming_call_bills_in_full(
    server: str,
) -> None:
    with FakeProvider(tokens=60, tokens_per_second=200) as provider:
        app, _ = make_gateway(provider.url, bare=True)
        with run_server(app, server=server) as srv:
            await request(srv.url + "/non-streaming", method="POST", disconnect_after_seconds=0.1)
            (upstream,) = await provider.await_requests(1)
            assert await upstream.await_closed(timeout=5)
    # Plain Starlette/FastAPI never notices: the provider generated and billed everything.
    assert upstream.finished
    assert not upstream.connection_closed_early


async def test_cancel_non_streaming_call_stops_billing(server: str, provider: FakeProvider) -> None:
    app, _ = make_gateway(provider.url)
    with run_server(app, server=server) as srv:
        await request(srv.url + "/non-streaming", method="POST", disconnect_after_seconds=0.3)
        (upstream,) = await provider.await_requests(1)
        assert await upstream.await_closed(timeout=3)
    assert upstream.connection_closed_early
    assert upstream.tokens_generated < upstream.tokens_planned


@pytest.mark.parametrize("path", ["/detach", "/router/detach", "/starlette/detach"])
async def test_detach_runs_the_upstream_to_the_end(
    server: str, provider: FakeProvider, path: str
) -> None:
    app, produced = make_gateway(provider.url)
    with run_server(app, server=server) as srv:
        result = await request(srv.url + path, method="POST", disconnect_after_bytes=2000)
        generation_id = result.headers["x-generation-id"]
        info = await wait_for_status(f"{srv.url}/generations/{generation_id}", "complete")
        (upstream,) = provider.requests
        assert upstream.finished
        assert not upstream.connection_closed_early
        async with httpx.AsyncClient() as client:
            replay = await client.get(f"{srv.url}/generations/{generation_id}/stream")
    assert info["detached"] is True
    assert replay.content == bytes(produced[generation_id])
    assert replay.content.startswith(result.body)
    assert replay.content.endswith(b"data: [DONE]\n\n")
    assert tokens_in(replay.content) == upstream.tokens_planned


async def test_detach_resume_mid_offset_streams_the_rest_live(server: str) -> None:
    with FakeProvider(tokens=300, tokens_per_second=150) as provider:
        app, produced = make_gateway(provider.url)
        with run_server(app, server=server) as srv:
            first = await request(srv.url + "/detach", method="POST", disconnect_after_bytes=1500)
            generation_id = first.headers["x-generation-id"]
            offset = len(first.body)
            (upstream,) = provider.requests
            async with (
                httpx.AsyncClient(timeout=20) as client,
                client.stream(
                    "GET",
                    f"{srv.url}/generations/{generation_id}/stream",
                    params={"offset": offset},
                ) as live,
            ):
                assert not upstream.finished, "the resume must start while it still runs"
                rest = b"".join([chunk async for chunk in live.aiter_raw()])
            assert upstream.finished
    assert first.body + rest == bytes(produced[generation_id])
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_stalled_client_does_not_stall_a_detached_upstream(server: str) -> None:
    with FakeProvider(tokens=4000, tokens_per_second=0) as provider:
        app, produced = make_gateway(provider.url)
        with run_server(app, server=server) as srv:
            client = await stalled_request(srv.url + "/detach", method="POST", read_bytes=100)
            try:
                (upstream,) = await provider.await_requests(1)
                assert await upstream.await_closed(timeout=10)
                assert upstream.finished
                generation_id = client.headers["x-generation-id"]
                size = len(produced[generation_id])
                # The upstream finished although the client read only a small part.
                assert len(client.body) < size
            finally:
                await client.close()
            await wait_for_status(f"{srv.url}/generations/{generation_id}", "complete")


async def test_stalled_client_past_the_lag_limit_is_cancelled(server: str) -> None:
    with FakeProvider(tokens=100_000, tokens_per_second=0) as provider:
        app, _ = make_gateway(provider.url, max_lag_bytes=256 * 1024, max_lag_seconds=1.0)
        with run_server(app, server=server) as srv:
            client = await stalled_request(srv.url + "/in-generator", method="POST", read_bytes=100)
            try:
                (upstream,) = await provider.await_requests(1)
                assert await upstream.await_closed(timeout=10)
                assert await client.wait_server_closed(timeout=10)
            finally:
                await client.close()
    assert upstream.connection_closed_early
    assert upstream.tokens_sent < upstream.tokens_planned
