"""The official openai and anthropic SDKs, pointed at the demo with ``base_url``, stream
through it unchanged and read their usage; a request retried with the same
Idempotency-Key is replayed, not run again (FakeProvider counts the calls)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from .conftest import demo_server

pytestmark = [pytest.mark.anyio, pytest.mark.server]

FULL = "".join(f"tok{i} " for i in range(60))
MESSAGES = [{"role": "user", "content": "hello"}]


async def settled_usage(
    base: str, generation_id: str, credentials: dict[str, str]
) -> dict[str, object]:
    """The record, read back as the caller that made it (anyone else gets 404)."""
    async with httpx.AsyncClient(base_url=base, headers=credentials) as client:
        for _ in range(100):
            response = await client.get(f"/demo/usage/{generation_id}")
            if response.status_code == 200:
                return dict(response.json())
            assert response.status_code == 404
            assert response.headers["content-type"] == "application/problem+json"
            await asyncio.sleep(0.05)
    raise AssertionError("no usage record")


async def test_the_openai_sdk_streams_through_the_demo(tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    with demo_server(tmp_path, tokens=60, tokens_per_second=2000) as demo:
        async with AsyncOpenAI(base_url=f"{demo.url}/v1", api_key="sk-test") as client:
            raw = await client.chat.completions.with_raw_response.create(
                model="fake-model",
                messages=MESSAGES,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
            )
            generation_id = raw.headers["x-generation-id"]
            text, usage = "", None
            async for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                usage = chunk.usage or usage
            assert text == FULL
            assert usage is not None
            assert (usage.prompt_tokens, usage.completion_tokens) == (12, 60)
            whole = await client.chat.completions.create(
                model="fake-model",
                messages=MESSAGES,  # type: ignore[arg-type]
            )
            assert whole.choices[0].message.content == FULL
            assert whole.usage is not None
            assert whole.usage.completion_tokens == 60
        record = await settled_usage(demo.url, generation_id, {"authorization": "Bearer sk-test"})
        assert record["usage_source"] == "provider"
        assert (record["input_tokens"], record["output_tokens"]) == (12, 60)
        assert record["outcome"] == "complete"
        # The key reached the provider as the SDK sent it.
        assert demo.provider.requests[0].body["stream"] is True


async def test_the_anthropic_sdk_streams_through_the_demo(tmp_path: Path) -> None:
    from anthropic import AsyncAnthropic

    with demo_server(tmp_path, tokens=60, tokens_per_second=2000) as demo:
        async with AsyncAnthropic(base_url=demo.url, api_key="sk-ant-test") as client:
            async with client.messages.stream(
                model="fake-model",
                max_tokens=200,
                messages=MESSAGES,  # type: ignore[arg-type]
            ) as stream:
                text = "".join([piece async for piece in stream.text_stream])
                final = await stream.get_final_message()
            assert text == FULL
            assert (final.usage.input_tokens, final.usage.output_tokens) == (12, 60)
            assert final.stop_reason == "end_turn"
        (call,) = demo.provider.requests
        assert call.api == "anthropic_messages"


async def test_a_retry_with_the_same_idempotency_key_is_replayed(tmp_path: Path) -> None:
    from openai import AsyncOpenAI

    with demo_server(tmp_path, tokens=60, tokens_per_second=2000) as demo:
        async with AsyncOpenAI(base_url=f"{demo.url}/v1", api_key="sk-test") as client:
            answers = []
            for _ in range(2):
                raw = await client.chat.completions.with_raw_response.create(
                    model="fake-model",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_headers={"Idempotency-Key": "retry-1"},
                )
                text = ""
                async for chunk in raw.parse():
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                answers.append((raw.headers.get("idempotent-replayed"), text))
        assert answers == [(None, FULL), ("true", FULL)]
        assert len(demo.provider.requests) == 1  # run once, paid once


async def test_a_refusal_reaches_each_sdk_with_its_reason(tmp_path: Path) -> None:
    """The stack's refusals are problem+json with an ``error`` object too, the shape the
    openai and anthropic SDKs read: the exception names the reason, not only the status."""
    import anthropic
    import openai

    other = [{"role": "user", "content": "another question"}]
    key = {"Idempotency-Key": "reused-1"}
    with demo_server(tmp_path, tokens=5, tokens_per_second=2000) as demo:
        async with openai.AsyncOpenAI(base_url=f"{demo.url}/v1", api_key="sk-test") as client:
            await client.chat.completions.create(
                model="fake-model",
                messages=MESSAGES,  # type: ignore[arg-type]
                extra_headers=key,
            )
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(
                    model="fake-model",
                    messages=other,  # type: ignore[arg-type]
                    extra_headers=key,
                )
        async with anthropic.AsyncAnthropic(base_url=demo.url, api_key="sk-ant-test") as claude:
            await claude.messages.create(
                model="fake-model",
                max_tokens=20,
                messages=MESSAGES,  # type: ignore[arg-type]
                extra_headers=key,
            )
            with pytest.raises(anthropic.APIStatusError) as declined:
                await claude.messages.create(
                    model="fake-model",
                    max_tokens=20,
                    messages=other,  # type: ignore[arg-type]
                    extra_headers=key,
                )
    assert refused.value.status_code == declined.value.status_code == 422
    assert refused.value.code == "idempotency-key-reused"
    assert refused.value.type == "idempotency_key_reused"
    assert isinstance(refused.value.body, dict)
    assert "another request" in str(refused.value.body["message"])
    body = declined.value.body
    assert isinstance(body, dict)
    assert body["error"]["code"] == "idempotency-key-reused"
    assert body["type"] == "urn:asgi-disconnect:problem:idempotency-key-reused"
