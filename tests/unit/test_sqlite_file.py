"""A SQLite file deleted or replaced under a running process is noticed and said loudly."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
from pathlib import Path

import pytest

from asgi_disconnect import BackendUnavailable, connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._log import Generation, Status

pytestmark = pytest.mark.anyio

GID = "gen_" + "D" * 24


async def unhealthy(backend: DurableBackend) -> None:
    async with asyncio.timeout(10):
        while backend.healthy:
            await asyncio.sleep(0.01)


def replace_with_another_database(path: Path) -> None:
    other = path.with_name("other.db")
    sqlite3.connect(other).close()
    os.replace(other, path)


@pytest.mark.parametrize(
    ("change", "said"),
    [(os.remove, "was deleted"), (replace_with_another_database, "was replaced by another file")],
)
async def test_a_lost_database_file_is_noticed_and_nothing_produced_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: object, said: str
) -> None:
    path = tmp_path / "generations.db"
    backend = connect(f"sqlite:///{path}", flush_interval=0.02)
    assert isinstance(backend, DurableBackend)
    await backend.open()
    try:
        assert backend.healthy
        generation = Generation(GID, principal="alice", content_type="text/event-stream")
        backend.register(generation)
        generation.append(b"data: before\n\n")
        while await backend.flush():
            pass
        change(path)  # type: ignore[operator]
        generation.append(b"data: after\n\n")
        await unhealthy(backend)
        assert backend.failure is not None
        assert f"{path} {said}" in backend.failure
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert any(f"{path} {said}" in r.getMessage() for r in errors)
        # New durable writes fail, saying why.
        with pytest.raises(BackendUnavailable, match=said):
            await backend.claim("alice", "k", b"fp", owner="o", lease=10, ttl=60)
        with pytest.raises(BackendUnavailable, match=said):
            await backend.flush()
        # What was produced is still served, from memory, to the end.
        generation.append(b"data: end\n\n")
        generation.finish(Status.COMPLETE)
        body = b"data: before\n\ndata: after\n\ndata: end\n\n"
        assert b"".join([data async for data in backend.follow(GID, 0)]) == body
        info = await backend.get(GID)
        assert info is not None
        assert info.status is Status.COMPLETE
        assert info.size == len(body)
        # Said once, not at every retry.
        await asyncio.sleep(0.1)
        assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == len(errors)
    finally:
        await backend.aclose()
    if said == "was deleted":
        assert not path.exists()  # not silently recreated empty


async def test_an_intact_file_stays_healthy(tmp_path: Path) -> None:
    backend = connect(f"sqlite:///{tmp_path / 'generations.db'}", flush_interval=0.02)
    assert isinstance(backend, DurableBackend)
    async with backend:
        generation = Generation(GID, principal="")
        backend.register(generation)
        generation.append(b"x")
        generation.finish(Status.COMPLETE)
        while await backend.flush():
            pass
        assert backend.healthy
        assert backend.failure is None
