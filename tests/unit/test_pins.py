"""Session pins on memory, SQLite and PostgreSQL: the first turn binds, later turns and
retries get the same binding, a new default moves only new sessions, a binding lives ``ttl``
after its last turn, and bad input is refused."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from asgi_disconnect import SessionPins, connect

pytestmark = pytest.mark.anyio


async def test_a_session_keeps_its_first_provider_until_it_ends(backend_url: str) -> None:
    backend = connect(backend_url)
    await backend.open()
    try:
        pins = SessionPins(backend, ttl=60)
        old, new = f"s-{secrets.token_hex(4)}", f"s-{secrets.token_hex(4)}"
        assert await pins.provider_for(old, default="provider-a") == "provider-a"
        # The default flips: the running session stays, a new one takes the new default.
        assert await pins.provider_for(old, default="provider-b") == "provider-a"
        assert await pins.provider_for(new, default="provider-b") == "provider-b"
        assert await pins.provider_for(old, default="provider-b") == "provider-a"
        # Sessions are the caller's: another principal's session of the same id is its own.
        assert await pins.provider_for(old, default="provider-b", principal="bob") == "provider-b"
        # Concurrent first turns of one session (a client that retried at once) agree.
        fresh = f"s-{secrets.token_hex(4)}"
        answers = await asyncio.gather(
            *(pins.provider_for(fresh, default=f"provider-{i}") for i in range(8))
        )
        assert len(set(answers)) == 1
        # The session ends: its next turn binds afresh, to the default of that moment.
        assert await pins.end(old) is True
        assert await pins.end(old) is False
        assert await pins.provider_for(old, default="provider-b") == "provider-b"
    finally:
        await backend.aclose()


async def test_a_binding_lives_ttl_after_its_last_turn(backend_url: str) -> None:
    backend = connect(backend_url)
    await backend.open()
    try:
        # Turns a third of the ttl apart: a slow store round trip (a busy machine) leaves
        # room before the binding would lapse.
        pins = SessionPins(backend, ttl=1.2)
        session = f"s-{secrets.token_hex(4)}"
        assert await pins.provider_for(session, default="a") == "a"
        for _ in range(4):  # turns keep it alive past its first ttl
            await asyncio.sleep(0.4)
            assert await pins.provider_for(session, default="b") == "a"
        await asyncio.sleep(1.6)  # idle past the ttl: the next turn binds afresh
        assert await pins.provider_for(session, default="b") == "b"
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("session", "default"), [("", "a"), ("s", ""), ("x" * 256, "a"), (None, "a"), ("s", 3)]
)
async def test_bad_input_is_refused(session: object, default: object) -> None:
    pins = SessionPins(connect("memory://"))
    with pytest.raises(ValueError, match="must be a non-empty string"):
        await pins.provider_for(session, default=default)  # type: ignore[arg-type]


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), float("nan")])
def test_a_bad_ttl_is_refused(ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl"):
        SessionPins(connect("memory://"), ttl=ttl)


async def test_the_memory_backend_keeps_its_pins_within_bounds() -> None:
    from asgi_disconnect import MemoryBackend

    backend = MemoryBackend(max_pins=3)
    pins = SessionPins(backend, ttl=60)
    for i in range(5):
        await pins.provider_for(f"s{i}", default="a")
    # Past the bound the binding closest to its expiry goes first (a memory backend is for
    # one process and tests; a durable one keeps every live binding).
    assert await pins.provider_for("s4", default="b") == "a"
    assert await pins.provider_for("s0", default="b") == "b"  # in place of s2, oldest now
    # Three are kept, no more: ending a session tells whether its binding was there.
    assert [await pins.end(f"s{i}") for i in range(5)] == [True, False, False, True, True]


class CountingPool:
    """The store's pool, counting the statements that touch the pins table."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.statements: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.pool, name)
        if name not in ("execute", "fetch", "fetchrow", "fetchval"):
            return attribute

        def counted(sql: str, *args: Any, **kwargs: Any) -> Any:
            if "pins" in sql:
                self.statements.append(sql.split()[0])
            return attribute(sql, *args, **kwargs)

        return counted


@pytest.mark.postgres
async def test_a_pin_is_one_statement_on_postgresql(postgres_dsn: str, postgres_url: str) -> None:
    import asyncpg

    (schema,) = parse_qs(urlsplit(postgres_url).query)["schema"]
    counting = CountingPool(await asyncpg.create_pool(postgres_dsn, min_size=1, max_size=2))
    # Your own pool, as an application that already has one passes it.
    backend = connect("postgresql://", pool=counting, schema=schema)  # type: ignore[arg-type]
    try:
        await backend.open()
        pins = SessionPins(backend)
        await pins.provider_for("s1", default="a")  # a first turn
        await pins.provider_for("s1", default="b")  # a later one
        assert counting.statements == ["insert", "insert"]
    finally:
        await backend.aclose()
        await counting.pool.close()
