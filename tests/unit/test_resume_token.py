"""Resume tokens: how a browser's EventSource, which cannot send Authorization, resumes."""

from __future__ import annotations

import time

import msgspec
import pytest

from asgi_disconnect import DisconnectMiddleware, MemoryBackend
from asgi_disconnect.testing import drive
from tests.apps import Probe, sse_app

pytestmark = pytest.mark.anyio

ALICE = [("authorization", "Bearer alice")]
BOB = [("authorization", "Bearer bob")]
SSE = ("accept", "text/event-stream")
INVALID = "urn:asgi-disconnect:problem:invalid-resume-token"


def middleware(
    backend: MemoryBackend, secret: bytes | None = b"s" * 32, *, token_ttl: float = 300.0
) -> DisconnectMiddleware:
    app = sse_app(Probe(), chunks=5, delay=0)
    return DisconnectMiddleware(
        app, backend=backend, resume_secret=secret, resume_token_ttl=token_ttl
    )


async def made(mw: DisconnectMiddleware) -> tuple[str, bytes]:
    result = await drive(mw, path="/cancel", headers=ALICE)
    generation_id = result.header("x-generation-id")
    assert generation_id is not None
    return generation_id, result.body


async def minted(mw: DisconnectMiddleware, generation_id: str) -> str:
    result = await drive(
        mw, method="POST", path=f"/generations/{generation_id}/token", headers=ALICE
    )
    assert result.status == 200
    assert result.header("cache-control") == "no-store"
    answer = msgspec.json.decode(result.body)
    assert answer["expires_in"] == 300
    return str(answer["token"])


async def test_a_token_lets_a_client_without_authorization_read_that_generation() -> None:
    mw = middleware(MemoryBackend())
    generation_id, body = await made(mw)
    token = await minted(mw, generation_id)
    query = f"token={token}".encode()
    status = await drive(mw, path=f"/generations/{generation_id}", query_string=query)
    assert status.status == 200
    assert msgspec.json.decode(status.body)["id"] == generation_id
    stream = await drive(
        mw, path=f"/generations/{generation_id}/stream", query_string=query, headers=[SSE]
    )
    assert stream.status == 200
    assert stream.body.count(b"data: ") == body.count(b"data: ")
    # Without it, the same request finds nothing.
    bare = await drive(mw, path=f"/generations/{generation_id}/stream")
    assert bare.status == 404


async def test_a_token_opens_nothing_else() -> None:
    mw = middleware(MemoryBackend())
    first, _ = await made(mw)
    second, _ = await made(mw)
    token = await minted(mw, first)
    other = await drive(
        mw, path=f"/generations/{second}/stream", query_string=f"token={token}".encode()
    )
    assert other.status == 401
    assert msgspec.json.decode(other.body)["type"] == INVALID
    # It does not stop anything: a Stop needs the owner's own credentials.
    stop = await drive(
        mw,
        method="POST",
        path=f"/generations/{first}/cancel",
        query_string=f"token={token}".encode(),
    )
    assert stop.status == 404
    # Only the owner mints one.
    refused = await drive(mw, method="POST", path=f"/generations/{first}/token", headers=BOB)
    assert refused.status == 404


@pytest.mark.parametrize(
    "damage",
    [
        lambda token: token[:-2] + ("AA" if not token.endswith("AA") else "BB"),
        lambda token: str(int(token.split(".")[0]) + 60) + "." + token.split(".")[1],
        lambda token: "not-a-token",
        lambda token: "." + token,
        lambda token: "9" * 40 + "." + token.split(".")[1],
    ],
)
async def test_a_tampered_token_is_refused(damage: object) -> None:
    mw = middleware(MemoryBackend())
    generation_id, _ = await made(mw)
    token = damage(await minted(mw, generation_id))  # type: ignore[operator]
    result = await drive(
        mw, path=f"/generations/{generation_id}", query_string=f"token={token}".encode()
    )
    assert result.status == 401
    assert result.header("content-type") == "application/problem+json"
    assert msgspec.json.decode(result.body)["type"] == INVALID


async def test_an_expired_token_is_refused() -> None:
    mw = middleware(MemoryBackend(), token_ttl=1e-9)
    generation_id, _ = await made(mw)
    owner = await mw.backend.principal_of(generation_id)
    assert owner is not None
    token = mw.resume_token(generation_id, owner)
    # Expiries are whole seconds, rounded down: a life this short is over when it is made.
    assert int(token.split(".")[0]) < time.time()
    result = await drive(
        mw, path=f"/generations/{generation_id}", query_string=f"token={token}".encode()
    )
    assert result.status == 401


async def test_replicas_that_share_the_secret_honour_each_others_tokens() -> None:
    backend = MemoryBackend()  # one store, as replicas share a database
    a, b = middleware(backend), middleware(backend)
    stranger = middleware(backend, secret=None)  # a secret of its own
    generation_id, _ = await made(a)
    token = await minted(a, generation_id)
    query = f"token={token}".encode()
    assert (await drive(b, path=f"/generations/{generation_id}", query_string=query)).status == 200
    assert (
        await drive(stranger, path=f"/generations/{generation_id}", query_string=query)
    ).status == 401


def test_a_bad_token_life_is_refused() -> None:
    with pytest.raises(ValueError, match="resume_token_ttl"):
        DisconnectMiddleware(sse_app(Probe()), backend=MemoryBackend(), resume_token_ttl=0)
