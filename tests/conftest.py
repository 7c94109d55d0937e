from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asgi_disconnect.testing import FakeProvider


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def provider(request: pytest.FixtureRequest) -> Iterator[FakeProvider]:
    """A FakeProvider on a loopback port of its own: 8 tokens at once, unless the test or
    its module says otherwise with ``@pytest.mark.provider(tokens=..., tokens_per_second=...)``."""
    marker = request.node.get_closest_marker("provider")
    options: dict[str, Any] = {"tokens": 8, "tokens_per_second": 0}
    if marker is not None:
        options.update(marker.kwargs)
    with FakeProvider(**options) as fake:
        yield fake


@pytest.fixture(autouse=True)
def _quiet_memory_backend_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asgi_disconnect")


def _postgres_dsn() -> str:
    return os.environ.get("ASGI_DISCONNECT_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


def _postgres_reachable(dsn: str) -> str | None:
    import asyncpg

    async def probe() -> None:
        conn = await asyncpg.connect(dsn, timeout=5)
        await conn.close()

    try:
        asyncio.run(probe())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """The test database; a missing PostgreSQL fails under CI=true and skips elsewhere."""
    dsn = _postgres_dsn()
    problem = _postgres_reachable(dsn)
    if problem is not None:
        message = f"PostgreSQL at {dsn} is unreachable ({problem})"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return dsn


@pytest.fixture
def postgres_url(postgres_dsn: str) -> Iterator[str]:
    """A URL with a schema of this test's own, dropped afterwards."""
    import asyncpg

    schema = "t_" + secrets.token_hex(6)
    yield f"{postgres_dsn}?schema={schema}"

    async def drop() -> None:
        conn = await asyncpg.connect(postgres_dsn, timeout=10)
        try:
            # A connection a failed test left behind must not hang the whole run.
            await conn.execute("set lock_timeout = '10s'")
            await conn.execute(f'drop schema if exists "{schema}" cascade')
        except asyncpg.LockNotAvailableError:
            logging.getLogger("tests").warning("schema %s is still locked; left behind", schema)
        finally:
            await conn.close()

    asyncio.run(drop())


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'generations.db'}"


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def backend_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("postgres_url"))
