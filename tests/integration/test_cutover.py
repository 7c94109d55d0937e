"""A provider cutover on two uvicorn processes and PostgreSQL: sessions started before the
flip finish every turn on the old provider, new sessions use the new one, and a request
retried after a connection error never reaches two providers (each FakeProvider counts the
requests it got, by session)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx
import pytest

from asgi_disconnect.testing import FakeProvider

from .processes import serve

pytestmark = [pytest.mark.anyio, pytest.mark.server, pytest.mark.postgres]


def turn(session: str, n: int) -> dict[str, object]:
    return {
        "model": "fake-model",
        "stream": True,
        "user": session,
        "messages": [{"role": "user", "content": f"turn {n}"}],
    }


async def test_a_cutover_moves_only_new_sessions_and_no_retry_crosses(
    postgres_url: str, tmp_path: Path
) -> None:
    default = tmp_path / "default"
    default.write_text("old")
    headers = {"authorization": "Bearer tenant-1"}
    with (
        FakeProvider(tokens=5, tokens_per_second=500) as old,
        FakeProvider(tokens=5, tokens_per_second=500) as new,
    ):
        env = {
            "CUTOVER_PG": postgres_url,
            "CUTOVER_PROVIDERS": f"old={old.url},new={new.url}",
            "CUTOVER_DEFAULT": str(default),
        }
        app = "tests.integration.cutover_app:app"
        with serve(app, env) as (a, _), serve(app, env) as (b, _):
            replicas = [a, b]
            async with httpx.AsyncClient(timeout=30, headers=headers) as client:

                async def chat(replica: str, session: str, n: int, **extra: str) -> httpx.Response:
                    response = await client.post(
                        f"{replica}/v1/chat/completions",
                        json=turn(session, n),
                        headers={"x-session-id": session, **extra},
                    )
                    assert response.status_code == 200, response.text
                    return response

                before = [f"before-{i}" for i in range(10)]
                for i, session in enumerate(before):  # first turns, on either replica
                    response = await chat(replicas[i % 2], session, 1)
                    assert response.headers["x-provider"] == "old"
                default.write_text("new")  # the flip
                after = [f"after-{i}" for i in range(10)]
                jobs = []
                for n in (2, 3):
                    jobs += [chat(replicas[(i + n) % 2], s, n) for i, s in enumerate(before)]
                for n in (1, 2, 3):
                    jobs += [chat(replicas[(i + n) % 2], s, n) for i, s in enumerate(after)]
                answers = await asyncio.gather(*jobs)
                # A connection error mid-answer, then the retry on the other replica.
                for i, session in enumerate(before[:3] + after[:3]):
                    broken = await chat(
                        replicas[i % 2], session, 4, **{"x-fake-fault": "reset-after=2"}
                    )
                    assert b"data: [DONE]" not in broken.content
                    assert b"event: error" in broken.content
                    retried = await chat(replicas[(i + 1) % 2], session, 4)
                    assert retried.content.endswith(b"data: [DONE]\n\n")
                    assert retried.headers["x-provider"] == broken.headers["x-provider"]
            for response in answers:
                session = response.request.headers["x-session-id"]
                assert response.headers["x-provider"] == ("old" if session in before else "new")

    old_sessions = Counter(str(call.body["user"]) for call in old.requests)
    new_sessions = Counter(str(call.body["user"]) for call in new.requests)
    assert set(old_sessions) == set(before)
    assert set(new_sessions) == set(after)
    assert not set(old_sessions) & set(new_sessions)
    # Three turns each, plus the broken fourth and its retry for three sessions of each.
    assert sorted(old_sessions.values()) == [3] * 7 + [5] * 3
    assert sorted(new_sessions.values()) == [3] * 7 + [5] * 3
