"""The quickstart works as written: the ``# gateway.py`` block of docs/quickstart.md (the very
file examples/gateway.py), saved as a file and served by uvicorn against FakeProvider, relays a
stream, forwards the caller's credentials, asks the provider for usage, and prints one usage
record per request, a cut one as ``cancelled``. README's short example, as written, relays a
stream and stops the provider when its client hangs up. (The docs site is built in
test_docs.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from asgi_disconnect.testing import FakeProvider, request

ROOT = Path(__file__).resolve().parents[1]
BODY = (
    b'{"model": "fake-model", "stream": true, "stream_options": {"include_usage": true},'
    b' "messages": [{"role": "user", "content": "hi"}]}'
)
# As docs/quickstart.md's curl sends it: no usage asked for.
PLAIN_BODY = (
    b'{"model": "fake-model", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
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
@pytest.mark.parametrize("document", ["docs/quickstart.md", "examples/gateway.py"])
def test_the_quickstart_gateway_relays_and_meters(document: str, tmp_path: Path) -> None:
    provider = FakeProvider(tokens=50, tokens_per_second=200)
    with provider, quickstart(tmp_path, provider, document) as (url, log):
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
        output = log.read_text()
    whole_id = whole.headers["x-generation-id"]
    assert f"{whole_id} complete: 12 in, 50 out (provider), 50 delivered" in output, output
    assert f"{cut.headers['x-generation-id']} cancelled:" in output, output
    first, _ = provider.requests
    assert first.body["stream"] is True


@pytest.mark.server
def test_the_quickstart_asks_the_provider_for_usage_the_caller_did_not(tmp_path: Path) -> None:
    """A request that asks for no usage is billed on the provider's own counts, not an
    estimate, and its caller gets no usage chunk it did not ask for."""
    provider = FakeProvider(tokens=50, tokens_per_second=200)
    headers = {"authorization": "Bearer sk-anything", "content-type": "application/json"}
    with provider, quickstart(tmp_path, provider) as (url, log):
        answer = asyncio.run(
            request(f"{url}/v1/chat/completions", method="POST", headers=headers, body=PLAIN_BODY)
        )
        deadline = time.monotonic() + 10
        while " out (" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        output = log.read_text()
    assert answer.body.endswith(b"data: [DONE]\n\n")
    assert b'"usage"' not in answer.body
    generation_id = answer.headers["x-generation-id"]
    assert f"{generation_id} complete: 12 in, 50 out (provider), 50 delivered" in output, output
    (sent,) = provider.requests
    assert sent.body["stream_options"] == {"include_usage": True}


@contextlib.contextmanager
def quickstart(
    tmp_path: Path, provider: FakeProvider | str, document: str = "examples/gateway.py"
) -> Iterator[tuple[str, Path]]:
    """The quickstart's gateway from ``document`` under uvicorn against ``provider`` (or the
    URL of one): its URL and its log (read it once the block has exited: uvicorn has stopped
    by then)."""
    upstream = provider if isinstance(provider, str) else provider.url
    with served(tmp_path, "gateway", gateway_block(ROOT / document), upstream) as running:
        yield running


@contextlib.contextmanager
def served(tmp_path: Path, module: str, source: str, upstream: str) -> Iterator[tuple[str, Path]]:
    """``source`` saved as ``module``.py and served by ``uvicorn module:app`` with
    ``UPSTREAM_URL`` set: its URL and its log."""
    (tmp_path / f"{module}.py").write_text(source)
    port = free_port()
    env = {**os.environ, "UPSTREAM_URL": upstream, "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "out.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", f"{module}:app", "--port", str(port)],
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
            yield url, log
        finally:
            proc.terminate()
            proc.wait(20)


def readme_example() -> tuple[str, str, str]:
    """README's short example: its source, and the module and app its first line serves."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(# (\w+)\.py: .*?)```", text, re.S)
    assert len(blocks) == 1, "README.md has no single '# name.py: ...' example"
    ((source, module),) = blocks
    run = source.splitlines()[0]
    assert run.endswith(f"uvicorn {module}:app"), run
    assert "UPSTREAM_URL=" in run, run
    return source, module, run


@pytest.mark.server
def test_readmes_example_relays_the_stream_and_a_hang_up_stops_the_provider(
    tmp_path: Path,
) -> None:
    """README's example, served as its first line says (``UPSTREAM_URL`` pointed at
    FakeProvider): a caller gets the whole stream with its generation id; a caller that hangs
    up after the first token closes the upstream, and the provider stops generating."""
    source, module, _ = readme_example()
    tokens = 200
    provider = FakeProvider(tokens=tokens, tokens_per_second=100)
    headers = {"authorization": "Bearer sk-anything", "content-type": "application/json"}
    with provider, served(tmp_path, module, source, provider.url) as (url, _):
        whole = asyncio.run(
            request(f"{url}/v1/chat/completions", method="POST", headers=headers, body=PLAIN_BODY)
        )
        cut = asyncio.run(
            request(
                f"{url}/v1/chat/completions",
                method="POST",
                headers=headers,
                body=PLAIN_BODY,
                disconnect_when=lambda body: b"data: " in body,
            )
        )
        first, second = provider.wait_for_requests(2)
        assert second.wait_closed(10)
    assert whole.status == 200
    assert whole.headers["x-generation-id"].startswith("gen_")
    assert whole.body.endswith(b"data: [DONE]\n\n")
    assert first.finished
    assert first.body["messages"] == [{"role": "user", "content": "hi"}]
    assert cut.status == 200
    assert not cut.body.endswith(b"data: [DONE]\n\n")
    assert second.connection_closed_early
    assert second.tokens_generated < tokens / 2, second.tokens_generated


@pytest.mark.server
def test_a_rate_limited_answer_releases_the_idempotency_key(tmp_path: Path) -> None:
    """The provider's 429 with Retry-After, relayed as the quickstart does, is no result to
    replay: the client that waits and retries with the same key reaches the provider."""
    provider = FakeProvider(tokens=20, tokens_per_second=500, fault="status=429")
    with provider, quickstart(tmp_path, provider) as (url, _):
        headers = {
            "authorization": "Bearer sk-anything",
            "content-type": "application/json",
            "idempotency-key": "order-7",
        }
        limited = httpx.post(f"{url}/v1/chat/completions", content=BODY, headers=headers)
        assert limited.status_code == 429
        assert limited.headers["retry-after"]
        provider.fault = None  # the rate limit is over
        retried = httpx.post(f"{url}/v1/chat/completions", content=BODY, headers=headers)
        assert retried.status_code == 200
        assert "idempotent-replayed" not in retried.headers
        assert retried.text.endswith("data: [DONE]\n\n")
        replayed = httpx.post(f"{url}/v1/chat/completions", content=BODY, headers=headers)
        assert replayed.headers.get("idempotent-replayed") == "true"
    assert len(provider.requests) == 2


def documented_provider_command() -> list[str]:
    """The FakeProvider command docs/quickstart.md tells the reader to run, as arguments."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    (line,) = re.findall(r"^python -m asgi_disconnect\.testing\.fake_provider .*$", text, re.M)
    return shlex.split(line.split("&")[0])


@contextlib.contextmanager
def documented_provider(tmp_path: Path) -> Iterator[str]:
    """FakeProvider run as docs/quickstart.md says (on a free port): its URL."""
    command = documented_provider_command()
    assert command[:3] == ["python", "-m", "asgi_disconnect.testing.fake_provider"], command
    options = command[3:]
    port = free_port()
    options[options.index("--port") + 1] = str(port)
    log = tmp_path / "provider.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asgi_disconnect.testing.fake_provider", *options],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 20
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    httpx.get(f"{url}/health", timeout=0.5).raise_for_status()
                    break
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            proc.wait(20)


@pytest.mark.server
def test_the_documented_run_leaves_time_to_press_ctrl_c(tmp_path: Path) -> None:
    """docs/quickstart.md's FakeProvider command streams slowly enough for a person to press
    Ctrl-C mid-stream; a client that leaves after the first tokens is printed ``cancelled``
    with fewer tokens than a whole answer, and a whole answer prints what the page says."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    (printed,) = re.findall(r"The gateway prints `gen_\.\.\. ([^`]+)`", text)
    options = documented_provider_command()
    # Without --rate, the command streams at FakeProvider's default pace.
    rate = (
        float(options[options.index("--rate") + 1])
        if "--rate" in options
        else FakeProvider().tokens_per_second
    )
    headers = {"authorization": "Bearer sk-anything", "content-type": "application/json"}
    with (
        documented_provider(tmp_path) as upstream,
        quickstart(tmp_path, upstream, "docs/quickstart.md") as (url, log),
    ):
        whole = asyncio.run(
            request(f"{url}/v1/chat/completions", method="POST", headers=headers, body=PLAIN_BODY)
        )
        cut = asyncio.run(
            request(
                f"{url}/v1/chat/completions",
                method="POST",
                headers=headers,
                body=PLAIN_BODY,
                disconnect_when=lambda body: b"data: " in body,  # Ctrl-C at the first token
            )
        )
        deadline = time.monotonic() + 10
        while log.read_text().count(" out (") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        output = log.read_text()
    assert f"{whole.headers['x-generation-id']} {printed}" in output, output
    complete = re.search(r"complete: \d+ in, (\d+) out", output)
    assert complete, output
    tokens = int(complete[1])
    assert tokens / rate >= 3, f"a whole stream lasts {tokens / rate:g} s: too quick to try"
    cancelled = re.search(rf"{cut.headers['x-generation-id']} cancelled: \d+ in, (\d+) out", output)
    assert cancelled, output
    assert int(cancelled[1]) < tokens


def test_the_quickstart_shows_the_example_file() -> None:
    document = ROOT / "docs" / "quickstart.md"
    assert gateway_block(document) == gateway_block(ROOT / "examples" / "gateway.py")


@pytest.mark.server
def test_the_quickstart_relays_more_streams_at_once_than_httpxs_default_pool(
    tmp_path: Path,
) -> None:
    """Each relayed stream holds an upstream connection until it ends: with httpx's default
    pool (100 connections) the 101st would wait for one; the quickstart's has room."""
    streams = 120
    # Every stream sends a token, then holds its connection open until the client leaves.
    provider = FakeProvider(tokens=50, tokens_per_second=0, fault="stall-after=1")
    headers = {"authorization": "Bearer sk-anything", "content-type": "application/json"}

    async def hold_streams(url: str) -> tuple[int, int]:
        """How many streams reached the provider at once, and how many of those were open."""
        clients = [
            asyncio.create_task(
                request(
                    f"{url}/v1/chat/completions",
                    method="POST",
                    headers=headers,
                    body=BODY,
                    timeout=60,
                )
            )
            for _ in range(streams)
        ]
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(30):
                    while len(provider.requests) < streams:
                        await asyncio.sleep(0.05)
            reached = provider.requests
            return len(reached), sum(request.closed_at is None for request in reached)
        finally:
            for client in clients:
                client.cancel()
            await asyncio.gather(*clients, return_exceptions=True)

    with provider, quickstart(tmp_path, provider) as (url, _):
        reached, open_at_once = asyncio.run(hold_streams(url))
    assert reached == streams
    assert open_at_once == streams
