"""Estimates that a ledger can use: a model's characters per token are calibrated from the
provider-reported usage of its earlier complete answers, and the record says how it counted.
Through ``install()`` (idempotency, drain) on uvicorn, the quickstart's relay against
FakeProvider, the client hanging up mid-stream. And the exact offline OpenAI tokenizer."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx
import pytest

from asgi_disconnect import UsageRecord, connect
from asgi_disconnect.metering import analyze, openai_tokenizer
from asgi_disconnect.testing import FakeProvider, request, run_server
from tests.integration.silent_app import gateway

pytestmark = [pytest.mark.anyio, pytest.mark.server]

HEADERS = {"authorization": "Bearer alice", "content-type": "application/json"}


def body(include_usage: bool) -> bytes:
    chat: dict[str, object] = {
        "model": "fake-model",
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if include_usage:
        chat["stream_options"] = {"include_usage": True}
    return json.dumps(chat).encode()


async def cancelled_record(url: str, records: list[UsageRecord]) -> UsageRecord:
    before = len(records)
    cut = await request(
        f"{url}/v1/chat/completions",
        method="POST",
        headers=HEADERS,
        body=body(include_usage=False),
        disconnect_after_bytes=6000,
    )
    assert cut.stopped_by == "disconnect_after_bytes"
    async with asyncio.timeout(10):
        while len(records) == before:
            await asyncio.sleep(0.02)
    record = records[-1]
    assert record.outcome == "cancelled"
    return record


async def test_a_cancel_is_estimated_at_the_models_calibrated_ratio(tmp_path: Path) -> None:
    records: list[UsageRecord] = []
    with FakeProvider(tokens=100, tokens_per_second=400) as provider:
        app = gateway(provider.url, records, tmp_path / "g.db")
        with run_server(app, server="uvicorn") as server:
            first = await cancelled_record(server.url, records)
            assert first.usage_note == "estimated at 4 characters per token"
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                for _ in range(3):  # complete answers, with the provider's usage
                    whole = await client.post(
                        "/v1/chat/completions", content=body(include_usage=True), headers=HEADERS
                    )
                    assert whole.status_code == 200
            async with asyncio.timeout(10):
                while len(records) < 4:
                    await asyncio.sleep(0.02)
            assert all(r.usage_source == "provider" and r.usage_note is None for r in records[1:])
            later = await cancelled_record(server.url, records)
        produced = [call.tokens_generated for call in provider.requests]
    assert later.usage_source == "estimated"
    assert later.usage_note is not None
    assert "calibrated on 3 answer(s) of fake-model" in later.usage_note
    # The tokens the gateway relayed before the cancel (the provider may have made one or
    # two more before it saw the connection close), against each estimate.
    assert later.output_tokens is not None
    assert first.output_tokens is not None
    relayed = [await relayed_tokens(tmp_path / "g.db", r) for r in (first, later)]
    assert relayed[0] <= produced[0]
    assert relayed[1] <= produced[-1]
    assert abs(later.output_tokens - relayed[1]) <= 2, (later.output_tokens, relayed)
    assert abs(first.output_tokens - relayed[0]) > abs(later.output_tokens - relayed[1])


async def relayed_tokens(db: Path, record: UsageRecord) -> int:
    """FakeProvider's tokens ("tok0 ", "tok1 ", ...) in what the app produced of the
    record's generation, as its store keeps it."""
    assert record.generation_id is not None
    backend = connect(f"sqlite:///{db}")
    await backend.open()
    try:
        stored = b"".join([piece async for piece in backend.follow(record.generation_id, 0)])
    finally:
        await backend.aclose()
    return analyze(stored[: record.produced_bytes]).text.count("tok")


def test_the_offline_openai_tokenizer_counts_exactly() -> None:
    count = openai_tokenizer("gpt-4o")
    assert count("Hello, world!") == 4  # Hello , ␣world !
    assert count("") == 0


def test_the_offline_tokenizer_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bpe_openai", None)
    with pytest.raises(ImportError, match=r"asgi-disconnect\[tokens\]"):
        openai_tokenizer()
