"""The benchmark apps' server: one uvicorn process per app, started the same way everywhere."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def uvicorn_command(app: str, port: int, *, factory: bool = False, host: str = HOST) -> list[str]:
    """uvicorn with h11 and the asyncio loop, one worker, quiet: the reference server."""
    return [
        sys.executable,
        "-m",
        "uvicorn",
        app,
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
        "--loop",
        "asyncio",
        "--http",
        "h11",
        *(["--factory"] if factory else []),
    ]


def wait_until_listening(
    port: int,
    timeout: float,
    what: str,
    *,
    host: str = HOST,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Until ``port`` accepts; a ``proc`` that exits first is an error at once."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.1):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it listened")
        time.sleep(0.02)
    raise RuntimeError(f"{what} did not start within {timeout:.0f}s")
