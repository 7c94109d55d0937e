"""IdempotencyMiddleware in-process: keys, fingerprints, outcomes and every refusal."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from asgi_disconnect import IdempotencyMiddleware, MemoryBackend, connect, idempotent
from asgi_disconnect._idempotency import parse_key
from asgi_disconnect.testing import drive

pytestmark = pytest.mark.anyio

AUTH = ("authorization", "Bearer alice")


class Upstream:
    """Counts the calls that would cost money."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = asyncio.Event()
        self.release.set()


def app(upstream: Upstream) -> Starlette:
    async def charge(request: Request) -> JSONResponse:
        upstream.calls += 1
        await upstream.release.wait()
        body = await request.body()
        return JSONResponse({"charged": body.decode(), "call": upstream.calls}, status_code=201)

    async def stream(request: Request) -> StreamingResponse:
        upstream.calls += 1

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(5):
                yield b"data: %d\n\n" % i

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def broken(request: Request) -> Response:
        upstream.calls += 1
        return Response("upstream down", status_code=502)

    async def invalid(request: Request) -> Response:
        upstream.calls += 1
        return Response("bad input", status_code=400)

    async def raising(request: Request) -> Response:
        upstream.calls += 1
        raise RuntimeError("boom")

    async def later(request: Request) -> Response:
        """The provider's "come back later", relayed: 429, 408, or any error with Retry-After."""
        upstream.calls += 1
        status = int(request.query_params["status"])
        headers = {"retry-after": "2"} if "retry" in request.query_params else None
        return JSONResponse({"error": {"type": "rate_limit"}}, status_code=status, headers=headers)

    @idempotent(required=True)
    async def must(request: Request) -> Response:
        upstream.calls += 1
        return Response("ok")

    return Starlette(
        routes=[
            Route("/charge", charge, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/broken", broken, methods=["POST"]),
            Route("/invalid", invalid, methods=["POST"]),
            Route("/raising", raising, methods=["POST"]),
            Route("/later", later, methods=["POST"]),
            Route("/must", must, methods=["POST"]),
        ]
    )


def stack(upstream: Upstream, **options: Any) -> IdempotencyMiddleware:
    options.setdefault("backend", MemoryBackend())
    return IdempotencyMiddleware(app(upstream), **options)


async def post(
    mw: Any,
    path: str = "/charge",
    key: str | None = "k-1",
    body: bytes = b"10",
    headers: list[tuple[str, str]] | None = None,
) -> Any:
    sent = [AUTH] if headers is None else headers
    if key is not None:
        sent = [*sent, ("idempotency-key", key)]
    path, _, query = path.partition("?")
    return await drive(
        mw, method="POST", path=path, query_string=query.encode(), headers=sent, body=body
    )


def problem_type(result: Any) -> str:
    assert result.header("content-type") == "application/problem+json"
    return str(msgspec.json.decode(result.body)["type"]).rsplit(":", 1)[1]


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b'"abc"', "abc"),
        (b"550e8400-e29b-41d4-a716-446655440000", "550e8400-e29b-41d4-a716-446655440000"),
        (b'"a\\"b\\\\c"', 'a"b\\c'),
        (b'  "padded"  ', "padded"),
        (b'"' + b"x" * 255 + b'"', "x" * 255),
    ],
)
def test_keys_that_parse(raw: bytes, key: str) -> None:
    assert parse_key([raw]) == key


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b'""',
        b'"unterminated',
        b'"a"b',
        b'"a";p=1',
        b"two words",
        b"a,b",
        b'"\\x"',
        b"\xc3\xa9t\xc3\xa9",
        b'"caf\xc3\xa9"',
        b"x" * 256,
        b'"' + b"x" * 256 + b'"',
        b'"tab\there"',
    ],
)
def test_malformed_keys(raw: bytes) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        parse_key([raw])


async def test_first_runs_then_retries_replay_byte_identical() -> None:
    upstream = Upstream()
    mw = stack(upstream)
    first = await post(mw)
    again = await post(mw)
    assert upstream.calls == 1
    assert first.status == again.status == 201
    assert again.body == first.body
    assert again.header("idempotent-replayed") == "true"
    assert first.header("idempotent-replayed") is None
    assert again.header("content-type") == "application/json"
    # The original's framing: a length where it had one, not a chunked replay.
    assert again.header("content-length") == first.header("content-length")
    assert first.header("content-length") == str(len(first.body))


async def test_a_streamed_body_replays_chunk_exact() -> None:
    upstream = Upstream()
    mw = stack(upstream)
    first = await post(mw, "/stream")
    again = await post(mw, "/stream")
    assert upstream.calls == 1
    bodies = [m["body"] for m in again.messages if m["type"] == "http.response.body"]
    assert bodies == [b"data: %d\n\n" % i for i in range(5)]
    assert again.body == first.body
    assert again.header("content-length") is first.header("content-length") is None


async def test_the_same_key_with_another_body_is_422() -> None:
    upstream = Upstream()
    mw = stack(upstream)
    await post(mw, body=b"10")
    other = await post(mw, body=b"11")
    assert other.status == 422
    assert problem_type(other) == "idempotency-key-reused"
    assert upstream.calls == 1


async def test_a_concurrent_retry_gets_409_with_retry_after() -> None:
    upstream = Upstream()
    upstream.release.clear()
    mw = stack(upstream)
    first = asyncio.ensure_future(post(mw))
    await asyncio.sleep(0.05)
    second = await post(mw)
    assert second.status == 409
    assert problem_type(second) == "idempotency-request-in-progress"
    assert second.header("retry-after") is not None
    assert int(second.header("retry-after")) >= 1
    upstream.release.set()
    assert (await first).status == 201
    assert upstream.calls == 1


async def test_keys_are_scoped_to_the_principal() -> None:
    upstream = Upstream()
    mw = stack(upstream)
    await post(mw)
    bob = await post(mw, headers=[("authorization", "Bearer bob")], body=b"99")
    assert bob.status == 201
    assert bob.header("idempotent-replayed") is None
    assert upstream.calls == 2


@pytest.mark.parametrize(
    ("path", "replayed"),
    [
        ("/broken", False),
        ("/raising", False),
        ("/invalid", True),
        ("/later?status=429&retry", False),
        ("/later?status=429", False),
        ("/later?status=408", False),
        ("/later?status=400&retry", False),
        ("/later?status=409", True),
    ],
)
async def test_5xx_and_exceptions_release_4xx_is_stored(path: str, replayed: bool) -> None:
    upstream = Upstream()
    mw = stack(upstream)
    for _ in range(2):
        with contextlib.suppress(RuntimeError):
            await post(mw, path)
    assert upstream.calls == (1 if replayed else 2)


async def test_refusals() -> None:
    upstream = Upstream()
    mw = stack(upstream, max_body=8)
    duplicated = await drive(
        mw,
        method="POST",
        path="/charge",
        headers=[AUTH, ("idempotency-key", "a"), ("idempotency-key", "b")],
    )
    assert duplicated.status == 400
    assert problem_type(duplicated) == "idempotency-key-duplicated"
    malformed = await post(mw, key='"open')
    assert (malformed.status, problem_type(malformed)) == (400, "idempotency-key-malformed")
    anonymous = await post(mw, headers=[])
    assert (anonymous.status, problem_type(anonymous)) == (401, "idempotency-principal-required")
    large = await post(mw, body=b"x" * 9)
    assert (large.status, problem_type(large)) == (413, "idempotency-body-too-large")
    declared = await post(mw, body=b"", headers=[AUTH, ("content-length", "9000")])
    assert declared.status == 413
    assert upstream.calls == 0


async def test_anonymous_callers_when_allowed() -> None:
    upstream = Upstream()
    mw = stack(upstream, allow_anonymous=True)
    await post(mw, headers=[])
    again = await post(mw, headers=[])
    assert again.header("idempotent-replayed") == "true"
    assert upstream.calls == 1


async def test_a_required_key_is_enforced_by_the_decorator() -> None:
    upstream = Upstream()
    mw = stack(upstream)
    missing = await post(mw, "/must", key=None)
    assert (missing.status, problem_type(missing)) == (400, "idempotency-key-missing")
    assert upstream.calls == 0
    present = await post(mw, "/must")
    assert present.status == 200


async def test_an_unreachable_store_is_503_or_fails_open() -> None:
    class Down(MemoryBackend):
        async def claim(self, *args: Any, **kwargs: Any) -> Any:
            raise ConnectionError("store down")

    upstream = Upstream()
    refused = await post(stack(upstream, backend=Down()))
    assert (refused.status, problem_type(refused)) == (503, "idempotency-store-unavailable")
    assert refused.header("retry-after") == "5"
    assert upstream.calls == 0
    passed = await post(stack(upstream, backend=Down(), fail_open=True))
    assert passed.status == 201
    assert upstream.calls == 1


async def test_other_methods_and_paths_pass_through() -> None:
    upstream = Upstream()
    mw = stack(upstream, paths=[r"/stream"])
    await post(mw, "/charge")
    await post(mw, "/charge")
    assert upstream.calls == 2


async def test_claims_in_sqlite_survive_a_new_middleware(sqlite_url: str) -> None:
    upstream = Upstream()
    first_backend = connect(sqlite_url)
    await first_backend.open()
    await post(stack(upstream, backend=first_backend))
    await first_backend.aclose()
    second_backend = connect(sqlite_url)
    await second_backend.open()
    again = await post(stack(upstream, backend=second_backend))
    await second_backend.aclose()
    assert again.header("idempotent-replayed") == "true"
    assert upstream.calls == 1


async def test_in_flight_attach_tails_the_live_generation() -> None:
    from asgi_disconnect import DisconnectMiddleware

    calls = 0

    async def slow(request: Request) -> StreamingResponse:
        nonlocal calls
        calls += 1

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(20):
                yield b"data: %d\n\n" % i
                await asyncio.sleep(0.01)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    backend = MemoryBackend()
    inner = DisconnectMiddleware(
        Starlette(routes=[Route("/slow", slow, methods=["POST"])]), backend=backend
    )
    mw = IdempotencyMiddleware(inner, backend=backend, in_flight="attach")
    first = asyncio.ensure_future(post(mw, "/slow"))
    await asyncio.sleep(0.06)
    attached = await post(mw, "/slow")
    original = await first
    assert calls == 1
    assert attached.status == 200
    assert attached.header("idempotent-replayed") == "true"
    assert attached.header("x-generation-id") == original.header("x-generation-id")
    assert attached.body == original.body
    assert attached.body.endswith(b"data: [DONE]\n\n")
    replay = await post(mw, "/slow")
    assert replay.body == original.body


def test_in_flight_must_be_known() -> None:
    with pytest.raises(ValueError, match="in_flight"):
        IdempotencyMiddleware(app(Upstream()), backend=MemoryBackend(), in_flight="wait")  # type: ignore[arg-type]


async def test_install_puts_idempotency_outside_the_stack() -> None:
    from asgi_disconnect import install
    from asgi_disconnect.testing import lifespan

    upstream = Upstream()
    application = app(upstream)
    install(application, idempotency={"lease": 5.0})
    async with lifespan(application):
        first = await post(application, "/stream")
        again = await post(application, "/stream")
    assert upstream.calls == 1
    assert first.header("x-generation-id") is not None
    assert again.header("idempotent-replayed") == "true"
    assert again.body == first.body


async def test_server_errors_can_be_stored_like_stripe_does() -> None:
    upstream = Upstream()
    mw = stack(upstream, store_server_errors=True)
    await post(mw, "/broken")
    again = await post(mw, "/broken")
    assert upstream.calls == 1
    assert again.status == 502
    assert again.header("idempotent-replayed") == "true"


async def test_a_body_that_differs_by_one_byte_is_another_request() -> None:
    upstream = Upstream()
    mw = stack(upstream)
    await post(mw, body=b"amount=1000")
    changed = await post(mw, body=b"amount=1001")
    assert changed.status == 422
    assert upstream.calls == 1


async def test_a_route_ttl_overrides_the_default() -> None:
    calls = 0

    @idempotent(required=False, ttl=0.1)
    async def brief(request: Request) -> Response:
        nonlocal calls
        calls += 1
        return Response("ok")

    mw = IdempotencyMiddleware(
        Starlette(routes=[Route("/brief", brief, methods=["POST"])]), backend=MemoryBackend()
    )
    await post(mw, "/brief")
    assert (await post(mw, "/brief")).header("idempotent-replayed") == "true"
    await asyncio.sleep(0.2)
    fresh = await post(mw, "/brief")
    assert fresh.header("idempotent-replayed") is None
    assert calls == 2


async def test_the_response_is_stored_before_its_last_byte_is_sent() -> None:
    upstream = Upstream()
    mw = stack(upstream)
    stored_when_sent: list[bool] = []

    async def client(scope, receive, send):  # type: ignore[no-untyped-def]
        async def spy(message):  # type: ignore[no-untyped-def]
            if message["type"] == "http.response.body" and not message.get("more_body"):
                # A retry sent the moment this byte arrives: the stored response, replayed
                # (a claim still running would be a 409).
                retry = await post(mw)
                stored_when_sent.append(retry.header("idempotent-replayed") == "true")
            await send(message)

        await mw(scope, receive, spy)

    await drive(
        client,
        method="POST",
        path="/charge",
        body=b"10",
        headers=[AUTH, ("idempotency-key", "k-1")],
    )
    assert stored_when_sent == [True]
    assert upstream.calls == 1


@pytest.mark.parametrize("policy", ["cancel", "detach"])
async def test_an_answer_that_completed_while_its_client_stopped_reading_is_replayed(
    policy: str,
) -> None:
    """The app finished its answer while its client had stopped reading (a phone gone
    silent), and the client then left: the answer is whole in its log, so a retry with the
    key replays it; the upstream is not paid twice."""
    from asgi_disconnect import disconnect_policy, install
    from asgi_disconnect.testing import lifespan

    runs = 0
    done = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        for i in range(40):
            yield b"data: %d\n\n" % i
            await asyncio.sleep(0.001)  # as a relay does: each event its own send
        yield b"data: [DONE]\n\n"
        done.set()

    @disconnect_policy(policy)  # type: ignore[arg-type]
    async def answer(request: Request) -> StreamingResponse:
        nonlocal runs
        runs += 1
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/answer", answer, methods=["POST"])])
    install(app, backend=MemoryBackend(), idempotency=True)
    headers = [("idempotency-key", "silent-1"), ("authorization", "Bearer alice")]
    async with lifespan(app):
        first = await drive(
            app, method="POST", path="/answer", headers=headers, body=b"{}",
            stop_reading_after_bytes=30, disconnect_after_seconds=0.5,
        )  # fmt: skip
        assert done.is_set()
        again = await drive(app, method="POST", path="/answer", headers=headers, body=b"{}")
    assert len(first.body) < len(again.body)
    assert again.status == 200
    assert again.body.endswith(b"data: 39\n\ndata: [DONE]\n\n")
    assert runs == 1
