"""Promises that broke at the seams: a cut response, an odd JSON body, two callers alike."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import MemoryBackend, UsageRecord, default_principal, install
from asgi_disconnect.testing import drive

pytestmark = pytest.mark.anyio

AUTH = ("authorization", "Bearer alice")


async def eventually(check: Callable[[], object], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.005)


class Runs:
    def __init__(self) -> None:
        self.count = 0


def streaming_app(runs: Runs, media_type: str, parts: list[bytes]) -> Starlette:
    async def produce(request: Request) -> StreamingResponse:
        runs.count += 1

        async def body() -> AsyncIterator[bytes]:
            for part in parts:
                yield part
                await asyncio.sleep(0.05)

        return StreamingResponse(body(), media_type=media_type)

    return Starlette(routes=[Route("/produce", produce, methods=["POST"])])


@pytest.mark.parametrize(
    ("media_type", "parts"),
    [
        ("text/event-stream", [b"data: %d\n\n" % i for i in range(20)]),
        ("application/json", [b'{"part":1,', b'"more":"' + b"x" * 40 + b'",', b'"end":true}']),
    ],
)
async def test_a_response_cut_by_a_disconnect_is_not_replayed(
    media_type: str, parts: list[bytes]
) -> None:
    runs = Runs()
    app = streaming_app(runs, media_type, parts)
    install(app, backend=MemoryBackend(), idempotency=True)
    headers = [AUTH, ("idempotency-key", "cut-1")]
    cut = await drive(app, method="POST", path="/produce", headers=headers,
                      disconnect_after_bytes=10)
    assert cut.disconnected
    retry = await drive(app, method="POST", path="/produce", headers=headers)
    assert retry.header("idempotent-replayed") is None
    assert retry.status == 200
    assert retry.body == b"".join(parts)
    assert runs.count == 2
    # The whole response is what gets stored, and replayed from then on.
    replay = await drive(app, method="POST", path="/produce", headers=headers)
    assert replay.header("idempotent-replayed") == "true"
    assert replay.body == b"".join(parts)
    assert runs.count == 2


@pytest.mark.parametrize(
    "payload",
    [
        {"usage": 5},
        {"choices": ["x"]},
        {"usage": {"prompt_tokens": "many"}},
        {"choices": [None], "usage": None},
        {"usageMetadata": 3},
        {"error": "boom"},
        [1, 2, 3],
    ],
)
async def test_any_json_body_gets_its_one_record_and_settles(payload: Any) -> None:
    records: list[UsageRecord] = []
    settled: list[UsageRecord] = []

    class Ledger:
        async def reserve(self, scope: Any) -> str:
            return "r1"

        async def settle(self, reservation: Any, record: UsageRecord) -> None:
            assert reservation == "r1"
            settled.append(record)

    async def odd(request: Request) -> JSONResponse:
        return JSONResponse(payload)

    app = Starlette(routes=[Route("/odd", odd)])
    install(app, backend=MemoryBackend(), sinks=[records.append], reservations=Ledger())
    result = await drive(app, path="/odd", headers=[AUTH])
    assert result.status == 200
    await eventually(lambda: records and settled)
    (record,) = records
    assert settled == [record]
    assert record.usage_source == "none"
    assert record.output_tokens is None
    assert record.principal


def test_the_same_secret_in_two_headers_is_two_callers() -> None:
    bearer = default_principal({"headers": [(b"authorization", b"Bearer A")]})
    api_key = default_principal({"headers": [(b"x-api-key", b"Bearer A")]})
    assert bearer != api_key
    assert bearer
    assert api_key
