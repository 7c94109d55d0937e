from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
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


# The modules that drive the client writer in every shape: on Python 3.12+ each of their
# tests runs twice, with sends started eagerly in tasks of their own and with the writer
# task sending everything (3.11's only way), to show the fast path behaves as the plain one.
SEND_MODULES = {
    "tests.unit.test_contract",
    "tests.unit.test_disconnect",
    "tests.unit.test_framework_compat",
    "tests.unit.test_inline",
    "tests.unit.test_keep_alive",
    "tests.unit.test_reliability",
    "tests.unit.test_stop",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if (
        "sends" in metafunc.fixturenames
        and metafunc.module.__name__ in SEND_MODULES
        and sys.version_info >= (3, 12)
    ):
        metafunc.parametrize("sends", ["eager", "writer"], indirect=True)


@pytest.fixture(autouse=True)
def sends(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the client writer starts sends in this test: ``eager`` (3.12+) or ``writer``."""
    from asgi_disconnect import _writer

    mode = getattr(request, "param", "eager" if _writer.EAGER_SENDS else "writer")
    monkeypatch.setattr(_writer, "EAGER_SENDS", mode == "eager")
    return str(mode)


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
