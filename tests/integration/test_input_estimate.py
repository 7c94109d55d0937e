"""A cancelled stream's input is billed too: its usage never came (the provider sends it
last), so the record estimates the input from the prompt the app sent upstream, flagged
``estimated``. Through ``install()`` (idempotency, drain) on uvicorn, the quickstart's
relay against FakeProvider, the client hanging up mid-stream."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from asgi_disconnect import UsageRecord, estimate_tokens
from asgi_disconnect._metering import prompt_text
from asgi_disconnect.testing import FakeProvider, request, run_server
from tests.integration.silent_app import gateway

pytestmark = [pytest.mark.anyio, pytest.mark.server]

PROMPT = "Summarise the quarterly report in three bullet points, plainly. " * 20


async def test_a_cancelled_stream_estimates_its_input_from_the_prompt(tmp_path: Path) -> None:
    records: list[UsageRecord] = []
    body = {
        "model": "fake-model",
        "stream": True,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": PROMPT}]},
        ],
    }
    with FakeProvider(tokens=200, tokens_per_second=100) as provider:
        app = gateway(provider.url, records, tmp_path / "g.db")
        with run_server(app, server="uvicorn") as server:
            cut = await request(
                f"{server.url}/v1/chat/completions",
                method="POST",
                headers={"authorization": "Bearer alice", "content-type": "application/json"},
                body=json.dumps(body).encode(),
                disconnect_after_bytes=800,
            )
            assert cut.stopped_by == "disconnect_after_bytes"
            async with asyncio.timeout(10):
                while not records:
                    await asyncio.sleep(0.02)
    (record,) = records
    assert record.outcome == "cancelled"
    assert record.usage_source == "estimated"
    assert record.input_tokens == estimate_tokens("You are terse.\n" + PROMPT)
    assert record.output_tokens is not None


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "hi"),
        (b'{"system": "be brief", "messages": [{"content": [{"text": "a"}]}]}', "be brief\na"),
        (b'{"instructions": "x", "input": "y"}', "x\ny"),
        (b'{"contents": [{"parts": [{"text": "g"}]}]}', "g"),
        (b"not json", ""),
        (b'{"messages": 5}', ""),
        (b"[1, 2]", ""),
    ],
)
def test_the_prompt_of_each_api_is_read_and_anything_else_is_none(body: bytes, text: str) -> None:
    assert prompt_text(body) == text
