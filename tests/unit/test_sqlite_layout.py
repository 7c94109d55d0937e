"""How SQLite lays chunks out: a flush of many generations writes a few pages, not one each.

Counted, not timed: the frames a flush appends to the write-ahead log are the pages it
dirtied, and what each commit costs follows them.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import pytest

from asgi_disconnect import connect
from asgi_disconnect._backends import DurableBackend
from asgi_disconnect._log import Generation, Status

pytestmark = pytest.mark.anyio

CHUNK = b"data: " + b"x" * 222 + b"\n\n"  # an SSE event of 230 bytes, as benchmarks relay
GENERATIONS = 100
ROUNDS = 12

# The layout files were made with before: chunks clustered on their position.
OLD_CHUNKS = """
create table asgi_disconnect_chunks (
    generation_id text not null,
    start integer not null,
    data blob not null,
    sizes blob not null,
    primary key (generation_id, start)
) without rowid
"""


def no_checkpoints(db: sqlite3.Connection) -> None:
    db.execute("pragma wal_autocheckpoint = 0")  # the log only grows: its size counts frames


def wal_size(wal: str) -> int:
    return Path(wal).stat().st_size


async def frames_per_flush(path: Path) -> list[int]:
    """Pages written to the log by each flush of ``GENERATIONS`` generations appending one
    chunk each, after the first flush (which creates them)."""
    backend = connect(f"sqlite:///{path}", flush_interval=5.0, lease=60.0, init=no_checkpoints)
    assert isinstance(backend, DurableBackend)
    wal = f"{path}-wal"
    page = 4096 + 24  # a frame: the page and its header
    frames: list[int] = []
    async with backend:
        generations = [Generation(f"gen_{n:024d}", principal="p") for n in range(GENERATIONS)]
        for generation in generations:
            backend.register(generation)
        for round_ in range(ROUNDS):
            for generation in generations:
                generation.append(CHUNK)
            before = wal_size(wal)
            assert not await backend.flush()
            if round_:
                frames.append((wal_size(wal) - before) // page)
        for generation in generations:
            generation.finish(Status.COMPLETE)
        await backend.flush()
        for generation in generations[:3]:
            stored = await backend.store.read(generation.id, 0, 1 << 20)
            assert stored == CHUNK * ROUNDS
    return frames


async def test_a_flush_of_many_generations_writes_a_few_pages(tmp_path: Path) -> None:
    new = await frames_per_flush(tmp_path / "new.db")
    old_path = tmp_path / "old.db"
    with closing(sqlite3.connect(old_path)) as db, db:  # a file made before: it still works
        db.execute(OLD_CHUNKS)
    old = await frames_per_flush(old_path)
    with closing(sqlite3.connect(old_path)) as db:
        indexes = [row[1] for row in db.execute("pragma index_list(asgi_disconnect_chunks)")]
    # Its primary key indexes it already: no second index to keep up.
    assert "asgi_disconnect_chunks_position" not in indexes
    # 100 rows of 230 bytes fill about 7 table pages and their index entries some more;
    # clustered on the position, each generation's rows sit apart: a page or more each.
    # (Seen: 16 growing to 29 pages a flush, against 19 growing to 112.)
    assert sum(new) * 2 < sum(old), (new, old)
    assert new[-1] < GENERATIONS // 2 < old[-1], (new, old)


async def test_a_new_file_indexes_chunks_by_position_once(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    for _ in range(2):  # opened twice: the index is made once
        backend = connect(f"sqlite:///{path}")
        async with backend:
            pass
    with closing(sqlite3.connect(path)) as db, db:
        indexes = db.execute("pragma index_list(asgi_disconnect_chunks)").fetchall()
        duplicate = db.execute(
            "insert into asgi_disconnect_chunks values ('g', 0, x'00', x'00'), "
            "('g', 0, x'01', x'01') on conflict do nothing"
        )
        assert duplicate.rowcount == 1  # the position is unique, as before
    assert [(row[1], row[2]) for row in indexes] == [("asgi_disconnect_chunks_position", 1)]
