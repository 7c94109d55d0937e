"""The Idempotency-Key header under arbitrary bytes: a key, or a clear 400, nothing else.

``parse_key`` takes the raw header values and gives a key or raises ``ValueError``; through
``IdempotencyMiddleware`` (in-process) every header value either runs the request or gets a
400 ``application/problem+json`` whose ``type`` is one of two stable URIs.
"""

from __future__ import annotations

import asyncio

import msgspec
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_disconnect import IdempotencyMiddleware, MemoryBackend
from asgi_disconnect._idempotency import parse_key
from asgi_disconnect.testing import drive
from tests.fuzz._settings import fuzz

PRINTABLE = "".join(chr(c) for c in range(0x20, 0x7F))
TOKEN_CHARS = "".join(c for c in PRINTABLE if c not in ' ",')
PROBLEM = "urn:asgi-disconnect:problem:"
REFUSALS = {
    PROBLEM + "idempotency-key-malformed": 1,
    PROBLEM + "idempotency-key-duplicated": 2,
}

# Bytes near the grammar's edges: quotes, escapes, separators, whitespace, controls, UTF-8.
PIECES = [b'"', b"\\", b"\\\\", b'\\"', b",", b";", b"=", b" ", b"\t", b"\r", b"\n", b"\x00"]
PIECES += [b"\x7f", b"\xc3\xa9", b"\xff", b"a", b"Z", b"9", b"-", b"_", b":", b"~", b"!"]
raw_values = st.one_of(
    st.binary(max_size=300),
    st.lists(st.sampled_from(PIECES), max_size=40).map(b"".join),
    st.text(PRINTABLE, min_size=250, max_size=262).map(str.encode),
    st.text(PRINTABLE, max_size=60).map(lambda s: b'"' + s.encode() + b'"'),
)


def sf_string(key: str) -> bytes:
    return b'"' + key.replace("\\", "\\\\").replace('"', '\\"').encode() + b'"'


@fuzz(500)
@given(values=st.lists(raw_values, max_size=3))
def test_any_header_values_give_a_key_or_value_error(values: list[bytes]) -> None:
    try:
        key = parse_key(values)
    except ValueError:
        return
    assert len(values) == 1
    assert 1 <= len(key) <= 255
    assert all(char in PRINTABLE for char in key)


@fuzz(300)
@given(
    key=st.text(PRINTABLE, min_size=1, max_size=255),
    before=st.text(" \t", max_size=3),
    after=st.text(" \t", max_size=3),
)
def test_any_printable_key_round_trips_as_a_quoted_string(
    key: str, before: str, after: str
) -> None:
    assert parse_key([before.encode() + sf_string(key) + after.encode()]) == key


@fuzz(300)
@given(key=st.text(TOKEN_CHARS, min_size=1, max_size=255).filter(lambda k: k[0] != '"'))
def test_any_bare_token_is_its_own_key(key: str) -> None:
    assert parse_key([key.encode()]) == key


def app(calls: list[str]) -> Starlette:
    async def charge(request: Request) -> JSONResponse:
        calls.append(request.headers.get("idempotency-key", ""))
        return JSONResponse({"charged": (await request.body()).decode()}, status_code=201)

    return Starlette(routes=[Route("/charge", charge, methods=["POST"])])


@fuzz(200)
@given(values=st.lists(raw_values, max_size=3))
def test_the_middleware_runs_the_request_or_answers_a_stable_400(values: list[bytes]) -> None:
    calls: list[str] = []
    middleware = IdempotencyMiddleware(app(calls), backend=MemoryBackend())
    headers = [("authorization", "Bearer alice")]
    headers += [("idempotency-key", value.decode("latin-1")) for value in values]

    result = asyncio.run(drive(middleware, method="POST", path="/charge", headers=headers))

    try:
        parse_key(values)
    except ValueError:
        valid = not values  # no header at all: the route does not require one
    else:
        valid = True
    assert result.complete
    if valid:
        assert result.status == 201, result.body
        assert len(calls) == 1
        return
    assert calls == []
    assert result.status == 400
    assert result.header("content-type") == "application/problem+json"
    problem = msgspec.json.decode(result.body)
    assert problem["status"] == 400
    assert problem["type"] in REFUSALS
    assert (REFUSALS[problem["type"]] == 2) == (len(values) > 1)
    assert problem["detail"]
