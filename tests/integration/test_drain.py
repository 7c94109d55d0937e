"""A rolling restart on real servers: SIGTERM while 20 streams are in flight.

uvicorn and hypercorn (``--workers 0``, the process that gets the signal serves) run the
gateway in a process of their own, relaying FakeProvider. The server drains, then exits: no
client sees a stream end without its terminal marker or an ``interrupted`` error frame
(``stopped_by: drain``); new requests meanwhile get 503 with ``Retry-After``; detached
generations are ``complete`` or ``interrupted`` with the prefix they produced, never lost
(read back from SQLite after the process is gone).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from asgi_disconnect import connect
from asgi_disconnect.testing import FakeProvider, request

from .processes import ROOT, free_port

pytestmark = [pytest.mark.anyio, pytest.mark.server]

DEADLINE = 2.0


@contextlib.contextmanager
def server_process(server: str, env: dict[str, str], log: Path) -> Iterator[tuple[str, Any]]:
    port = free_port()
    if server == "uvicorn":
        argv = ["-m", "uvicorn", "tests.integration.drain_app:app", "--port", str(port)]
        argv += ["--host", "127.0.0.1", "--timeout-graceful-shutdown", "10"]
    else:
        argv = ["-m", "hypercorn", "tests.integration.drain_app:app"]
        argv += ["--bind", f"127.0.0.1:{port}", "--workers", "0", "--graceful-timeout", "10"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, *argv], cwd=ROOT, env={**os.environ, **env}, stdout=out, stderr=out
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited: {log.read_text()}")
                with contextlib.suppress(OSError, httpx.HTTPError):
                    httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=0.5)
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: {log.read_text()}")
                time.sleep(0.05)
            yield f"http://127.0.0.1:{port}", proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def error_frames(body: bytes) -> list[dict[str, Any]]:
    return [
        msgspec.json.decode(block.split(b"data: ", 1)[1])["error"]
        for block in body.split(b"\n\n")
        if block.startswith(b"event: error\n")
    ]


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
async def test_a_rolling_restart_cuts_no_stream(server: str, tmp_path: Path) -> None:
    db = tmp_path / "generations.db"
    with FakeProvider(tokens_per_second=40) as provider:
        env = {
            "DRAIN_UPSTREAM": provider.url,
            "DRAIN_DB": str(db),
            "DRAIN_DEADLINE": str(DEADLINE),
        }
        with server_process(server, env, tmp_path / "server.log") as (url, proc):
            # 20 streams: short ones end before the deadline, long ones outlast it; of the
            # detach ones, half lose their client at once and go on detached.
            plan = [
                ("/chat", 30, None), ("/chat", 400, None),
                ("/report", 30, None), ("/report", 400, None),
                ("/report", 30, 200), ("/report", 400, 200),
            ]  # fmt: skip
            plan = [plan[i % len(plan)] for i in range(20)]
            clients = [
                asyncio.create_task(
                    request(
                        f"{url}{path}?tokens={tokens}",
                        method="POST",
                        disconnect_after_bytes=leave,
                        timeout=30,
                    )
                )
                for path, tokens, leave in plan
            ]
            await provider.await_requests(20, timeout=15)
            await asyncio.sleep(0.3)  # every stream has begun
            drain_started = time.monotonic()
            proc.send_signal(signal.SIGTERM)

            async with httpx.AsyncClient(base_url=url, timeout=5) as client:
                await asyncio.sleep(0.3)
                refused = await client.post("/chat?tokens=5")
                ready = await client.get("/readyz")
            assert refused.status_code == 503
            assert refused.headers["retry-after"] == "3"
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.json()["type"] == "urn:asgi-disconnect:problem:draining"
            assert ready.status_code == 503

            results = await asyncio.gather(*clients)
            exit_code = await asyncio.to_thread(proc.wait, 30)
            drained_in = time.monotonic() - drain_started
        log = (tmp_path / "server.log").read_text()
    assert exit_code in (0, -signal.SIGTERM), log
    assert drained_in < DEADLINE + 8, log

    generation_ids = []
    for (path, tokens, leave), result in zip(plan, results, strict=True):
        generation_id = result.headers["x-generation-id"]
        generation_ids.append(generation_id)
        if leave is not None:
            continue  # this client left on purpose; its generation is checked below
        frames = error_frames(result.body)
        if result.body.endswith(b"data: [DONE]\n\n"):
            assert frames == [], (path, tokens)
            assert tokens == 30, "a long stream cannot have finished before the deadline"
        else:
            assert [frame["type"] for frame in frames] == ["interrupted"], result.body[-300:]
            assert frames[0]["retry_after"] == 3
            assert tokens == 400

    backend = connect(f"sqlite:///{db}")
    await backend.open()
    try:
        for (path, tokens, leave), generation_id in zip(plan, generation_ids, strict=True):
            info = await backend.get(generation_id)
            assert info is not None, "a generation was lost"
            if tokens == 30:
                assert info.status == "complete", (path, leave, info)
            else:
                assert info.status == "interrupted", (path, leave, info)
                assert info.size > 0  # the prefix it produced
            if leave is not None:
                assert info.detached
    finally:
        await backend.aclose()
