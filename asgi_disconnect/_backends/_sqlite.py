"""The embedded default: stdlib ``sqlite3`` in a thread of its own, WAL, several processes."""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from .._errors import BackendUnavailable
from .._records import Adopted, Claim, ClaimState, GenerationInfo, StoredResponse
from ._pending import FlushBatch
from ._rows import adopted_from_row, claim_from_row, encode_response, info_from_row, join_from

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["SCHEMA_VERSION", "SQLiteStore"]

logger = logging.getLogger("asgi_disconnect")

SCHEMA_VERSION = 1
_T = TypeVar("_T")
# The poller tells a tail of each change; the tail asks the store again unprompted after
# this long only as a safety net.
_NOTICE_TIMEOUT = 1.0

# The database's clock, as Unix seconds: every lease and expiry is judged by it.
_NOW = "((julianday('now') - 2440587.5) * 86400.0)"

_SCHEMA = """
create table if not exists asgi_disconnect_meta (
    key text primary key,
    value text not null
);
create table if not exists asgi_disconnect_generations (
    id text primary key,
    principal text not null,
    status text not null,
    policy text,
    detached integer not null default 0,
    status_code integer not null,
    content_type text,
    size integer not null default 0,
    owner text,
    lease_until real,
    created_at real not null,
    finished_at real,
    expires_at real,
    error text,
    cancel_requested integer not null default 0,
    attempt integer not null default 1,
    upstream text,
    continuation blob,
    record_owed integer not null default 0
);
create index if not exists asgi_disconnect_generations_lease
    on asgi_disconnect_generations (status, lease_until);
create index if not exists asgi_disconnect_generations_expiry
    on asgi_disconnect_generations (expires_at);
create table if not exists asgi_disconnect_usage (
    id integer primary key autoincrement,
    generation_id text,
    principal text,
    route text not null,
    outcome text not null,
    input_tokens integer,
    output_tokens integer,
    usage_source text not null,
    recorded_at real not null,
    record text not null,
    request_id text
);
create index if not exists asgi_disconnect_usage_generation
    on asgi_disconnect_usage (generation_id);
create table if not exists asgi_disconnect_claims (
    principal text not null,
    key text not null,
    fingerprint blob not null,
    owner text not null,
    process text not null,
    status text not null,
    lease_until real,
    expires_at real not null,
    response blob,
    generation_id text,
    primary key (principal, key)
);
create index if not exists asgi_disconnect_claims_expiry on asgi_disconnect_claims (expires_at);
create index if not exists asgi_disconnect_claims_process
    on asgi_disconnect_claims (process, status);
create index if not exists asgi_disconnect_claims_owner on asgi_disconnect_claims (owner);
-- A rowid table: a flush's rows land together at its end, so a flush of many
-- generations dirties a few pages, not one per generation (a primary key on the position
-- would cluster each generation's rows apart: about twice the cost per flush).
create table if not exists asgi_disconnect_chunks (
    generation_id text not null,
    start integer not null,
    data blob not null,
    sizes blob not null
);
create table if not exists asgi_disconnect_pins (
    principal text not null,
    session_id text not null,
    provider text not null,
    expires_at real not null,
    primary key (principal, session_id)
) without rowid;
create index if not exists asgi_disconnect_pins_expiry on asgi_disconnect_pins (expires_at);
"""

_TAKEOVER_COLUMNS = (
    ("attempt", "integer not null default 1"),
    ("upstream", "text"),
    ("continuation", "blob"),
    ("record_owed", "integer not null default 0"),
)

# One statement: the live binding, renewed; or a new one to ``provider`` if none lives.
_PIN = f"""
insert into asgi_disconnect_pins (principal, session_id, provider, expires_at)
values (?, ?, ?, {_NOW} + ?)
on conflict (principal, session_id) do update set
    provider = case when asgi_disconnect_pins.expires_at <= {_NOW}
                    then excluded.provider else asgi_disconnect_pins.provider end,
    expires_at = excluded.expires_at
returning provider
"""

# One statement: a fresh claim, a takeover of an expired lease (same fingerprint only),
# or nothing at all when someone else holds the key.
_CLAIM = f"""
insert into asgi_disconnect_claims
    (principal, key, fingerprint, owner, process, status, lease_until, expires_at)
values (?, ?, ?, ?, ?, 'running', {_NOW} + ?, {_NOW} + ?)
on conflict (principal, key) do update set
    fingerprint = excluded.fingerprint, owner = excluded.owner, process = excluded.process,
    status = 'running', lease_until = excluded.lease_until, expires_at = excluded.expires_at,
    response = null, generation_id = null
where asgi_disconnect_claims.expires_at < {_NOW}
   or (asgi_disconnect_claims.status = 'running' and asgi_disconnect_claims.lease_until < {_NOW}
       and asgi_disconnect_claims.fingerprint = excluded.fingerprint)
returning owner
"""

_INFO = f"""
select id, status, policy, size, status_code, content_type, created_at, finished_at,
       detached, error, principal, attempt, owner
from asgi_disconnect_generations
where id = ? and (expires_at is null or expires_at > {_NOW})
"""


# Change notices for live tails: one statement per poll interval covers every generation
# some tail waits on (up to this many ids per statement).
_STATES = f"""
select id, status, size from asgi_disconnect_generations
where id in ({{}}) and (expires_at is null or expires_at > {_NOW})
"""
_STATES_BATCH = 500


def _open_failure(exc: sqlite3.Error | OSError, path: str) -> str:
    """Why SQLite could not open ``path`` and what to do about it.

    SQLite says "unable to open database file" for most causes, so look at the path.
    """
    if path in ("", ":memory:"):
        return str(exc)
    target = os.path.abspath(path)
    parent = os.path.dirname(target)
    if os.path.isdir(target):
        example = os.path.join(path, "generations.db")
        return (
            f"{target} is a directory, not a database file; name a file in it, "
            f"such as 'sqlite:///{example}'"
        )
    if not os.path.exists(parent):
        return f"the directory {parent} does not exist; create it or fix the path in the URL"
    if not os.path.isdir(parent):
        return f"{parent} is not a directory; fix the path in the URL"
    if not os.access(parent, os.W_OK) or (
        os.path.exists(target) and not os.access(target, os.R_OK | os.W_OK)
    ):
        return (
            f"this process may not write {target} and its directory ({exc}); "
            "fix the permissions or choose another path"
        )
    if getattr(exc, "sqlite_errorname", None) == "SQLITE_NOTADB":
        return (
            f"{target} is not a SQLite database ({exc}); point the URL at a new file "
            "or at a database this package created"
        )
    if getattr(exc, "sqlite_errorname", None) in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return f"another process kept {target} locked for over 10 s ({exc}); retry"
    return f"{exc}; check that {target} is a SQLite database this process can read and write"


class SQLiteStore:
    """One connection per process, used from one thread, so the event loop never blocks.

    WAL lets readers in other worker processes run beside the writer; ``busy_timeout``
    makes writers wait for each other instead of failing.

    Live tails of generations written by other processes wait in ``changed`` on
    one poller per store, which looks at every generation they wait on with one statement
    every ``poll_interval``: the polling costs the same for one tail or a thousand.
    """

    def __init__(
        self,
        path: str,
        *,
        url: str | None = None,
        poll_interval: float = 0.05,
        init: Callable[[sqlite3.Connection], object] | None = None,
    ) -> None:
        if not poll_interval > 0:
            raise ValueError("poll_interval must be positive")
        self.path = path
        self.init = init
        self.url = url or f"sqlite:///{path}"
        self.poll_interval = poll_interval
        self._executor: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None
        # The file the connection opened, (st_dev, st_ino), to notice it deleted or replaced.
        self._file: tuple[int, int] | None = None
        self.failure: str | None = None
        self._changes = _ChangePoller(self._read_states, url=self.url, poll_interval=poll_interval)

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        assert self._executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def open(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="asgi-disconnect-sqlite")
        try:
            await self._run(self._open)
        except BaseException as exc:
            self._executor.shutdown(wait=False)
            self._executor = None
            if isinstance(exc, (sqlite3.Error, OSError)):
                why = _open_failure(exc, self.path)
                raise BackendUnavailable(f"cannot open {self.url}: {why}") from exc
            raise

    def _open(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, timeout=10.0)
        try:
            db.execute("pragma busy_timeout = 10000")
            db.execute("pragma journal_mode = wal")
            # In WAL mode NORMAL survives a process crash; only an OS crash can lose a commit.
            db.execute("pragma synchronous = normal")
            # The log is appended and rarely read back (the OS caches the file anyway): a
            # 256 KiB page cache, not the default 2 MiB, which the process would hold.
            db.execute("pragma cache_size = -256")
            if self.init is not None:
                try:
                    self.init(db)
                except Exception as exc:
                    why = f"init= raised {exc!r}"
                    raise BackendUnavailable(f"cannot open {self.url}: {why}") from exc
            db.execute("begin immediate")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            columns = {
                row[1] for row in db.execute("pragma table_info(asgi_disconnect_generations)")
            }
            if "cancel_requested" not in columns:
                db.execute(
                    "alter table asgi_disconnect_generations "
                    "add column cancel_requested integer not null default 0"
                )
            # Takeover (a file made before it): the attempt counts the owners it had.
            for column, kind in _TAKEOVER_COLUMNS:
                if column not in columns:
                    db.execute(
                        f"alter table asgi_disconnect_generations add column {column} {kind}"
                    )
            _index_chunks(db)
            columns = {row[1] for row in db.execute("pragma table_info(asgi_disconnect_usage)")}
            if "request_id" not in columns:
                # A table made before usage rows had a request id: add it, in place.
                db.execute("alter table asgi_disconnect_usage add column request_id text")
            db.execute(
                "create unique index if not exists asgi_disconnect_usage_request "
                "on asgi_disconnect_usage (request_id)"
            )
            row = db.execute(
                "select value from asgi_disconnect_meta where key = 'schema_version'"
            ).fetchone()
            if row is None:
                db.execute(
                    "insert into asgi_disconnect_meta (key, value) values ('schema_version', ?)",
                    (str(SCHEMA_VERSION),),
                )
            elif int(row[0]) > SCHEMA_VERSION:
                raise BackendUnavailable(
                    f"{self.url} has schema version {row[0]}, newer than this package "
                    f"supports ({SCHEMA_VERSION}); upgrade asgi-disconnect"
                )
            db.execute("commit")
            if self.path not in ("", ":memory:"):
                opened = os.stat(self.path)
                self._file = (opened.st_dev, opened.st_ino)
        except BaseException:
            if db.in_transaction:
                db.execute("rollback")
            db.close()
            raise
        self._db = db
        self.failure = None

    async def aclose(self) -> None:
        await self._changes.aclose()
        if self._executor is None:
            return
        await self._run(self._close)
        self._executor.shutdown(wait=True)
        self._executor = None

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _check_file(self) -> None:
        """Whether the file at ``path`` is still the one the connection has open.

        A file deleted (or replaced) under an open connection takes every later commit with
        it when the connection closes, silently: from then on this store refuses writes.
        """
        if self._file is None or self.failure is not None:
            return
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            what = "was deleted"
        else:
            if (now.st_dev, now.st_ino) == self._file:
                return
            what = "was replaced by another file"
        self.failure = (
            f"{os.path.abspath(self.path)} {what} while this process had it open; what it "
            "would write now would be lost with the old file. Output produced from now on is "
            "kept in this process's memory only; restart the process to open the database again"
        )
        logger.error("%s: %s", self.url, self.failure)

    def _write(self, fn: Callable[[sqlite3.Connection], _T]) -> _T:
        db = self._db
        assert db is not None
        self._check_file()
        if self.failure is not None:
            raise BackendUnavailable(self.failure)
        db.execute("begin immediate")
        try:
            result = fn(db)
        except BaseException:
            db.execute("rollback")
            raise
        db.execute("commit")
        return result

    async def flush(self, batch: FlushBatch) -> list[str]:
        return await self._run(self._write, lambda db: _flush(db, batch))

    async def heartbeat(self, owner: str, lease: float) -> None:
        def renew(db: sqlite3.Connection) -> None:
            db.execute(
                f"update asgi_disconnect_generations set lease_until = {_NOW} + ? "
                "where owner = ? and (status = 'running' or record_owed)",
                (lease, owner),
            )
            # The claims of the generations it runs (taken over ones too) live as long.
            db.execute(
                f"update asgi_disconnect_claims set lease_until = max(lease_until, {_NOW} + ?) "
                "where status = 'running' and generation_id in (select id from "
                "asgi_disconnect_generations where owner = ? and status = 'running')",
                (lease, owner),
            )

        await self._run(self._write, renew)

    async def settle_generation_claims(
        self, generation_id: str, response: bytes | None, ttl: float
    ) -> int:
        def settle(db: sqlite3.Connection) -> int:
            if response is None:
                cursor = db.execute(
                    "delete from asgi_disconnect_claims "
                    "where generation_id = ? and status = 'running'",
                    (generation_id,),
                )
            else:
                cursor = db.execute(
                    "update asgi_disconnect_claims set status = 'completed', response = ?, "
                    f"lease_until = null, expires_at = {_NOW} + ? "
                    "where generation_id = ? and status = 'running'",
                    (response, ttl, generation_id),
                )
            return cursor.rowcount

        return await self._run(self._write, settle)

    async def sweep(self, ttl: float, max_attempts: int = 1, grace: float = 0.0) -> list[str]:
        def interrupt(db: sqlite3.Connection) -> list[str]:
            rows = db.execute(
                f"update asgi_disconnect_generations set status = 'interrupted', "
                f"finished_at = {_NOW}, expires_at = {_NOW} + ?, lease_until = null, "
                "error = case when continuation is null or not detached "
                "then 'its owner stopped renewing its lease' "
                "else 'its owner stopped renewing its lease and no replica took it over "
                "(none has its upstream ' || quote(upstream) || ' registered, or its "
                "attempts ran out)' end "
                f"where status = 'running' and lease_until < {_NOW} "
                "and (continuation is null or not detached or attempt >= ? "
                f"or lease_until < {_NOW} - ?) returning id",
                (ttl, max_attempts, grace),
            ).fetchall()
            return [row[0] for row in rows]

        return await self._run(self._write, interrupt)

    async def claim_owed(self, lease: float, limit: int) -> list[str]:
        def claim(db: sqlite3.Connection) -> list[str]:
            # Held, not owned: see the PostgreSQL store's statement.
            rows = db.execute(
                f"update asgi_disconnect_generations set lease_until = {_NOW} + ? "
                "where id in (select id from asgi_disconnect_generations "
                f"where record_owed and lease_until < {_NOW} order by lease_until limit ?) "
                "returning id",
                (lease, limit),
            ).fetchall()
            return [row[0] for row in rows]

        return await self._run(self._write, claim)

    async def continued_upstreams(self) -> list[str]:
        def select() -> list[str]:
            db = self._db
            assert db is not None
            rows = db.execute(
                "select distinct upstream from asgi_disconnect_generations "
                "where status = 'running' and detached and upstream is not null"
            ).fetchall()
            return [row[0] for row in rows]

        return await self._run(select)

    async def lost(self, ids: list[str]) -> list[Adopted]:
        def select() -> list[Adopted]:
            db = self._db
            assert db is not None
            marks = ",".join("?" * len(ids))
            rows = db.execute(
                "select id, principal, attempt, size, status_code, content_type, policy, "
                "created_at, coalesce(continuation, x''), status, detached "
                "from asgi_disconnect_generations "
                f"where id in ({marks})",
                ids,
            ).fetchall()
            return [adopted_from_row(row) for row in rows]

        return await self._run(select)

    async def take_over(
        self, owner: str, lease: float, limit: int, upstreams: list[str], max_attempts: int
    ) -> list[Adopted]:
        def take(db: sqlite3.Connection) -> list[Adopted]:
            marks = ",".join("?" * len(upstreams))
            rows = db.execute(
                f"update asgi_disconnect_generations "
                f"set owner = ?, attempt = attempt + 1, lease_until = {_NOW} + ? "
                "where id in (select id from asgi_disconnect_generations "
                "where status = 'running' and detached and continuation is not null "
                f"and upstream in ({marks}) and lease_until < {_NOW} and attempt < ? "
                "and owner is not ? "  # its own: a late heartbeat, not a dead process
                "order by lease_until limit ?) "
                "returning id, principal, attempt, size, status_code, content_type, policy, "
                "created_at, continuation",
                (owner, lease, *upstreams, max_attempts, owner, limit),
            ).fetchall()
            return [adopted_from_row(row) for row in rows]

        if not upstreams:
            return []
        return await self._run(self._write, take)

    async def reap(self, limit: int) -> int:
        def delete(db: sqlite3.Connection) -> int:
            ids = [
                (row[0],)
                for row in db.execute(
                    f"select id from asgi_disconnect_generations where expires_at < {_NOW} limit ?",
                    (limit,),
                )
            ]
            db.executemany("delete from asgi_disconnect_chunks where generation_id = ?", ids)
            db.executemany("delete from asgi_disconnect_generations where id = ?", ids)
            claims = db.execute(
                "delete from asgi_disconnect_claims where rowid in (select rowid from "
                f"asgi_disconnect_claims where expires_at < {_NOW} limit ?)",
                (limit,),
            ).rowcount
            pins = db.execute(
                "delete from asgi_disconnect_pins where (principal, session_id) in (select "
                f"principal, session_id from asgi_disconnect_pins where expires_at < {_NOW} "
                "limit ?)",
                (limit,),
            ).rowcount
            return max(len(ids), claims, pins)

        return await self._run(self._write, delete)

    async def info(self, generation_id: str) -> tuple[GenerationInfo, str] | None:
        return await self._run(self._info, generation_id)

    async def recent(self, limit: int, status: str | None) -> list[GenerationInfo]:
        def select() -> list[GenerationInfo]:
            assert self._db is not None
            rows = self._db.execute(
                _INFO.replace("where id = ? and", "where (? is null or status = ?) and")
                + " order by created_at desc limit ?",
                (status, status, limit),
            ).fetchall()
            return [info_from_row(row)[0] for row in rows]

        return await self._run(select)

    def _info(self, generation_id: str) -> tuple[GenerationInfo, str] | None:
        assert self._db is not None
        row = self._db.execute(_INFO, (generation_id,)).fetchone()
        if row is None:
            return None
        return info_from_row(row)

    async def request_cancel(self, generation_id: str) -> bool:
        return await self._run(self._write, lambda db: _request_cancel(generation_id, db))

    async def cancel_requests(self, owner: str) -> list[str]:
        return await self._run(self._cancel_requests, owner)

    def _cancel_requests(self, owner: str) -> list[str]:
        assert self._db is not None
        rows = self._db.execute(
            "select id from asgi_disconnect_generations "
            "where status = 'running' and owner = ? and cancel_requested = 1",
            (owner,),
        ).fetchall()
        return [row[0] for row in rows]

    async def read(self, generation_id: str, offset: int, limit: int) -> bytes:
        return await self._run(self._read, generation_id, offset, limit)

    def _read(self, generation_id: str, offset: int, limit: int) -> bytes:
        assert self._db is not None
        rows = self._db.execute(
            "select start, data from asgi_disconnect_chunks where generation_id = ? and start >= "
            "coalesce((select max(start) from asgi_disconnect_chunks "
            "where generation_id = ? and start <= ?), 0) order by start",
            (generation_id, generation_id, offset),
        )
        return join_from(rows, offset, limit)

    async def usage(self, generation_id: str) -> list[bytes]:
        def select() -> list[bytes]:
            assert self._db is not None
            rows = self._db.execute(
                "select record from asgi_disconnect_usage where generation_id = ? order by id",
                (generation_id,),
            )
            return [row[0].encode() for row in rows]

        return await self._run(select)

    # -- claims ---------------------------------------------------------------------

    async def claim(
        self,
        principal: str,
        key: str,
        fingerprint: bytes,
        *,
        owner: str,
        process: str,
        lease: float,
        ttl: float,
    ) -> Claim:
        def take(db: sqlite3.Connection) -> Claim:
            won = db.execute(
                _CLAIM, (principal, key, fingerprint, owner, process, lease, ttl)
            ).fetchone()
            if won is not None and won[0] == owner:
                return Claim(state=ClaimState.ACQUIRED)
            row = db.execute(
                f"select status, fingerprint, lease_until - {_NOW}, response, generation_id "
                "from asgi_disconnect_claims where principal = ? and key = ?",
                (principal, key),
            ).fetchone()
            return claim_from_row(row, fingerprint)

        return await self._run(self._write, take)

    async def renew_claims(self, owner: str, lease: float) -> None:
        def renew(db: sqlite3.Connection) -> None:
            db.execute(
                f"update asgi_disconnect_claims set lease_until = {_NOW} + ? "
                "where owner = ? and status = 'running'",
                (lease, owner),
            )

        await self._run(self._write, renew)

    async def complete_claim(
        self, principal: str, key: str, *, owner: str, response: StoredResponse, ttl: float
    ) -> bool:
        def complete(db: sqlite3.Connection) -> bool:
            cursor = db.execute(
                "update asgi_disconnect_claims set status = 'completed', response = ?, "
                f"generation_id = ?, expires_at = {_NOW} + ?, lease_until = null "
                "where principal = ? and key = ? and owner = ? and status = 'running'",
                (encode_response(response), response.generation_id, ttl, principal, key, owner),
            )
            return cursor.rowcount == 1

        return await self._run(self._write, complete)

    async def release_claim(self, principal: str, key: str, *, owner: str) -> bool:
        def release(db: sqlite3.Connection) -> bool:
            cursor = db.execute(
                "delete from asgi_disconnect_claims "
                "where principal = ? and key = ? and owner = ? and status = 'running'",
                (principal, key, owner),
            )
            return cursor.rowcount == 1

        return await self._run(self._write, release)

    async def note_generation(
        self, principal: str, key: str, *, owner: str, generation_id: str
    ) -> None:
        def note(db: sqlite3.Connection) -> None:
            db.execute(
                "update asgi_disconnect_claims set generation_id = ? "
                "where principal = ? and key = ? and owner = ? and status = 'running'",
                (generation_id, principal, key, owner),
            )

        await self._run(self._write, note)

    # -- session pins -------------------------------------------------------------------

    async def pin_session(self, principal: str, session_id: str, provider: str, ttl: float) -> str:
        def pin(db: sqlite3.Connection) -> str:
            row = db.execute(_PIN, (principal, session_id, provider, ttl)).fetchone()
            return str(row[0])

        return await self._run(self._write, pin)

    async def end_session(self, principal: str, session_id: str) -> bool:
        def end(db: sqlite3.Connection) -> bool:
            cursor = db.execute(
                "delete from asgi_disconnect_pins where principal = ? and session_id = ? "
                f"and expires_at > {_NOW}",
                (principal, session_id),
            )
            return cursor.rowcount == 1

        return await self._run(self._write, end)

    async def changed(self, generation_id: str, seen: tuple[str, int]) -> tuple[str, int] | None:
        """Wait until the generation's (status, size) differs from ``seen``, as the
        store's one poller sees it; return what it is now. None: gone, or not known
        (``_NOTICE_TIMEOUT`` passed, or the poller failed), so ask ``info``."""
        return await self._changes.changed_from(generation_id, seen, _NOTICE_TIMEOUT)

    async def _read_states(self, ids: list[str]) -> dict[str, tuple[str, int]]:
        return await self._run(self._states, ids)

    def _states(self, ids: list[str]) -> dict[str, tuple[str, int]]:
        assert self._db is not None
        states: dict[str, tuple[str, int]] = {}
        for start in range(0, len(ids), _STATES_BATCH):
            batch = ids[start : start + _STATES_BATCH]
            sql = _STATES.format(", ".join("?" * len(batch)))
            for generation_id, status, size in self._db.execute(sql, batch):
                states[generation_id] = (status, size)
        return states


class _ChangePoller:
    """Change notices for the live tails of one store: one task looks at every generation a
    tail waits on, with one ``read_states`` call every ``poll_interval``, and wakes the tails
    whose generation moved on. It runs while some tail waits, and stops when none does."""

    def __init__(
        self,
        read_states: Callable[[list[str]], Awaitable[dict[str, tuple[str, int]]]],
        *,
        url: str,
        poll_interval: float,
    ) -> None:
        self._read_states = read_states
        self._url = url
        self._poll_interval = poll_interval
        # Tails waiting for a generation to move on from what they saw.
        self._waiters: dict[
            str, list[tuple[tuple[str, int], asyncio.Future[tuple[str, int] | None]]]
        ] = {}
        self._watcher: asyncio.Task[None] | None = None

    async def changed_from(
        self, generation_id: str, seen: tuple[str, int], timeout: float
    ) -> tuple[str, int] | None:
        """(status, size) once it differs from ``seen``; None: gone, or not known."""
        waiter: asyncio.Future[tuple[str, int] | None] = asyncio.get_running_loop().create_future()
        waiting = self._waiters.setdefault(generation_id, [])
        entry = (seen, waiter)
        waiting.append(entry)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())
        try:
            async with asyncio.timeout(timeout):
                return await waiter
        except TimeoutError:
            return None
        finally:
            waiting = self._waiters.get(generation_id, [])
            if entry in waiting:
                waiting.remove(entry)
                if not waiting:
                    del self._waiters[generation_id]

    async def aclose(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)

    async def _watch(self) -> None:
        """Every ``poll_interval``, one look at every generation a tail waits on."""
        while self._waiters:
            await asyncio.sleep(self._poll_interval)
            ids = list(self._waiters)
            if not ids:
                break
            try:
                states: dict[str, tuple[str, int]] | None = await self._read_states(ids)
            except Exception as exc:
                # Let the tails look for themselves: they report what is wrong.
                logger.debug("polling %s for live tails failed: %s", self._url, exc)
                states = None
            for generation_id in ids:
                state = None if states is None else states.get(generation_id)
                waiting = self._waiters.get(generation_id, [])
                for seen, waiter in list(waiting):
                    if (states is None or seen != state) and not waiter.done():
                        waiter.set_result(state)


def _index_chunks(db: sqlite3.Connection) -> None:
    """Index the chunks by position; a file made before keeps its table, clustered on the
    position already (``without rowid``), which needs no index."""
    (sql,) = db.execute(
        "select sql from sqlite_master where type = 'table' and name = 'asgi_disconnect_chunks'"
    ).fetchone()
    if "without rowid" not in sql.lower():
        db.execute(
            "create unique index if not exists asgi_disconnect_chunks_position "
            "on asgi_disconnect_chunks (generation_id, start)"
        )


def _request_cancel(generation_id: str, db: sqlite3.Connection) -> bool:
    cursor = db.execute(
        "update asgi_disconnect_generations set cancel_requested = 1 "
        "where id = ? and status = 'running'",
        (generation_id,),
    )
    return cursor.rowcount > 0


def _flush(db: sqlite3.Connection, batch: FlushBatch) -> list[str]:
    """Write ``batch``; the generations whose chunks it refused: another process owns them."""
    if batch.created:
        db.executemany(
            "insert into asgi_disconnect_generations (id, principal, status, policy, detached, "
            "status_code, content_type, owner, lease_until, created_at) "
            f"values (?, ?, 'running', ?, ?, ?, ?, ?, {_NOW} + ?, ?) "
            "on conflict (id) do nothing",
            [
                (gid, principal, policy, int(detached), code, ctype, batch.owner, batch.lease, at)
                for gid, principal, code, ctype, policy, detached, at in batch.created
            ],
        )
    fenced: list[str] = []
    if batch.chunks:
        ends: dict[str, int] = {}
        for generation_id, start, data, _ in batch.chunks:
            ends[generation_id] = start + len(data)
        # Fenced: only the generation's owner appends (one writer at a time: no race).
        marks = ",".join("?" * len(ends))
        owned = {
            row[0]
            for row in db.execute(
                f"select id from asgi_disconnect_generations where id in ({marks}) "
                "and owner = ? and status = 'running'",
                (*ends, batch.owner),
            )
        }
        fenced = [gid for gid in ends if gid not in owned]
        db.executemany(
            "insert into asgi_disconnect_chunks (generation_id, start, data, sizes) "
            "values (?, ?, ?, ?) "
            "on conflict do nothing",
            [row for row in batch.chunks if row[0] in owned],
        )
        db.executemany(
            "update asgi_disconnect_generations set size = ? where id = ? and size < ?",
            [(end, gid, end) for gid, end in ends.items() if gid in owned],
        )
    if batch.continued:
        db.executemany(
            "update asgi_disconnect_generations set upstream = ?, continuation = ? "
            "where id = ? and owner = ?",
            [(upstream, data, gid, batch.owner) for gid, upstream, data in batch.continued],
        )
    if batch.released:
        # Handed over (a drain): no owner, its lease lapsed, for another process to take.
        db.executemany(
            f"update asgi_disconnect_generations set owner = null, lease_until = {_NOW} "
            "where id = ? and owner = ? and status = 'running'",
            [(gid, batch.owner) for gid in batch.released],
        )
    if batch.changed:
        db.executemany(
            "update asgi_disconnect_generations set policy = ?, detached = ? "
            "where id = ? and owner = ?",
            [(policy, int(detached), gid, batch.owner) for gid, policy, detached in batch.changed],
        )
    if batch.usage:
        db.executemany(
            "insert into asgi_disconnect_usage (generation_id, principal, route, outcome, "
            "input_tokens, output_tokens, usage_source, record, request_id, recorded_at) "
            f"values (?, ?, ?, ?, ?, ?, ?, ?, ?, {_NOW}) on conflict (request_id) do nothing",
            [(*row[:7], row[7].decode(), row[8]) for row in batch.usage],
        )
    if batch.finished:
        # Fenced by the owner token: a generation swept as interrupted stays so.
        db.executemany(
            f"update asgi_disconnect_generations set status = ?, size = ?, error = ?, "
            f"finished_at = ?, expires_at = {_NOW} + ?, record_owed = ?, "
            f"lease_until = case when ? then {_NOW} + ? end "
            "where id = ? and owner = ? and status = 'running'",
            [
                (status, size, error, at, batch.ttl, owed, owed, batch.lease, gid, batch.owner)
                for gid, status, size, error, at, owed in batch.finished
            ],
        )
    if batch.paid:
        db.executemany(
            "update asgi_disconnect_generations set record_owed = 0, lease_until = null "
            "where id = ? and record_owed",
            [(gid,) for gid in batch.paid],
        )
    return fenced
