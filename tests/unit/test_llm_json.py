"""What makes a JSON body an LLM API's answer: its shape, and for ``usage`` the token counts
it holds, not the member's name (an app's own ``{"usage": ...}`` is no generation)."""

from __future__ import annotations

import pytest

from asgi_disconnect.metering import is_llm_json


@pytest.mark.parametrize(
    "body",
    [
        b'{"n": 3, "usage": "not an llm"}',
        b'{"plan": "free", "usage": {"requests": 10, "limit": 100}}',
        b'{"usage": {"tokens": "many"}}',
        b'{"usage": {"prompt_tokens": "3"}}',
        b'{"usageMetadata": null}',
    ],
)
def test_an_apps_own_usage_member_is_not_an_llm_answer(body: bytes) -> None:
    assert not is_llm_json(body, 200)
    assert not is_llm_json(body[:-1], 200, whole=False)  # its first part, streamed


@pytest.mark.parametrize(
    "body",
    [
        b'{"data": [[0.1]], "usage": {"prompt_tokens": 2, "total_tokens": 2}}',
        b'{"id": "x", "usage": {"input_tokens": 10, "output_tokens": 5}}',
        b'{"usageMetadata": {"promptTokenCount": 4, "candidatesTokenCount": 7}}',
    ],
)
def test_a_usage_of_token_counts_is_an_llm_answer(body: bytes) -> None:
    assert is_llm_json(body, 200)
    assert is_llm_json(body[:-1], 200, whole=False)
