"""What the demo's page shows, in headless Chromium with and without JavaScript: its four
states (waiting for the first token, streaming, done, failed), its cost line ("metering…"
until the usage record is settled), the no-JavaScript Stop form, an unreachable upstream,
"delivered" across reloads, the live chart, and whose usage record a caller may read.
Screenshots are saved under each test's ``tmp_path``."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asgi_disconnect.demo import make_app
from asgi_disconnect.testing import run_server

from ..apps import eventually
from .conftest import demo_server

pytestmark = [pytest.mark.anyio, pytest.mark.server, pytest.mark.browser]

FULL = "".join(f"tok{i} " for i in range(60))
METERING = "Cost: metering…"
WAIT = 30_000  # ms: how long a state may take to show on a loaded machine


async def shot(page: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / f"page-{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 0


async def wait_for_state(page: Any, state: str) -> None:
    await page.wait_for_selector(f'#status[data-state="{state}"]', timeout=WAIT)


async def state_of(page: Any) -> str:
    return str(await page.get_attribute("#status", "data-state"))


async def text(page: Any, selector: str) -> str:
    return (await page.text_content(selector)) or ""


async def generation_of(page: Any) -> str:
    await page.wait_for_selector("#generation:has-text('gen_')", timeout=WAIT)
    return (await text(page, "#generation")).removeprefix("Generation ")


async def wait_for_cost(page: Any) -> str:
    await page.wait_for_selector("#cost:has-text('outcome')", timeout=WAIT)
    return await text(page, "#cost")


@pytest.mark.parametrize("scripted", [True, False], ids=["javascript", "no-javascript"])
async def test_each_state_shows_with_its_cost_line(
    tmp_path: Path, browser: Any, scripted: bool
) -> None:
    with demo_server(tmp_path, tokens=60, tokens_per_second=40, first_token_delay=3) as demo:
        context = await browser.new_context(java_script_enabled=scripted)
        page = await context.new_page()
        await page.goto(demo.url)
        await page.click("#send")

        await wait_for_state(page, "waiting")  # headers came, the first token has not
        assert await text(page, "#status") == "Waiting for the first token…"
        assert await text(page, "#answer") == ""
        generation_id = await generation_of(page)
        assert await text(page, "#cost") == METERING
        assert await page.is_visible("#stop")
        await shot(page, tmp_path, "waiting")

        await wait_for_state(page, "streaming")
        assert (await text(page, "#answer")).startswith("tok0 ")
        assert await text(page, "#cost") == METERING
        assert await page.is_visible("#stop")
        await shot(page, tmp_path, "streaming")

        await wait_for_state(page, "done")
        assert await text(page, "#answer") == FULL
        assert await text(page, "#generation") == f"Generation {generation_id}"
        assert not await page.is_visible("#stop")
        cost = await wait_for_cost(page)
        assert cost == (
            "Cost: 12 input + 60 output tokens (reported by the provider), "
            "60 delivered to this page; outcome complete."
        )
        await shot(page, tmp_path, "done")
        await context.close()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("truncate-after=5", "(truncated_stream)"),
        ("error-after=5", "The server had an error while processing your request."),
    ],
)
async def test_a_failed_answer_shows_why_without_javascript(
    tmp_path: Path, browser: Any, fault: str, message: str
) -> None:
    with demo_server(tmp_path, tokens=60, tokens_per_second=100, fault=fault) as demo:
        context = await browser.new_context(java_script_enabled=False)
        page = await context.new_page()
        await page.goto(demo.url)
        await page.click("#send")
        await wait_for_state(page, "failed")
        assert message in await text(page, "#status")
        assert await text(page, "#answer") == "".join(f"tok{i} " for i in range(5))
        assert "outcome" in await wait_for_cost(page)
        await shot(page, tmp_path, f"failed-{fault.split('=')[0]}")
        await context.close()


async def test_the_stop_form_stops_the_provider_without_javascript(
    tmp_path: Path, browser: Any
) -> None:
    with demo_server(tmp_path, tokens=400, tokens_per_second=20) as demo:
        context = await browser.new_context(java_script_enabled=False)
        page = await context.new_page()
        await page.goto(demo.url)
        await page.click("#send")
        await wait_for_state(page, "streaming")
        generation_id = await generation_of(page)
        (call,) = demo.provider.requests

        # Another page's Stop form for this id stops nothing, and shows it nothing.
        other = await browser.new_context(java_script_enabled=False)
        await (await other.new_page()).goto(demo.url)
        theirs = await other.request.post(f"{demo.url}/stop", form={"g": generation_id})
        assert theirs.status == 404
        assert "No such generation for this page." in await theirs.text()
        invalid = await other.request.post(f"{demo.url}/stop", form={"g": "../drainz"})
        assert invalid.status == 422
        assert invalid.headers["content-type"] == "application/problem+json"
        assert (await invalid.json())["type"] == "urn:asgi-disconnect:problem:invalid-request"
        await other.close()
        assert call.closed_at is None
        assert await state_of(page) == "streaming"

        await page.click("#stop")  # a plain form POST, then a redirect back to the page
        await wait_for_state(page, "failed")
        assert await text(page, "#status") == "Stopped."
        assert page.url.endswith(f"/?g={generation_id}")
        assert await call.await_closed(timeout=10)
        assert call.connection_closed_early
        assert call.tokens_generated < 400
        assert not await page.is_visible("#stop")
        assert "outcome cancelled" in await wait_for_cost(page)
        await shot(page, tmp_path, "stopped")
        await context.close()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def gateway_without_upstream(tmp_path: Path) -> Iterator[str]:
    app = make_app(
        upstream=f"http://127.0.0.1:{closed_port()}",
        backend_url=f"sqlite:///{tmp_path / 'demo.db'}",
    )
    with run_server(app) as server:
        yield server.url


@pytest.mark.parametrize("scripted", [True, False], ids=["javascript", "no-javascript"])
async def test_an_unreachable_upstream_is_a_page_with_the_error(
    tmp_path: Path, browser: Any, scripted: bool
) -> None:
    with gateway_without_upstream(tmp_path) as url:
        context = await browser.new_context(java_script_enabled=scripted)
        page = await context.new_page()
        await page.goto(url)
        async with page.expect_response(lambda r: r.request.method == "POST") as answered:
            await page.click("#send")
        response = await answered.value
        assert response.status == 502
        await wait_for_state(page, "failed")
        status = await text(page, "#status")
        assert status.startswith("The request failed (502): The upstream failed:"), status
        if not scripted:
            assert response.headers["content-type"].startswith("text/html")
            assert "Traceback" not in await response.text()
        await shot(page, tmp_path, "unreachable")
        await context.close()


async def usage(context: Any, base: str, generation_id: str) -> dict[str, Any]:
    """The page's usage record, read with the page's own cookie, once it is settled."""
    found: dict[str, Any] = {}

    async def settled() -> bool:
        response = await context.request.get(f"{base}/demo/usage/{generation_id}")
        if response.status == 200:
            found.update(await response.json())
        return bool(found)

    await eventually(settled, timeout=30, what="the usage record")
    return found


async def test_delivered_counts_a_reload_mid_answer(tmp_path: Path, browser: Any) -> None:
    with demo_server(tmp_path, tokens=60, tokens_per_second=30) as demo:
        context = await browser.new_context()
        page = await context.new_page()
        await page.goto(demo.url)
        await page.click("#send")
        await page.wait_for_function("document.getElementById('answer').textContent.length > 20")
        generation_id = await generation_of(page)
        await page.reload()  # the first request goes; the page reads on through others
        await wait_for_state(page, "done")
        assert await text(page, "#answer") == FULL
        assert "60 output tokens (reported by the provider), 60 delivered" in (
            await wait_for_cost(page)
        )
        record = await usage(context, demo.url, generation_id)
        assert record["delivered_output_tokens"] == record["output_tokens"] == 60
        # The request that started it delivered only what it read before the reload.
        assert record["first_request_delivered_output_tokens"] < 60
        await shot(page, tmp_path, "reloaded")
        await context.close()


async def test_delivered_counts_a_full_resume_and_no_more(tmp_path: Path, browser: Any) -> None:
    with demo_server(tmp_path, tokens=60, tokens_per_second=30) as demo:
        context = await browser.new_context()
        page = await context.new_page()
        await page.goto(demo.url)
        await page.click("#send")
        await page.wait_for_function("document.getElementById('answer').textContent.length > 20")
        generation_id = await generation_of(page)
        await page.goto("about:blank")  # the page leaves; under detach the answer goes on
        (call,) = demo.provider.requests
        assert await call.await_closed(timeout=30)
        assert call.finished
        record = await usage(context, demo.url, generation_id)
        # Only what reached the page before it left, not the whole answer.
        assert 0 < record["delivered_output_tokens"] < 60
        assert record["delivered_bytes"] < record["produced_bytes"]

        await page.goto(f"{demo.url}/?g={generation_id}")  # back: the whole answer, at once
        await wait_for_state(page, "done")
        assert await text(page, "#answer") == FULL
        assert "60 delivered to this page" in await wait_for_cost(page)
        record = await usage(context, demo.url, generation_id)
        assert record["delivered_output_tokens"] == 60
        await shot(page, tmp_path, "resumed")
        await context.close()


async def test_the_chart_is_rendered_by_the_server_and_kept_live(
    tmp_path: Path, browser: Any
) -> None:
    with demo_server(tmp_path, tokens=60, tokens_per_second=100) as demo:
        context = await browser.new_context()
        page = await context.new_page()
        origins: set[str] = set()
        page.on("request", lambda request: origins.add(request.url.split("/")[2]))
        await page.goto(demo.url)
        assert await page.text_content("#chart svg") == "No output tokens yet."
        await page.click("#send")
        await wait_for_state(page, "done")
        route = '#chart g[data-route="/v1/reports"]'
        await page.wait_for_selector(route, timeout=WAIT)  # the script redrew it, no reload
        assert await page.get_attribute(route, "data-billed") == "60"
        assert await page.get_attribute(route, "data-delivered") == "60"
        assert origins == {demo.url.split("/")[2]}  # no external assets
        await shot(page, tmp_path, "chart")

        # The server renders the same chart, for a page without JavaScript.
        plain = await browser.new_context(java_script_enabled=False)
        still = await plain.new_page()
        await still.goto(demo.url)
        assert await still.get_attribute(route, "data-billed") == "60"
        assert "billed/delivered 1.00" in await text(still, "#chart svg")
        await plain.close()
        await context.close()


async def test_a_usage_record_is_read_by_its_caller_only(tmp_path: Path, browser: Any) -> None:
    with demo_server(tmp_path, tokens=10, tokens_per_second=200) as demo:
        context = await browser.new_context()
        page = await context.new_page()
        await page.goto(demo.url)
        await page.click("#send")
        await wait_for_state(page, "done")
        generation_id = await generation_of(page)
        record = await usage(context, demo.url, generation_id)
        assert record["generation_id"] == generation_id

        other = await browser.new_context()  # another page: a session cookie of its own
        await (await other.new_page()).goto(demo.url)
        theirs = await other.request.get(f"{demo.url}/demo/usage/{generation_id}")
        async with httpx.AsyncClient(base_url=demo.url) as anonymous:
            nobody = await anonymous.get(f"/demo/usage/{generation_id}")
            unknown = await anonymous.get("/demo/usage/gen_nothing")
            api = await anonymous.get(
                f"/demo/usage/{generation_id}", headers={"authorization": "Bearer someone"}
            )
        expected = {
            "type": "urn:asgi-disconnect:problem:usage-not-settled",
            "title": "Not Found",
            "status": 404,
            "detail": "No usage record yet: metering…",
            "error": {
                "type": "usage_not_settled",
                "code": "usage-not-settled",
                "message": "No usage record yet: metering…",
            },
        }
        assert theirs.status == 404
        assert theirs.headers["content-type"] == "application/problem+json"
        assert await theirs.json() == expected
        for refused in (nobody, unknown, api):
            assert refused.status_code == 404
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.json() == expected  # the same answer as for no such id

        # Nor can another page show it.
        elsewhere = await other.new_page()
        shown = await elsewhere.goto(f"{demo.url}/?g={generation_id}")
        assert shown is not None
        assert shown.status == 404
        assert await text(elsewhere, "#status") == "No such generation for this page."
        assert await text(elsewhere, "#answer") == ""
        await other.close()
        await context.close()


async def test_a_reload_under_cancel_shows_the_answer_cancelled(
    tmp_path: Path, browser: Any
) -> None:
    with demo_server(tmp_path, tokens=400, tokens_per_second=30) as demo:
        context = await browser.new_context()
        page = await context.new_page()
        await page.goto(demo.url)
        await page.uncheck("#detach")  # policy cancel: leaving stops the provider
        await page.click("#send")
        await page.wait_for_function("document.getElementById('answer').textContent.length > 20")
        await page.reload()
        await wait_for_state(page, "failed")
        assert not await page.is_checked("#detach")  # the page says which policy it asked
        assert "cancelled" in (await text(page, "#status")).lower()
        assert (await text(page, "#answer")).startswith("tok0 tok1 ")
        (call,) = demo.provider.requests
        assert await call.await_closed(timeout=10)
        assert call.connection_closed_early
        assert "outcome cancelled" in await wait_for_cost(page)
        await shot(page, tmp_path, "cancelled")
        await context.close()


async def test_without_javascript_the_page_chooses_cancel_and_leaving_stops_the_provider(
    tmp_path: Path, browser: Any
) -> None:
    with demo_server(tmp_path, tokens=400, tokens_per_second=20) as demo:
        context = await browser.new_context(java_script_enabled=False)
        page = await context.new_page()
        await page.goto(demo.url)
        assert await page.is_enabled("#detach")
        await page.uncheck("#detach")  # a plain form field: the policy is the page's choice
        await page.click("#send")
        await wait_for_state(page, "streaming")
        generation_id = await generation_of(page)
        assert not await page.is_checked("#detach")  # the page shows the policy it asked
        (call,) = demo.provider.requests
        assert call.path == "/v1/chat/completions"
        # While the page keeps reloading itself, the answer goes on.
        first = len(await text(page, "#answer"))
        await page.wait_for_function(
            f"document.getElementById('answer').textContent.length > {first + 20}",
            timeout=WAIT,
        )
        assert call.closed_at is None

        await page.goto("about:blank")  # the reader leaves: under cancel, the provider stops
        assert await call.await_closed(timeout=20)
        assert call.connection_closed_early
        assert call.tokens_generated < 400

        async def cancelled() -> bool:
            status = await context.request.get(f"{demo.url}/generations/{generation_id}")
            return bool((await status.json())["status"] == "cancelled")

        await eventually(cancelled, timeout=10, what="the generation cancelled")
        await page.goto(f"{demo.url}/?g={generation_id}")
        await wait_for_state(page, "failed")
        assert "cancelled" in (await text(page, "#status")).lower()
        assert "outcome cancelled" in await wait_for_cost(page)
        await shot(page, tmp_path, "without-javascript-cancelled")
        await context.close()


async def test_without_javascript_a_cancel_answer_read_to_its_end_is_done(
    tmp_path: Path, browser: Any
) -> None:
    with demo_server(tmp_path, tokens=60, tokens_per_second=60) as demo:
        context = await browser.new_context(java_script_enabled=False)
        page = await context.new_page()
        await page.goto(demo.url)
        await page.uncheck("#detach")
        await page.click("#send")
        await wait_for_state(page, "done")
        assert await text(page, "#answer") == FULL
        (call,) = demo.provider.requests
        assert call.path == "/v1/chat/completions"
        assert call.finished
        cost = await wait_for_cost(page)
        assert "outcome complete" in cost
        await context.close()


@pytest.mark.parametrize("scripted", [True, False], ids=["javascript", "no-javascript"])
async def test_an_estimate_is_marked_on_the_cost_line_the_panel_and_the_chart(
    tmp_path: Path, browser: Any, scripted: bool
) -> None:
    with demo_server(tmp_path, tokens=400, tokens_per_second=20) as demo:
        context = await browser.new_context(java_script_enabled=scripted)
        page = await context.new_page()
        await page.goto(demo.url)
        await page.uncheck("#detach")
        await page.click("#send")
        await page.wait_for_function(
            "document.getElementById('answer').textContent.length > 20", timeout=WAIT
        )
        # Stopped before the provider's usage chunk: the counts are estimated from the text.
        await page.click("#stop")
        await wait_for_state(page, "failed")
        cost = await wait_for_cost(page)
        assert "(estimated from the text, not reported by the provider)" in cost
        assert " + ≈" in cost  # the output tokens
        assert "≈" in cost.split("), ", 1)[1]  # and what reached the page, a share of them
        billed = "#stat-billed_output_tokens"
        await page.wait_for_function(
            f"document.querySelector('{billed}').textContent.startsWith('≈')", timeout=WAIT
        )
        route = '#chart g[data-route="/v1/chat/completions"]'
        await page.wait_for_selector(route, timeout=WAIT)
        assert await page.get_attribute(route, "data-billed-estimated") == "true"
        assert "≈" in await text(page, route)
        assert "≈ estimated, not counted" in await text(page, "#chart svg")
        await shot(page, tmp_path, "estimated")
        await context.close()
