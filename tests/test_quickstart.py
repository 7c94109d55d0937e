"""The quickstart works as written: the ``# gateway.py`` block of docs/quickstart.md and of
README.md, saved as a file and served by uvicorn against FakeProvider, relays a stream,
forwards the caller's credentials, and prints one usage record per request, a cut one as
``cancelled``. The docs site builds without a warning."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from asgi_disconnect.testing import FakeProvider, request

ROOT = Path(__file__).resolve().parents[1]
BODY = (
    b'{"model": "fake-model", "stream": true, "stream_options": {"include_usage": true},'
    b' "messages": [{"role": "user", "content": "hi"}]}'
)


def gateway_block(document: Path) -> str:
    if document.suffix == ".py":
        return document.read_text()
    blocks = re.findall(r"```python\n(# gateway\.py\n.*?)```", document.read_text(), re.S)
    assert len(blocks) == 1, f"{document.name} has no single '# gateway.py' block"
    return blocks[0]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.server
@pytest.mark.parametrize("document", ["docs/quickstart.md", "README.md", "examples/gateway.py"])
def test_the_quickstart_gateway_relays_and_meters(document: str, tmp_path: Path) -> None:
    (tmp_path / "gateway.py").write_text(gateway_block(ROOT / document))
    port = free_port()
    with FakeProvider(tokens=50, tokens_per_second=200) as provider:
        env = {**os.environ, "UPSTREAM_URL": provider.url, "PYTHONUNBUFFERED": "1"}
        log = tmp_path / "out.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "gateway:app", "--port", str(port)],
                cwd=tmp_path,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 20
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        httpx.get(url, timeout=0.5)
                        break
                    assert proc.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, log.read_text()
                    time.sleep(0.1)
                headers = {
                    "authorization": "Bearer sk-anything",
                    "content-type": "application/json",
                }
                whole = asyncio.run(
                    request(f"{url}/v1/chat/completions", method="POST", headers=headers, body=BODY)
                )
                assert whole.status == 200
                assert whole.body.endswith(b"data: [DONE]\n\n")
                cut = asyncio.run(
                    request(
                        f"{url}/v1/chat/completions",
                        method="POST",
                        headers=headers,
                        body=BODY,
                        disconnect_after_bytes=600,
                    )
                )
                assert not cut.body.endswith(b"data: [DONE]\n\n")
                deadline = time.monotonic() + 10
                while log.read_text().count(" out (") < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                proc.terminate()
                proc.wait(20)
        output = log.read_text()
    whole_id = whole.headers["x-generation-id"]
    assert f"{whole_id} complete: 12 in, 50 out (provider), 50 delivered" in output, output
    assert f"{cut.headers['x-generation-id']} cancelled:" in output, output
    first, _ = provider.requests
    assert first.body["stream"] is True


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs extra")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "index.html").exists()
