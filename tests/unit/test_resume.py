"""The resume endpoints: status, replay from an offset, and every kind of bad input."""

from __future__ import annotations

import asyncio

import anyio
import msgspec
import pytest

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, default_principal
from asgi_disconnect._log import Generation, Status
from asgi_disconnect.testing import drive
from tests.apps import Probe, sse_app

pytestmark = pytest.mark.anyio

ALICE = [("authorization", "Bearer alice")]
BOB = [("authorization", "Bearer bob")]


@pytest.fixture
def mw() -> DisconnectMiddleware:
    return DisconnectMiddleware(sse_app(Probe(), chunks=10, delay=0), backend=MemoryBackend())


async def made_by_alice(mw: DisconnectMiddleware) -> tuple[str, bytes]:
    result = await drive(mw, path="/cancel", headers=ALICE)
    generation_id = result.header("x-generation-id")
    assert generation_id is not None
    return generation_id, result.body


def problem(result: object) -> dict[str, object]:
    assert result.header("content-type") == "application/problem+json"  # type: ignore[attr-defined]
    return msgspec.json.decode(result.body)  # type: ignore[attr-defined,no-any-return]


async def test_owner_reads_status_and_stream(mw: DisconnectMiddleware) -> None:
    generation_id, body = await made_by_alice(mw)
    status = await drive(mw, path=f"/generations/{generation_id}", headers=ALICE)
    info = msgspec.json.decode(status.body)
    assert info["id"] == generation_id
    assert info["status"] == "complete"
    assert info["size"] == len(body)
    assert info["status_code"] == 200
    stream = await drive(mw, path=f"/generations/{generation_id}/stream", headers=ALICE)
    assert stream.body == body


@pytest.mark.parametrize("suffix", ["", "/stream"])
async def test_another_principal_gets_404(mw: DisconnectMiddleware, suffix: str) -> None:
    generation_id, _ = await made_by_alice(mw)
    for headers in (BOB, [], [("x-api-key", "alice")]):
        result = await drive(mw, path=f"/generations/{generation_id}{suffix}", headers=headers)
        assert result.status == 404
        body = problem(result)
        assert body["type"] == "urn:asgi-disconnect:problem:generation-not-found"
        assert body["status"] == 404


@pytest.mark.parametrize(
    "path",
    [
        "/generations/gen_AAAAAAAAAAAAAAAAAAAAAAAA",
        "/generations/gen_AAAAAAAAAAAAAAAAAAAAAAAA/stream",
    ],
)
async def test_unknown_id_is_404(mw: DisconnectMiddleware, path: str) -> None:
    result = await drive(mw, path=path, headers=ALICE)
    assert result.status == 404
    assert problem(result)["type"] == "urn:asgi-disconnect:problem:generation-not-found"


@pytest.mark.parametrize(
    "path",
    [
        "/generations/",
        "/generations/nope",
        "/generations/gen_short",
        "/generations/gen_AAAAAAAAAAAAAAAAAAAAAAAA/",
        "/generations/gen_AAAAAAAAAAAAAAAAAAAAAAAA/other",
        "/generations/gen_AAAAAAAAAAAAAAAAAAAAAAAA/stream/x",
        "/generations/../etc/passwd",
        "/generations/gen_AAAAAAAAAAAAAAAAAAAAAA\u00e9A",
    ],
)
async def test_other_paths_under_the_prefix_stay_the_apps(
    mw: DisconnectMiddleware, path: str
) -> None:
    # Only /{id} and /{id}/stream of a well-formed id are the middleware's.
    result = await drive(mw, path=path)
    assert result.status == 404
    assert result.header("content-type") == "text/plain; charset=utf-8"
    assert result.body == b"Not Found"


async def test_prefix_alone_is_left_to_the_app(mw: DisconnectMiddleware) -> None:
    result = await drive(mw, path="/generations")
    assert result.status == 404
    assert result.header("content-type") != "application/problem+json"


@pytest.mark.parametrize(
    "query",
    [
        b"offset=abc",
        b"offset=-1",
        b"offset=1.5",
        b"offset=",
        b"offset=1&offset=2",
        b"offset=%EF%BC%91",
        b"offset=+5",
        b"offset=5%20",
    ],
)
async def test_bad_offset_is_400(mw: DisconnectMiddleware, query: bytes) -> None:
    generation_id, _ = await made_by_alice(mw)
    result = await drive(
        mw, path=f"/generations/{generation_id}/stream", query_string=query, headers=ALICE
    )
    assert result.status == 400
    assert problem(result)["type"] == "urn:asgi-disconnect:problem:invalid-offset"


async def test_offset_past_the_end_is_416(mw: DisconnectMiddleware) -> None:
    generation_id, body = await made_by_alice(mw)
    result = await drive(
        mw,
        path=f"/generations/{generation_id}/stream",
        query_string=f"offset={len(body) + 1}".encode(),
        headers=ALICE,
    )
    assert result.status == 416
    assert problem(result)["type"] == "urn:asgi-disconnect:problem:offset-out-of-range"
    assert result.header("content-range") == f"bytes */{len(body)}"
    at_end = await drive(
        mw,
        path=f"/generations/{generation_id}/stream",
        query_string=f"offset={len(body)}".encode(),
        headers=ALICE,
    )
    assert at_end.status == 200
    assert at_end.body == b""


@pytest.mark.parametrize(
    "offset", ["9999999999999999999", "99999999999999999999999", "1" + "0" * 5000]
)
async def test_a_number_too_big_is_out_of_range_not_malformed(
    mw: DisconnectMiddleware, offset: str
) -> None:
    generation_id, body = await made_by_alice(mw)
    result = await drive(
        mw,
        path=f"/generations/{generation_id}/stream",
        query_string=f"offset={offset}".encode(),
        headers=ALICE,
    )
    assert result.status == 416
    assert problem(result)["type"] == "urn:asgi-disconnect:problem:offset-out-of-range"
    assert result.header("content-range") == f"bytes */{len(body)}"


async def test_leading_zeros_are_the_same_offset(mw: DisconnectMiddleware) -> None:
    generation_id, body = await made_by_alice(mw)
    result = await drive(
        mw,
        path=f"/generations/{generation_id}/stream",
        query_string=b"offset=" + b"0" * 30 + b"7",
        headers=ALICE,
    )
    assert result.status == 200
    assert result.body == body[7:]


async def running_here() -> tuple[DisconnectMiddleware, Generation]:
    backend = MemoryBackend()
    generation = Generation(
        "gen_" + "R" * 24,
        principal=default_principal({"headers": [(b"authorization", b"Bearer alice")]}),
        content_type="text/event-stream",
    )
    backend.register(generation)
    generation.append(b"data: 1\n\n")
    return DisconnectMiddleware(sse_app(Probe()), backend=backend), generation


@pytest.mark.parametrize("ahead", [1, 1 << 40])
async def test_past_the_live_size_of_a_generation_running_here_is_416_at_once(
    ahead: int,
) -> None:
    # This process's live log is the truth: no byte past it exists anywhere yet.
    mw, generation = await running_here()
    with anyio.fail_after(1):
        result = await drive(
            mw,
            path=f"/generations/{generation.id}/stream",
            query_string=f"offset={generation.size + ahead}".encode(),
            headers=ALICE,
            timeout=1,
        )
    assert result.status == 416
    assert problem(result)["type"] == "urn:asgi-disconnect:problem:offset-out-of-range"
    assert result.header("content-range") == f"bytes */{generation.size}"
    generation.finish(Status.COMPLETE)


async def test_within_the_live_size_of_a_running_generation_follows_it() -> None:
    mw, generation = await running_here()

    async def produce() -> None:
        await asyncio.sleep(0.05)
        generation.append(b"data: 2\n\n")
        generation.finish(Status.COMPLETE)

    producing = asyncio.ensure_future(produce())
    result = await drive(
        mw,
        path=f"/generations/{generation.id}/stream",
        query_string=f"offset={generation.size}".encode(),
        headers=ALICE,
    )
    await producing
    assert result.status == 200
    assert result.body == b"data: 2\n\n"


async def test_other_methods_are_405(mw: DisconnectMiddleware) -> None:
    generation_id, _ = await made_by_alice(mw)
    result = await drive(mw, method="DELETE", path=f"/generations/{generation_id}", headers=ALICE)
    assert result.status == 405
    assert result.header("allow") == "GET, HEAD"
    assert problem(result)["type"] == "urn:asgi-disconnect:problem:method-not-allowed"


async def test_head_sends_headers_only(mw: DisconnectMiddleware) -> None:
    generation_id, _ = await made_by_alice(mw)
    result = await drive(
        mw, method="HEAD", path=f"/generations/{generation_id}/stream", headers=ALICE
    )
    assert result.status == 200
    assert result.body == b""


async def test_resume_prefix_none_leaves_the_path_to_the_app() -> None:
    mw = DisconnectMiddleware(sse_app(Probe()), backend=MemoryBackend(), resume_prefix=None)
    result = await drive(mw, path="/generations/gen_AAAAAAAAAAAAAAAAAAAAAAAA")
    assert result.status == 404
    assert result.header("content-type") != "application/problem+json"


async def test_custom_prefix_and_principal() -> None:
    mw = DisconnectMiddleware(
        sse_app(Probe(), chunks=3, delay=0),
        backend=MemoryBackend(),
        resume_prefix="/v1/resume",
        principal=lambda scope: dict(scope["headers"]).get(b"x-tenant", b"").decode(),
    )
    made = await drive(mw, path="/cancel", headers=[("x-tenant", "acme")])
    generation_id = made.header("x-generation-id")
    mine = await drive(mw, path=f"/v1/resume/{generation_id}", headers=[("x-tenant", "acme")])
    assert mine.status == 200
    theirs = await drive(mw, path=f"/v1/resume/{generation_id}", headers=[("x-tenant", "other")])
    assert theirs.status == 404
