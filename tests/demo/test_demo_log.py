"""``asgi-disconnect demo`` shows one log line per LLM request, as uvicorn's own lines."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.demo.test_cli import CHAT, running_demo

pytestmark = pytest.mark.server


def test_the_demo_logs_one_line_per_llm_request(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    backend = f"sqlite:///{tmp_path / 'demo.db'}"
    with running_demo("--backend", backend, "--rate", "500", log=log) as url:
        chat = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert chat.text.endswith("data: [DONE]\n\n")
        assert httpx.get(f"{url}/readyz").status_code == 200  # no LLM request: no line
        generation_id = chat.headers["x-generation-id"]
        deadline = time.monotonic() + 10
        while generation_id not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
    lines = [line for line in log.read_text().splitlines() if "status=" in line]
    assert len(lines) == 1, log.read_text()
    (line,) = lines
    assert line.startswith("INFO:")
    assert f" {generation_id} POST /v1/chat/completions status=200 " in line
    assert " end=complete " in line
    # README's first request asks for no usage: the demo asks the provider for it, so its
    # counts are the provider's, not an estimate (200 output tokens, not 322).
    assert "stream_options" not in CHAT
    assert " usage=provider " in line
    assert " billed=200 delivered=200 " in line
    assert "Traceback" not in log.read_text()


def test_an_unreachable_upstream_is_a_problem_and_one_warning_line(tmp_path: Path) -> None:
    log = tmp_path / "demo.log"
    backend = f"sqlite:///{tmp_path / 'demo.db'}"
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        upstream = f"http://127.0.0.1:{closed.getsockname()[1]}"
    with running_demo("--backend", backend, "--upstream", upstream, log=log) as url:
        streamed = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        whole = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": False})
        generation_id = streamed.headers["x-generation-id"]
        deadline = time.monotonic() + 10
        while log.read_text().count("the upstream failed") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    for answer in (streamed, whole):
        assert answer.status_code == 502
        assert answer.headers["content-type"] == "application/problem+json"
        problem = answer.json()
        assert problem["type"] == "urn:asgi-disconnect:problem:upstream-unreachable"
        assert problem["title"] == "Bad Gateway"
        assert problem["detail"].startswith("The upstream failed: ")
    text = log.read_text()
    failures = [line for line in text.splitlines() if "the upstream failed" in line]
    assert len(failures) == 2, text
    assert failures[0].startswith("WARNING:")
    assert f"generation {generation_id} (POST /v1/chat/completions)" in failures[0]
    assert "Traceback" not in text
