"""The demo's web page in headless Chromium, against the demo gateway and FakeProvider:
tokens render as they arrive, the page works without JavaScript, a reload mid-stream under
detach ends with the whole answer, Stop stops the upstream, an upstream failure shows the
failed state with its error. Screenshots land in ``test-artifacts/browser/``."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from .conftest import Demo, demo_server, screenshot

pytestmark = [pytest.mark.anyio, pytest.mark.server, pytest.mark.browser]

FULL = "".join(f"tok{i} " for i in range(60))


async def state_of(page: Any) -> str:
    return str(await page.get_attribute("#status", "data-state"))


async def wait_for_state(page: Any, state: str, timeout: float = 20_000) -> None:
    await page.wait_for_selector(f'#status[data-state="{state}"]', timeout=timeout)


async def test_a_stream_renders_token_by_token_then_its_cost(demo: Demo, browser: Any) -> None:
    page = await browser.new_page()
    await page.goto(demo.url)
    assert await state_of(page) == "idle"  # rendered by the server
    await page.click("#send")
    seen: list[int] = []
    while await state_of(page) in ("waiting", "streaming"):
        seen.append(len(await page.text_content("#answer") or ""))
        await asyncio.sleep(0.1)
    assert await state_of(page) == "done"
    assert await page.text_content("#answer") == FULL
    assert len(set(seen)) >= 5, seen  # it grew while it streamed, not all at once
    assert seen == sorted(seen)
    await page.wait_for_selector("#cost:has-text('output tokens')", timeout=10_000)
    cost = await page.text_content("#cost")
    assert "12 input + 60 output tokens (reported by the provider)" in (cost or "")
    assert (await page.text_content("#generation") or "").startswith("Generation gen_")
    assert "g=gen_" in page.url  # a reload resumes this generation
    await screenshot(page, "streamed")


async def test_the_page_works_without_javascript(demo: Demo, browser: Any) -> None:
    context = await browser.new_context(java_script_enabled=False)
    page = await context.new_page()
    await page.goto(demo.url)
    await page.fill("#prompt", "A question asked without JavaScript.")
    await page.click("#send")  # the form posts to /ask; the answer is rendered by the server
    await wait_for_state(page, "done")
    assert await page.text_content("#answer") == FULL
    assert await page.input_value("#prompt") == "A question asked without JavaScript."
    await screenshot(page, "without-javascript")
    await context.close()


async def test_a_reload_mid_stream_under_detach_ends_with_the_whole_answer(
    demo: Demo, browser: Any
) -> None:
    page = await browser.new_page()
    await page.goto(demo.url)
    await page.click("#send")
    await page.wait_for_function("document.getElementById('answer').textContent.length > 20")
    assert await state_of(page) == "streaming"
    await page.reload()  # the connection goes; the generation goes on (detach)
    await page.wait_for_selector('#status[data-state="streaming"]')
    await wait_for_state(page, "done")
    assert await page.text_content("#answer") == FULL
    (call,) = demo.provider.requests
    assert call.finished
    assert not call.connection_closed_early
    await screenshot(page, "reloaded")


async def test_stop_stops_the_upstream(demo: Demo, browser: Any) -> None:
    page = await browser.new_page()
    await page.goto(demo.url)
    await page.click("#send")
    await page.wait_for_function("document.getElementById('answer').textContent.length > 20")
    await page.click("#stop")
    await wait_for_state(page, "failed")
    assert await page.text_content("#status") == "Stopped."
    (call,) = demo.provider.requests
    assert await call.await_closed(timeout=5)
    assert call.connection_closed_early
    assert call.tokens_generated < 60
    await page.wait_for_selector("#cost:has-text('outcome cancelled')", timeout=10_000)
    await screenshot(page, "stopped")


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("truncate-after=5", "(truncated_stream)"),
        ("status=429", "The request failed (429)"),
    ],
)
async def test_an_upstream_failure_shows_the_failed_state(
    tmp_path: Path, browser: Any, fault: str, message: str
) -> None:
    with demo_server(tmp_path, tokens=60, tokens_per_second=100, fault=fault) as demo:
        page = await browser.new_page()
        await page.goto(demo.url)
        await page.click("#send")
        await wait_for_state(page, "failed")
        status = await page.text_content("#status") or ""
        assert message in status, status
        await screenshot(page, f"failed-{fault.split('=')[0]}")


class CuttableProxy:
    """A TCP proxy on loopback whose open connections can all be cut at once, as a network
    that drops would: both sides see their socket close mid-stream."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.open: set[asyncio.StreamWriter] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.open |= {client_w, server_w}

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))
        self.open -= {client_w, server_w}

    def cut(self) -> int:
        cut = len(self.open)
        for writer in self.open:
            writer.transport.abort()
        return cut

    async def close(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


async def test_a_lost_connection_mid_stream_resumes_to_the_whole_answer(
    demo: Demo, browser: Any
) -> None:
    proxy = CuttableProxy(int(demo.url.rsplit(":", 1)[1]))
    url = await proxy.start()
    page = await browser.new_page()
    resumes: list[str] = []
    page.on("request", lambda r: resumes.append(r.url) if "/stream" in r.url else None)
    await page.goto(url)
    await page.click("#send")
    await page.wait_for_function("document.getElementById('answer').textContent.length > 20")
    assert proxy.cut() > 0  # the network drops every connection, the stream's included
    await wait_for_state(page, "done")
    assert await page.text_content("#answer") == FULL  # every token once, none missing
    assert resumes, "the page read on through /generations/{id}/stream"
    (call,) = demo.provider.requests
    assert not call.connection_closed_early  # detached: the upstream never noticed
    await screenshot(page, "reconnected")
    await proxy.close()
