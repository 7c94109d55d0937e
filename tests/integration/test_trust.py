"""Trust boundaries, as an attacker tries them: through ``install()`` (idempotency, drain) on
a real uvicorn, over sockets.

- who a caller is: every credential header, in any order; the app's own identity through
  ``principal=`` (Starlette's ``AuthenticationMiddleware``); anonymous generations;
- who may drain: a token by default, loopback only when asked, a forwarded address never;
- what a resume token reveals: one answer for every token that does not verify;
- the demo's usage records, scoped to their caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.authentication import (
    AuthCredentials,
    AuthenticationBackend,
    AuthenticationError,
    SimpleUser,
)
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import (
    DisconnectMiddleware,
    connect,
    default_principal,
    disconnect_policy,
    install,
)
from asgi_disconnect.testing import run_server

pytestmark = pytest.mark.anyio

PROBLEM = "urn:asgi-disconnect:problem:"
EVENTS = b"".join(b'data: {"n": %d}\n\n' % n for n in range(5)) + b"data: [DONE]\n\n"


async def _events(pause: float = 0.0) -> AsyncIterator[bytes]:
    for line in EVENTS.split(b"\n\n")[:-1]:
        yield line + b"\n\n"
        await asyncio.sleep(pause)


def gateway(db: Path, **options: Any) -> Starlette:
    async def chat(request: Request) -> StreamingResponse:
        pause = float(request.query_params.get("pause", "0"))
        return StreamingResponse(_events(pause), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/chat", disconnect_policy("detach")(chat), methods=["POST"])])
    options.setdefault("drain", {"signals": False, "drain_token": "op"})
    install(app, backend=connect(f"sqlite:///{db}"), idempotency=True, **options)
    return app


@contextlib.contextmanager
def serving(app: Starlette, **server: Any) -> Iterator[httpx.Client]:
    with (
        run_server(app, server="uvicorn", **server) as running,
        httpx.Client(base_url=running.url, timeout=10) as client,
    ):
        yield client


def problem_type(response: httpx.Response) -> str:
    assert response.headers["content-type"] == "application/problem+json", response.text
    kind: str = response.json()["type"]
    return kind.removeprefix(PROBLEM)


def started(client: httpx.Client, headers: dict[str, str]) -> str:
    response = client.post("/v1/chat", headers=headers)
    assert response.status_code == 200
    assert response.content == EVENTS
    return response.headers["x-generation-id"]


# -- who a caller is ---------------------------------------------------------------------


async def test_every_credential_header_makes_the_caller_in_any_order(tmp_path: Path) -> None:
    """Two callers behind one proxy token, each with its own x-api-key, are two callers;
    the same caller with its headers in the other order is itself."""
    proxy = "Bearer proxy-token"
    alice = {"authorization": proxy, "x-api-key": "alice"}
    bob = {"authorization": proxy, "x-api-key": "bob"}
    with serving(gateway(tmp_path / "g.db")) as client:
        generation = started(client, alice)
        assert client.get(f"/generations/{generation}", headers=bob).status_code == 404
        # Other order, on the wire: httpx sends a list of pairs in its order.
        reordered = [("x-api-key", "alice"), ("authorization", proxy)]
        own = client.get(f"/generations/{generation}", headers=reordered)
        assert own.status_code == 200
        assert own.json()["status"] == "complete"
        # Stop and tokens follow the same identity.
        assert client.post(f"/generations/{generation}/token", headers=bob).status_code == 404
        assert client.post(f"/generations/{generation}/token", headers=reordered).status_code == 200


async def test_an_anonymous_generation_is_readable_by_a_token_holder_only(tmp_path: Path) -> None:
    app = gateway(tmp_path / "g.db")
    with serving(app) as client:
        generation = started(client, {})
        for path in (f"/generations/{generation}", f"/generations/{generation}/stream"):
            refused = client.get(path)  # another anonymous caller: nobody
            assert refused.status_code == 404
            assert problem_type(refused) == "generation-not-found"
        assert client.post(f"/generations/{generation}/token").status_code == 404
        assert client.post(f"/generations/{generation}/cancel").status_code == 404
        token = _disconnect_of(app).resume_token(generation)  # the app hands it out
        read = client.get(f"/generations/{generation}/stream", params={"token": token})
        assert read.status_code == 200
        assert read.content == EVENTS


def _disconnect_of(app: Starlette) -> DisconnectMiddleware:
    layer: Any = app.middleware_stack or app.build_middleware_stack()
    while not isinstance(layer, DisconnectMiddleware):
        layer = layer.app
    return layer


class TokenAuth(AuthenticationBackend):
    """The app's own auth: a session header names the user."""

    async def authenticate(self, conn: HTTPConnection) -> tuple[AuthCredentials, SimpleUser] | None:
        session = conn.headers.get("x-session")
        if session is None:
            return None
        if not session.startswith("user:"):
            raise AuthenticationError("bad session")
        return AuthCredentials(["authenticated"]), SimpleUser(session.removeprefix("user:"))


def user_principal(scope: Any) -> str | None:
    user = scope.get("user")
    return f"user:{user.username}" if user is not None and user.is_authenticated else None


async def test_the_apps_own_identity_scopes_generations_and_idempotency_keys(
    tmp_path: Path,
) -> None:
    """principal= from scope["user"] (AuthenticationMiddleware added after install(), so it
    runs first): two sessions with the same API key are two callers, for resume and for
    Idempotency-Key alike."""
    app = gateway(tmp_path / "g.db", principal=user_principal)
    app.add_middleware(AuthenticationMiddleware, backend=TokenAuth())
    key = {"authorization": "Bearer shared-key"}
    alice = {**key, "x-session": "user:alice"}
    bob = {**key, "x-session": "user:bob"}
    with serving(app) as client:
        generation = started(client, alice)
        assert client.get(f"/generations/{generation}", headers=bob).status_code == 404
        assert client.get(f"/generations/{generation}", headers=alice).status_code == 200
        # The same Idempotency-Key from two users is two keys: each runs.
        first = client.post("/v1/chat", headers={**alice, "idempotency-key": "k1"})
        other = client.post("/v1/chat", headers={**bob, "idempotency-key": "k1"})
        again = client.post("/v1/chat", headers={**alice, "idempotency-key": "k1"})
        assert "idempotent-replayed" not in other.headers
        assert again.headers.get("idempotent-replayed") == "true"
        assert first.headers["x-generation-id"] != other.headers["x-generation-id"]


async def test_a_rolling_deploy_keeps_single_credential_generations_their_owners(
    tmp_path: Path,
) -> None:
    """Generations written under the old digest (one header, ``name:value``) are their
    owner's still; a caller that sent two credential headers had the first one's digest,
    and its old generations are not found under the new one (docs/security.md)."""
    one = {"headers": [(b"authorization", b"Bearer A")]}
    old = hashlib.sha256(b"authorization:Bearer A").hexdigest()[:32]
    assert default_principal(one) == old
    db = tmp_path / "g.db"
    backend = connect(f"sqlite:///{db}")
    await backend.open()
    from asgi_disconnect._log import Generation
    from asgi_disconnect._records import Status

    both_old = hashlib.sha256(b"authorization:Bearer A").hexdigest()[:32]
    for generation_id, principal in (("gen_" + "O" * 24, old), ("gen_" + "T" * 24, both_old)):
        generation = Generation(generation_id, principal=principal)
        backend.register(generation)
        generation.append(b"data: old\n\n")
        generation.finish(Status.COMPLETE)
    await backend.aclose()
    with serving(gateway(db)) as client:
        mine = client.get(f"/generations/gen_{'O' * 24}", headers={"authorization": "Bearer A"})
        assert mine.status_code == 200
        two = {"authorization": "Bearer A", "x-api-key": "A2"}
        assert client.get(f"/generations/gen_{'T' * 24}", headers=two).status_code == 404


# -- who may drain ---------------------------------------------------------------------


async def test_drainz_needs_the_token_even_from_loopback(tmp_path: Path) -> None:
    with serving(gateway(tmp_path / "g.db")) as client:
        refused = client.post("/drainz")  # loopback, no token
        assert refused.status_code == 403
        assert problem_type(refused) == "drain-forbidden"
        assert client.get("/readyz").json() == {"status": "ready"}  # nothing revealed
        assert client.post("/v1/chat").status_code == 200  # not draining
        first = client.post(
            "/drainz", params={"deadline": "2"}, headers={"authorization": "Bearer op"}
        )
        assert first.status_code in (200, 202)
        second = client.post(
            "/drainz", params={"deadline": "60"}, headers={"authorization": "Bearer op"}
        )
        assert second.json()["deadline"] == 2.0


async def test_a_forwarded_loopback_address_never_drains(tmp_path: Path) -> None:
    """uvicorn --forwarded-allow-ips '*' makes X-Forwarded-For the scope's client; even with
    trust_loopback, a forwarded request is not loopback."""
    app = gateway(tmp_path / "g.db", drain={"signals": False, "trust_loopback": True})
    with serving(app, forwarded_allow_ips="*", proxy_headers=True) as client:
        spoofed = client.post("/drainz", headers={"x-forwarded-for": "127.0.0.1"})
        assert spoofed.status_code == 403
        assert client.post("/v1/chat").status_code == 200
        assert client.post("/drainz").status_code in (200, 202)  # the real loopback, trusted


# -- what a token reveals ----------------------------------------------------------------


async def test_a_token_that_does_not_verify_gets_one_answer_whatever_the_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with serving(gateway(tmp_path / "g.db")) as client:
        generation = started(client, {"authorization": "Bearer alice"})
        answers = []
        for generation_id, token in (
            (generation, "123.garbage"),  # another's id
            ("gen_" + "Z" * 24, "123.garbage"),  # an unknown id
            (generation, "9999999999.\u00e9\u00e9"),  # a MAC that is not ASCII
            (generation, "no-dot"),
            (generation, ""),
        ):
            response = client.get(f"/generations/{generation_id}/stream", params={"token": token})
            answers.append((response.status_code, response.json()))
        assert {status for status, _ in answers} == {401}
        bodies = {body["type"] for _, body in answers}
        assert bodies == {PROBLEM + "invalid-resume-token"}
        assert len({body["detail"] for _, body in answers}) == 1
    assert not [r for r in caplog.records if "generation store failed" in r.getMessage()]


async def test_a_token_in_the_query_string_stays_out_of_the_access_log(tmp_path: Path) -> None:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")  # uvicorn's: it does not propagate
    keep = Keep()
    with serving(gateway(tmp_path / "g.db"), access_log=True) as client:
        level = access.level
        access.setLevel(logging.INFO)
        access.addHandler(keep)
        try:
            generation = started(client, {"authorization": "Bearer alice"})
            token = client.post(
                f"/generations/{generation}/token", headers={"authorization": "Bearer alice"}
            ).json()["token"]
            read = client.get(f"/generations/{generation}/stream", params={"token": token})
            assert read.status_code == 200
        finally:
            access.removeHandler(keep)
            access.setLevel(level)
    assert any("/stream?token=[redacted]" in line for line in lines), lines
    assert not any(token in line for line in lines)


# -- the demo ---------------------------------------------------------------------------


async def test_the_demo_shows_a_usage_record_to_its_caller_only(tmp_path: Path) -> None:
    from asgi_disconnect.demo import make_app
    from asgi_disconnect.testing import FakeProvider

    body = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with FakeProvider(tokens=5, tokens_per_second=1000) as provider:
        app = make_app(upstream=provider.url, backend_url=f"sqlite:///{tmp_path / 'd.db'}")
        with serving(app) as client:
            alice = {"authorization": "Bearer alice"}
            answer = client.post("/v1/chat/completions", json=body, headers=alice)
            generation = answer.headers["x-generation-id"]
            for _ in range(100):
                own = client.get(f"/demo/usage/{generation}", headers=alice)
                if own.status_code == 200:
                    break
                await asyncio.sleep(0.05)
            assert own.status_code == 200
            assert own.json()["generation_id"] == generation
            for stranger in ({}, {"authorization": "Bearer mallory"}):
                refused = client.get(f"/demo/usage/{generation}", headers=stranger)
                assert refused.status_code == 404
                assert problem_type(refused) == "usage-not-settled"
