from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from asgi_disconnect.testing import h2_request, h2_stalled_request, run_server

if TYPE_CHECKING:
    from collections.abc import Iterator

    from starlette.types import ASGIApp, Receive, Scope, Send

    from asgi_disconnect.testing import RunningServer

pytestmark = [pytest.mark.anyio, pytest.mark.server]

CHUNK = b"x" * 1023 + b"\n"


@dataclass
class Probe:
    """What the app saw, signalled across the server's thread."""

    chunks_sent: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    disconnected: threading.Event = field(default_factory=threading.Event)


async def signalled(event: threading.Event, timeout: float) -> bool:
    return await asyncio.to_thread(event.wait, timeout)


def chunks_app(probe: Probe) -> ASGIApp:
    """``/{n}`` answers n chunks of 1 KiB (``/0``: until the client hangs up, slowly);
    a watcher records the client's ``http.disconnect``."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body", False):
            pass

        async def watch() -> None:
            if (await receive())["type"] == "http.disconnect":
                probe.disconnected.set()

        watcher = asyncio.ensure_future(watch())
        count = int(scope["path"].strip("/"))
        start = {"type": "http.response.start", "status": 200, "headers": [(b"x-n", b"%d" % count)]}
        await send(start)
        while not count or probe.chunks_sent < count:
            if probe.disconnected.is_set():
                break
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
            probe.chunks_sent += 1
            if not count:
                await asyncio.sleep(0.005)
        await send({"type": "http.response.body", "body": b""})
        probe.done.set()
        await watcher

    return app


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def srv(probe: Probe) -> Iterator[RunningServer]:
    with run_server(chunks_app(probe), server="hypercorn-h2", shutdown_timeout=1) as running:
        yield running


async def test_a_response_larger_than_the_windows_arrives_whole(srv: RunningServer) -> None:
    # 200 KiB: more than the initial stream and connection windows (64 KiB), so the client
    # must acknowledge what it read for the rest to come.
    result = await h2_request(srv.url + "/200", timeout=10)

    assert (result.status, result.complete, result.stopped_by) == (200, True, "complete")
    assert result.body == CHUNK * 200
    assert result.headers["x-n"] == "200"
    assert not any(name.startswith(":") for name, _ in result.headers_list)


async def test_post_with_a_body(srv: RunningServer) -> None:
    result = await h2_request(srv.url + "/1", method="POST", body=b"{}" * 100, timeout=10)

    assert (result.status, result.body) == (200, CHUNK)


@pytest.mark.parametrize("reset_stream", [False, True])
async def test_hanging_up_after_n_bytes_disconnects_the_app(
    srv: RunningServer, probe: Probe, reset_stream: bool
) -> None:
    result = await h2_request(
        srv.url + "/0", disconnect_after_bytes=3000, reset_stream=reset_stream, timeout=10
    )

    assert result.stopped_by == "disconnect_after_bytes"
    assert not result.complete
    assert len(result.body) >= 3000
    assert await signalled(probe.disconnected, 5)


async def test_a_stalled_client_holds_the_server_until_it_reopens_the_window(
    srv: RunningServer, probe: Probe
) -> None:
    client = await h2_stalled_request(srv.url + "/100", read_bytes=100, window=1024, timeout=10)
    async with client:
        assert client.status == 200
        assert 100 <= len(client.body) <= 1024
        # The server cannot finish the response while the window stays shut.
        assert not await signalled(probe.done, 0.3)

        result = await client.resume(timeout=10)

        assert (result.complete, result.body) == (True, CHUNK * 100)
        assert await signalled(probe.done, 5)


async def test_a_stalled_client_that_hangs_up_disconnects_the_app(
    srv: RunningServer, probe: Probe
) -> None:
    client = await h2_stalled_request(srv.url + "/100", window=1024, timeout=10)
    await client.close()

    assert await signalled(probe.disconnected, 5)
    assert not probe.done.is_set()


async def test_read_bytes_beyond_the_window_is_refused() -> None:
    with pytest.raises(ValueError, match="read_bytes"):
        await h2_stalled_request("http://127.0.0.1:9/", read_bytes=2048, window=1024)
