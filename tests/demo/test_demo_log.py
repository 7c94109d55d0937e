"""``asgi-disconnect demo`` shows one log line per LLM request, as uvicorn's own lines."""

from __future__ import annotations

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
    assert " usage=provider " in line or " usage=estimated " in line
    assert "Traceback" not in log.read_text()
