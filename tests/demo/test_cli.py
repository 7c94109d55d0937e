"""``asgi-disconnect``: the demo starts with one command and serves its routes; operators
list, show and tail the generations it stored; bad input gets a clear message and exit 2."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.server

CLI = [sys.executable, "-m", "asgi_disconnect._cli"]
CHAT = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_demo(*args: str, log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """``asgi-disconnect demo`` with ``args`` on a free port, until the block exits."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*CLI, "demo", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            env=env,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(url + "/readyz", timeout=1)
                    break
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            proc.wait(20)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, check=False)


def test_the_demo_serves_its_routes_and_operators_read_them_back(tmp_path: Path) -> None:
    backend = f"sqlite:///{tmp_path / 'demo.db'}"
    log = tmp_path / "demo.log"
    with running_demo("--backend", backend, "--rate", "500", log=log) as url:
        page = httpx.get(url + "/")
        assert page.status_code == 200
        assert '<form id="ask" method="post" action="/ask"' in page.text
        chat = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert chat.text.endswith("data: [DONE]\n\n")
        messages = httpx.post(
            f"{url}/v1/messages",
            json={**CHAT, "max_tokens": 50},
            headers={"anthropic-version": "2023-06-01"},
            timeout=30,
        )
        assert "event: message_stop" in messages.text
        bad = httpx.post(f"{url}/v1/reports", content=b"{not json", timeout=30)
        assert bad.status_code == 400
        assert bad.headers["content-type"] == "application/problem+json"
        no_prompt = httpx.post(f"{url}/ask", data={}, timeout=30)
        assert no_prompt.status_code == 422
        assert no_prompt.headers["content-type"] == "application/problem+json"
        assert no_prompt.json()["type"] == "urn:asgi-disconnect:problem:invalid-request"
        unknown = httpx.get(f"{url}/demo/usage/gen_nothing")
        assert unknown.status_code == 404
        assert unknown.json()["type"] == "urn:asgi-disconnect:problem:usage-not-settled"
        stats = httpx.get(f"{url}/demo/stats").json()
        assert stats["in_flight"] == 0
        generation_id = chat.headers["x-generation-id"]
    port = url.rsplit(":", 1)[1]
    banner = log.read_text()
    assert f"open        http://127.0.0.1:{port}/" in banner
    assert "FakeProvider on http://127.0.0.1:" in banner

    listed = cli("generations", "list", "--backend", backend)
    assert listed.returncode == 0, listed.stderr
    assert generation_id in listed.stdout
    assert "complete" in listed.stdout
    shown = cli("generations", "show", generation_id, "--backend", backend)
    assert shown.returncode == 0, shown.stderr
    assert '"status": "complete"' in shown.stdout
    assert '"outcome": "complete"' in shown.stdout  # its usage record
    tail = cli("generations", "tail", generation_id, "--backend", backend)
    assert tail.returncode == 0
    assert tail.stdout == chat.text
    missing = cli("generations", "show", "gen_" + "x" * 24, "--backend", backend)
    assert missing.returncode == 1
    assert "no generation" in missing.stderr


def test_bad_input_gets_a_clear_message() -> None:
    wrong = cli("generations", "list", "--backend", "mysql://nowhere")
    assert wrong.returncode == 2
    assert wrong.stderr.startswith("asgi-disconnect: ")
    assert "Traceback" not in wrong.stderr
    usage = cli("generations", "frobnicate")
    assert usage.returncode == 2
    assert "invalid choice" in usage.stderr


def test_the_demo_proxies_another_upstream_with_the_key_from_the_environment(
    tmp_path: Path,
) -> None:
    import os

    from asgi_disconnect.testing import FakeProvider

    with FakeProvider(tokens=5, tokens_per_second=1000) as provider:
        upstream = provider.url
        env = {**os.environ, "OPENAI_API_KEY": "sk-from-the-environment"}
        log = tmp_path / "demo.log"
        backend = f"sqlite:///{tmp_path / 'demo.db'}"
        with running_demo("--upstream", upstream, "--backend", backend, log=log, env=env) as url:
            answer = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert answer.text.endswith("data: [DONE]\n\n")
        assert len(provider.requests) == 1  # this upstream, not a FakeProvider of its own
    banner = log.read_text()
    assert f"upstream    {upstream}" in banner
    assert "no key" not in banner
