"""Serving the fault app in a process of its own, and reading what happened."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import asyncpg
import httpx

from tests.integration.processes import ROOT, free_port

APP = "tests.faults.app:app"


@contextlib.contextmanager
def serve(env: dict[str, str], log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """uvicorn serving the fault app with ``env``; its stderr (our log lines) goes to ``log``."""
    port = free_port()
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                APP,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
                "--timeout-graceful-shutdown",
                "5",
            ],
            cwd=ROOT,
            env={**os.environ, **env},
            stderr=err,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}"
                )
            try:
                httpx.get(url + "/", timeout=0.5)
                break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def runs(path: Path) -> tuple[Counter[str], Counter[str]]:
    """How many times each key's handler started, and ended."""
    started: Counter[str] = Counter()
    ended: Counter[str] = Counter()
    if path.exists():
        for line in path.read_text().splitlines():
            event, key, _ = line.split()
            (started if event == "start" else ended)[key] += 1
    return started, ended


def headers(key: str) -> dict[str, str]:
    return {"authorization": "Bearer alice", "idempotency-key": key}


async def claim_rows(url: str) -> list[asyncpg.Record]:
    """Every claim row of the schema in ``url``: key, status, seconds left on the lease."""
    parts = urlsplit(url)
    schema = parse_qs(parts.query)["schema"][0]
    conn = await asyncpg.connect(parts._replace(query="").geturl(), timeout=5)
    try:
        return await conn.fetch(
            f"select key, status, extract(epoch from lease_until - now())::float8 as left "
            f'from "{schema}".asgi_disconnect_claims order by key'
        )
    finally:
        await conn.close()
