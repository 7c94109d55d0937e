"""A store that cannot be opened stops a real server at startup, loudly, before it serves.

uvicorn runs with its default settings (``--lifespan auto``): if the middleware's startup
failure looked like an app without lifespan support, uvicorn would log "ASGI 'lifespan'
protocol appears unsupported." and serve requests against a store that is not there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.processes import ROOT, free_port

pytestmark = pytest.mark.server

STARTUP_DEADLINE = 15.0
UNSUPPORTED = "lifespan' protocol appears unsupported"
APP = "tests.integration.startup_app"


@dataclass(frozen=True)
class Failure:
    url: Callable[[str], str]
    """The backend URL, given the test database's DSN."""
    says: Callable[[str], str]
    """What ``BackendUnavailable`` says, given the URL."""
    postgres: bool = False
    """Needs the PostgreSQL test server."""
    hide_asyncpg: bool = False
    """Run the server as if asyncpg were not installed."""


def _unknown_database(dsn: str) -> str:
    return f"{dsn.rsplit('/', 1)[0]}/asgi_disconnect_missing_{secrets.token_hex(4)}"


FAILURES = {
    "refused": Failure(
        url=lambda dsn: "postgresql://postgres@127.0.0.1:1/x",
        says=lambda url: "nothing listens at 127.0.0.1:1; start PostgreSQL or fix the URL",
    ),
    "no-asyncpg": Failure(
        url=lambda dsn: dsn,
        says=lambda url: (
            "needs asyncpg, which is not installed; pip install 'asgi-disconnect[postgres]'"
        ),
        postgres=True,
        hide_asyncpg=True,
    ),
    "sqlite-no-directory": Failure(
        url=lambda dsn: "sqlite:////nonexistent/dir/x.db",
        says=lambda url: "the directory /nonexistent/dir does not exist",
    ),
    "unknown-database": Failure(
        url=_unknown_database,
        says=lambda url: f'database "{url.rsplit("/", 1)[1]}" does not exist',
        postgres=True,
    ),
}


def probe(port: int) -> int | None:
    """The status of ``GET /`` on the port, or None if nothing answers at once."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.settimeout(0.5)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            head = sock.recv(64)
    except OSError:
        return None
    parts = head.split(b" ", 2)
    return int(parts[1]) if head.startswith(b"HTTP/") and len(parts) > 1 else None


def run_until_exit(
    argv: list[str], env: dict[str, str], port: int
) -> tuple[int | None, str, list[int]]:
    """Run the server; (exit status or None if it ran past the deadline, output, answers)."""
    answers: list[int] = []
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + STARTUP_DEADLINE
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                status = probe(port)
                if status is not None:
                    answers.append(status)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(0.05)
        finally:
            returncode = proc.poll()
            if returncode is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        return returncode, out.read().decode("utf-8", "replace"), answers


def environment(failure: Failure, url: str, tmp_path: Path) -> dict[str, str]:
    env = {"ASGI_DISCONNECT_URL": url}
    if failure.hide_asyncpg:
        # `import asyncpg` raises ImportError in the server, as when it is not installed.
        hide = tmp_path / "no_asyncpg"
        hide.mkdir()
        (hide / "sitecustomize.py").write_text('import sys\nsys.modules["asyncpg"] = None\n')
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), os.environ.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("app", ["alone", "installed", "idempotent"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(name, marks=[pytest.mark.postgres] if failure.postgres else [])
        for name, failure in FAILURES.items()
    ],
)
def test_uvicorn_exits_at_startup_and_says_why(
    case: str, app: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    failure = FAILURES[case]
    dsn = "postgresql://postgres@127.0.0.1:5432/test"  # unused by the cases without PostgreSQL
    if failure.postgres:
        dsn = str(request.getfixturevalue("postgres_dsn"))
    url = failure.url(dsn)
    port = free_port()
    returncode, output, answers = run_until_exit(
        [sys.executable, "-m", "uvicorn", f"{APP}:{app}", "--port", str(port)],
        environment(failure, url, tmp_path),
        port,
    )
    assert returncode is not None, f"still running after {STARTUP_DEADLINE} s:\n{output}"
    assert returncode != 0, output
    assert failure.says(url) in output, output
    assert f"cannot {'open' if url.startswith('sqlite') else 'connect to'} {url}" in output, output
    assert "Application startup failed. Exiting." in output, output
    assert UNSUPPORTED not in output, output
    assert 200 not in answers, f"served while its store was unavailable: {answers}\n{output}"


@pytest.mark.parametrize("app", ["alone", "installed", "idempotent"])
def test_uvicorn_serves_when_the_store_opens(app: str, tmp_path: Path) -> None:
    """The probe above would see a server that starts: this one answers 200."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", f"{APP}:{app}", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "ASGI_DISCONNECT_URL": f"sqlite:///{tmp_path / 'app.db'}"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + STARTUP_DEADLINE
        while (status := probe(port)) is None and proc.poll() is None:
            assert time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)
        assert status == 200
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.parametrize(
    "workers",
    [
        # hypercorn 0.18's run() records a failed worker's status, then joins the emptied
        # worker list again and returns 0: with its default of one worker, only the exit counts.
        pytest.param([], id="default"),
        pytest.param(["--workers", "0"], id="in-process"),
    ],
)
def test_hypercorn_exits_at_startup_and_says_why(workers: list[str]) -> None:
    url = "postgresql://postgres@127.0.0.1:1/x"
    port = free_port()
    returncode, output, answers = run_until_exit(
        [
            sys.executable,
            "-m",
            "hypercorn",
            f"{APP}:idempotent",
            "--bind",
            f"127.0.0.1:{port}",
            *workers,
        ],
        {"ASGI_DISCONNECT_URL": url},
        port,
    )
    assert returncode is not None, f"still running after {STARTUP_DEADLINE} s:\n{output}"
    if workers:
        assert returncode != 0, output
    assert "LifespanFailureError: Lifespan failure in startup" in output, output
    assert f"cannot connect to {url}: connection refused: nothing listens at" in output, output
    assert "continuing without Lifespan support" not in output, output
    assert 200 not in answers, f"served while its store was unavailable: {answers}\n{output}"
