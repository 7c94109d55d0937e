"""Every way a backend can fail to open is one exception that says why and what to do."""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import asyncpg
import pytest

from asgi_disconnect import BackendUnavailable, connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._backends._postgres import PostgresStore, mask_url
from asgi_disconnect._errors import AsgiDisconnectError

pytestmark = pytest.mark.anyio


async def open_error(url: str, **options: object) -> BackendUnavailable:
    backend = connect(url, **options)  # type: ignore[arg-type]
    with anyio.fail_after(10), pytest.raises(BackendUnavailable) as caught:
        await backend.open()
    return caught.value


def test_backend_unavailable_is_the_package_error_not_an_os_error() -> None:
    # Code that catches OSError around a send must not swallow a store that is down.
    assert issubclass(BackendUnavailable, AsgiDisconnectError)
    assert not issubclass(BackendUnavailable, OSError)
    with pytest.raises(AsgiDisconnectError):
        raise BackendUnavailable("down")


# -- PostgreSQL -----------------------------------------------------------------------


async def test_postgres_refused_fails_at_once_naming_the_address() -> None:
    started = time.monotonic()
    error = await open_error("postgresql://postgres@127.0.0.1:1/test")
    assert time.monotonic() - started < 1.0
    assert str(error) == (
        "cannot connect to postgresql://postgres@127.0.0.1:1/test: connection refused: "
        "nothing listens at 127.0.0.1:1; start PostgreSQL or fix the URL"
    )
    assert isinstance(error.__cause__, ConnectionRefusedError)


@pytest.fixture
async def silent_server() -> AsyncIterator[int]:
    """A port that accepts connections and never answers, like a host behind a black hole."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("where", ["keyword", "query"])
async def test_postgres_that_never_answers_fails_after_connect_timeout(
    silent_server: int, where: str
) -> None:
    url = f"postgresql://postgres@127.0.0.1:{silent_server}/test"
    if where == "keyword":
        options: dict[str, object] = {"connect_timeout": 0.3}
    else:
        url += "?connect_timeout=0.3"
        options = {}
    started = time.monotonic()
    error = await open_error(url, **options)
    assert 0.3 <= time.monotonic() - started < 2.0
    assert str(error) == (
        f"cannot connect to {url}: no answer from 127.0.0.1:{silent_server} within 0.3 s; "
        "check the host, the port and any firewall between, or give connect_timeout= more time"
    )
    assert isinstance(error.__cause__, TimeoutError)


def test_postgres_connect_timeout_defaults_to_five_seconds() -> None:
    backend = connect("postgresql://postgres@127.0.0.1/test")
    assert isinstance(backend, DurableBackend)
    assert isinstance(backend.store, PostgresStore)
    assert backend.store.connect_timeout == 5.0


def with_part(dsn: str, **parts: str) -> str:
    split = urlsplit(dsn)
    user = parts.get("user", split.username or "")
    database = parts.get("database", split.path.lstrip("/"))
    return (
        split._replace(netloc=f"{user}@{split.hostname}:{split.port or 5432}")
        ._replace(path="/" + database)
        .geturl()
    )


async def test_postgres_unknown_role(postgres_dsn: str) -> None:
    role = "no_role_" + secrets.token_hex(4)
    url = with_part(postgres_dsn, user=role)
    error = await open_error(url)
    assert str(error) == (
        f'cannot connect to {url}: role "{role}" does not exist; fix the user name in the URL, '
        f"or create the role (CREATE ROLE {role} LOGIN) and let it connect in pg_hba.conf"
    )
    assert isinstance(error.__cause__, asyncpg.InvalidAuthorizationSpecificationError)


async def test_postgres_unknown_database(postgres_dsn: str) -> None:
    database = "no_db_" + secrets.token_hex(4)
    url = with_part(postgres_dsn, database=database)
    error = await open_error(url)
    assert str(error) == (
        f'cannot connect to {url}: database "{database}" does not exist; fix the database name '
        f"in the URL, or create it (CREATE DATABASE {database})"
    )
    assert isinstance(error.__cause__, asyncpg.InvalidCatalogNameError)


async def test_postgres_password_is_masked_in_the_message() -> None:
    error = await open_error("postgresql://app:s3cret@127.0.0.1:1/db?password=other&schema=x")
    assert "cannot connect to postgresql://app:***@127.0.0.1:1/db?password=***&schema=x" in str(
        error
    )
    assert "s3cret" not in str(error)
    assert "other" not in str(error)


def test_mask_url() -> None:
    assert mask_url("postgresql://u:p@h:5/d") == "postgresql://u:***@h:5/d"
    assert mask_url("postgresql://u@h/d") == "postgresql://u@h/d"
    assert mask_url("postgresql://u:p/x@y@h/d?a=1") == "postgresql://u:***@h/d?a=1"
    assert mask_url("postgresql://h/d?password=p&user=u") == "postgresql://h/d?password=***&user=u"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://u:p@ss@h/d", "percent-encode '@'"),
        ("postgresql://h:99999/d", "port must be a number in 1-65535"),
        ("postgresql://h:0/d", "port must be a number in 1-65535"),
        ("postgresql://h/d?connect_timeout=soon", "connect_timeout must be a number of seconds"),
        ("postgresql://h/d?connect_timeout=0", "connect_timeout must be positive"),
    ],
)
def test_malformed_postgres_urls_fail_before_connecting(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        connect(url)
    assert "ss@" not in str(caught.value)


def test_without_asyncpg_the_package_imports_and_open_says_what_to_install() -> None:
    # A fresh interpreter in which asyncpg cannot be imported, as if it were not installed.
    script = textwrap.dedent(
        """
        import asyncio, sys
        sys.modules["asyncpg"] = None
        import asgi_disconnect
        backend = asgi_disconnect.connect("postgresql://app:pw@127.0.0.1:5432/db")
        try:
            asyncio.run(backend.open())
        except asgi_disconnect.BackendUnavailable as exc:
            print(type(exc.__cause__).__name__)
            print(exc)
        """
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "ModuleNotFoundError",
        "cannot connect to postgresql://app:***@127.0.0.1:5432/db: the PostgreSQL backend "
        "needs asyncpg, which is not installed; pip install 'asgi-disconnect[postgres]'",
    ]


# -- SQLite ---------------------------------------------------------------------------


async def test_sqlite_missing_directory() -> None:
    error = await open_error("sqlite:////nonexistent/dir/x.db")
    assert str(error) == (
        "cannot open sqlite:////nonexistent/dir/x.db: the directory /nonexistent/dir "
        "does not exist; create it or fix the path in the URL"
    )
    assert isinstance(error.__cause__, sqlite3.OperationalError)


async def test_sqlite_path_that_is_a_directory(tmp_path: Path) -> None:
    error = await open_error(f"sqlite:///{tmp_path}")
    assert str(error) == (
        f"cannot open sqlite:///{tmp_path}: {tmp_path} is a directory, not a database file; "
        f"name a file in it, such as 'sqlite:///{tmp_path}/generations.db'"
    )
    assert isinstance(error.__cause__, sqlite3.OperationalError)


async def test_sqlite_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are notes, not a database\n" * 8)
    error = await open_error(f"sqlite:///{path}")
    assert str(error) == (
        f"cannot open sqlite:///{path}: {path} is not a SQLite database (file is not a "
        "database); point the URL at a new file or at a database this package created"
    )
    assert isinstance(error.__cause__, sqlite3.DatabaseError)


async def test_sqlite_path_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("")
    error = await open_error(f"sqlite:///{tmp_path}/plain/x.db")
    assert f"{tmp_path}/plain is not a directory; fix the path in the URL" in str(error)


async def test_open_can_be_retried_once_the_cause_is_fixed(tmp_path: Path) -> None:
    directory = tmp_path / "data"
    backend = connect(f"sqlite:///{directory}/generations.db")
    with pytest.raises(BackendUnavailable, match="does not exist; create it"):
        await backend.open()
    directory.mkdir()
    await backend.open()
    await backend.aclose()


async def test_sqlite_init_is_given_the_connection_before_the_schema(sqlite_url: str) -> None:
    ran: list[str] = []
    backend = connect(sqlite_url, init=lambda db: db.set_trace_callback(ran.append))
    await backend.open()
    try:
        # Its trace sees the schema made, then what the store runs afterwards.
        assert any("create table if not exists asgi_disconnect_generations" in s for s in ran)
        assert not any(s.startswith("pragma journal_mode") for s in ran)
        ran.clear()
        assert await backend.get("gen_" + "N" * 24) is None
        assert any("from asgi_disconnect_generations" in s for s in ran)
    finally:
        await backend.aclose()


async def test_an_init_that_raises_fails_the_open_with_its_reason(sqlite_url: str) -> None:
    def broken(db: sqlite3.Connection) -> None:
        db.execute("pragma no_such_thing_is_fine")
        raise RuntimeError("my pragma went wrong")

    backend = connect(sqlite_url, init=broken)
    with pytest.raises(BackendUnavailable, match=r"init= raised RuntimeError\('my pragma"):
        await backend.open()
    # Nothing was left open or half made: the same file opens with a working init.
    again = connect(sqlite_url, init=lambda db: db.execute("pragma cache_size = -512"))
    await again.open()
    try:
        assert await again.get("gen_" + "N" * 24) is None
    finally:
        await again.aclose()


@pytest.mark.parametrize("url", ["memory://", "postgresql://u@h/db"])
def test_init_is_for_sqlite(url: str) -> None:
    with pytest.raises(ValueError, match=r"init= is for SQLite URLs.*pool= an asyncpg pool"):
        connect(url, init=lambda db: None)
