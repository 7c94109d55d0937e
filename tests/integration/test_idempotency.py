"""Idempotency across two server processes sharing one store, and across a SIGKILL."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from asgi_disconnect.testing import FakeProvider
from tests.integration.processes import serve

pytestmark = [pytest.mark.anyio, pytest.mark.server]

APP = "tests.integration.idempotent_app:app"
BODY = json.dumps(
    {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "invoice"}]}
).encode()


def headers(key: str) -> dict[str, str]:
    return {
        "authorization": "Bearer alice",
        "idempotency-key": key,
        "content-type": "application/json",
    }


@pytest.fixture(params=["sqlite", "postgres"])
def shared_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_url"))


async def test_fifty_concurrent_retries_over_two_processes_run_once(shared_url: str) -> None:
    with FakeProvider(tokens=60, tokens_per_second=200) as provider:
        env = {"ASGI_DISCONNECT_URL": shared_url, "UPSTREAM_URL": provider.url}
        with serve(APP, env) as (a, _), serve(APP, env) as (b, _):
            async with httpx.AsyncClient(timeout=30) as client:

                async def call(i: int) -> httpx.Response:
                    base = a if i % 2 == 0 else b
                    return await client.post(
                        f"{base}/v1/chat/completions", content=BODY, headers=headers("order-1")
                    )

                first_wave = await asyncio.gather(*(call(i) for i in range(50)))
                await asyncio.sleep(0.2)
                second_wave = await asyncio.gather(*(call(i) for i in range(10)))
    responses = [*first_wave, *second_wave]
    assert len(provider.requests) == 1, "the upstream must be called exactly once"
    ran = [r for r in responses if r.status_code == 200 and "idempotent-replayed" not in r.headers]
    replayed = [r for r in responses if r.headers.get("idempotent-replayed") == "true"]
    conflicts = [r for r in responses if r.status_code == 409]
    assert len(ran) == 1
    assert len(ran) + len(replayed) + len(conflicts) == 60
    assert all(r.headers["content-type"] == "application/problem+json" for r in conflicts)
    assert all(int(r.headers["retry-after"]) >= 1 for r in conflicts)
    original = ran[0].content
    assert original.endswith(b"data: [DONE]\n\n")
    assert all(r.content == original and r.status_code == 200 for r in replayed)
    assert len(replayed) >= 10  # at least the whole second wave
    print(f"{shared_url.split(':')[0]}: 1 ran, {len(replayed)} replayed, {len(conflicts)} got 409")


async def test_a_killed_owner_is_taken_over_after_its_lease(shared_url: str) -> None:
    with FakeProvider(tokens=400, tokens_per_second=100) as provider:
        env = {
            "ASGI_DISCONNECT_URL": shared_url,
            "UPSTREAM_URL": provider.url,
            "ASGI_DISCONNECT_LEASE": "1.0",
        }
        with serve(APP, env) as (a, proc_a), serve(APP, env) as (b, _):
            async with httpx.AsyncClient(timeout=30) as client:
                doomed = asyncio.ensure_future(
                    client.post(
                        f"{a}/v1/chat/completions", content=BODY, headers=headers("order-2")
                    )
                )
                (first_call,) = await provider.await_requests(1)
                proc_a.kill()
                proc_a.wait()
                with pytest.raises(httpx.HTTPError):
                    await doomed
                early = await client.post(
                    f"{b}/v1/chat/completions", content=BODY, headers=headers("order-2")
                )
                assert early.status_code == 409  # its lease is still running
                await asyncio.sleep(1.5)
                retried = await client.post(
                    f"{b}/v1/chat/completions", content=BODY, headers=headers("order-2")
                )
                again = await client.post(
                    f"{b}/v1/chat/completions", content=BODY, headers=headers("order-2")
                )
    assert first_call.connection_closed_early
    assert retried.status_code == 200
    assert "idempotent-replayed" not in retried.headers
    assert retried.content.endswith(b"data: [DONE]\n\n")
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.content == retried.content
    finished = [r for r in provider.requests if r.finished]
    assert len(finished) == 1, "the work completed exactly once"
