"""The quickstart's gateway under uvicorn, as a user runs it: an upstream that refuses
connections and one that dies mid-stream each leave one line in the server's log, with the
generation id and the error type, and no traceback."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from asgi_disconnect.testing import FakeProvider, request
from tests.test_quickstart import BODY, quickstart

HEADERS = {"authorization": "Bearer sk-anything", "content-type": "application/json"}


def failure_lines(log: Path, count: int) -> list[str]:
    deadline = time.monotonic() + 10
    while log.read_text().count(" out (") < count and time.monotonic() < deadline:
        time.sleep(0.05)  # the usage records come after the failure lines
    return [line for line in log.read_text().splitlines() if "the upstream failed" in line]


@pytest.mark.server
def test_an_upstream_that_refuses_connections_is_one_line(tmp_path: Path) -> None:
    with FakeProvider() as running:
        gone = SimpleNamespace(url=running.url)  # stopped: its port refuses connections
    with quickstart(tmp_path, gone) as (url, log):  # type: ignore[arg-type]
        answer = asyncio.run(
            request(f"{url}/v1/chat/completions", method="POST", headers=HEADERS, body=BODY)
        )
        lines = failure_lines(log, 1)
    output = log.read_text()
    assert answer.status == 502
    problem = msgspec.json.decode(answer.body)
    assert problem["type"] == "urn:asgi-disconnect:problem:upstream-unreachable"
    assert "Traceback" not in output, output
    assert "Exception in ASGI application" not in output, output
    (line,) = lines
    assert ": upstream_unreachable: " in line
    assert " error: " in output  # the usage record says so


@pytest.mark.server
def test_an_upstream_that_dies_mid_stream_is_one_line(tmp_path: Path) -> None:
    provider = FakeProvider(tokens=30, tokens_per_second=300, fault="reset-after=5")
    with provider, quickstart(tmp_path, provider) as (url, log):
        answer = asyncio.run(
            request(f"{url}/v1/chat/completions", method="POST", headers=HEADERS, body=BODY)
        )
        lines = failure_lines(log, 1)
    output = log.read_text()
    assert answer.status == 200
    assert b"event: error" in answer.body
    assert "Traceback" not in output, output
    assert "Exception in ASGI application" not in output, output
    (line,) = lines
    assert answer.headers["x-generation-id"] in line
    assert ": truncated_stream: " in line
