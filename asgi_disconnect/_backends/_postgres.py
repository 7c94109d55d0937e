"""PostgreSQL through asyncpg: several replicas, one schema, live tails by LISTEN/NOTIFY."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .._errors import BackendUnavailable
from .._records import Adopted, Claim, ClaimState, GenerationInfo, StoredResponse
from ._pending import FlushBatch
from ._rows import adopted_from_row, claim_from_row, encode_response, info_from_row, join_from

if TYPE_CHECKING:
    from collections.abc import Sequence

    import asyncpg

__all__ = ["SCHEMA_VERSION", "PostgresStore", "mask_url"]

logger = logging.getLogger("asgi_disconnect")

SCHEMA_VERSION = 1
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*")
_NOTIFY_PAYLOAD = 7000


async def _close_pool(pool: Any) -> None:
    # close() waits for every connection to come back; past the deadline it terminates.
    try:
        await asyncio.wait_for(pool.close(), 10)
    except (TimeoutError, OSError):
        pool.terminate()


async def _rollback_if_needed(conn: Any) -> None:
    if conn.is_in_transaction():
        await conn.execute("rollback")


def mask_url(url: str) -> str:
    """``url`` with its password, in the user part or as ``?password=``, replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if sep:
        # Up to the last '@' before the query: a password may hold an unencoded '@' or '/',
        # and masking too much is better than showing some of it.
        end = min((i for i in map(rest.find, "?#") if i >= 0), default=len(rest))
        userinfo, at, after = rest[:end].rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if at and colon and "/" not in user:
            rest = f"{user}:***@{after}{rest[end:]}"
        url = f"{scheme}{sep}{rest}"
    return _QUERY_PASSWORD.sub(r"\1***", url)


def _identifier(name: str) -> str:
    return name if _SCHEMA_NAME.fullmatch(name) else '"' + name.replace('"', '""') + '"'


def _connect_failure(exc: BaseException, dsn: str, timeout: float) -> str:
    """Why connecting failed and what to do about it, for a ``BackendUnavailable``."""
    try:
        parts = urlsplit(dsn)
        host, port = parts.hostname, parts.port or 5432
        user, database = parts.username, parts.path.lstrip("/") or parts.username
    except ValueError:
        host = user = database = None
        port = 5432
    where = f"{host}:{port}" if host else "the server"
    if isinstance(exc, TimeoutError):
        return (
            f"no answer from {where} within {timeout:g} s; check the host, the port and any "
            "firewall between, or give connect_timeout= more time"
        )
    if isinstance(exc, ConnectionRefusedError):
        return f"connection refused: nothing listens at {where}; start PostgreSQL or fix the URL"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host {host!r} ({exc.strerror}); fix the host in the URL"
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate == "28000":
        role = f"CREATE ROLE {_identifier(user)} LOGIN" if user else "CREATE ROLE ... LOGIN"
        return (
            f"{exc}; fix the user name in the URL, or create the role ({role}) "
            "and let it connect in pg_hba.conf"
        )
    if sqlstate == "28P01":
        return f"{exc}; fix the password in the URL (or in PGPASSWORD or ~/.pgpass)"
    if sqlstate == "3D000":
        create = f"CREATE DATABASE {_identifier(database)}" if database else "CREATE DATABASE"
        return f"{exc}; fix the database name in the URL, or create it ({create})"
    if sqlstate == "53300":
        return f"{exc}; raise the server's max_connections or lower max_size"
    if sqlstate is not None:
        return f"{exc} (SQLSTATE {sqlstate}); the server's log says more"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}; check the host and port in the URL"
    return f"{exc}; check the URL"


def _prepare_failure(exc: BaseException, schema: str) -> str:
    """Why creating or checking the schema failed and what to do about it."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate == "42501":
        return (
            f"{exc}; grant the role CREATE on the database, or create the schema for it "
            f"(CREATE SCHEMA {_identifier(schema)} AUTHORIZATION the_role)"
        )
    if sqlstate == "55P03":
        return f"{exc}; another process held the schema lock for over 15 s, retry"
    if sqlstate is not None:
        return f"{exc} (SQLSTATE {sqlstate}); the server's log says more"
    if isinstance(exc, TimeoutError):
        return "no answer while preparing the schema; retry, and check the server's load"
    return f"{exc or type(exc).__name__}; retry, and see the server's log if it persists"


class PostgresStore:
    """An asyncpg pool (yours or its own) and one listening connection.

    Writes are one transaction per flush; chunk inserts are a single ``unnest`` statement
    and ``on conflict do nothing``, so a flush retried after an ambiguous commit writes
    nothing twice. Readers in other replicas wake on ``NOTIFY`` and poll every
    ``poll_interval`` seconds in case a notification was missed.
    """

    # A database server that is down comes back: nothing refuses writes for good here.
    failure: str | None = None

    def __init__(
        self,
        dsn: str | None = None,
        *,
        pool: asyncpg.Pool | None = None,
        schema: str = "public",
        poll_interval: float = 1.0,
        min_size: int = 1,
        max_size: int = 4,
        connect_timeout: float = 5.0,
        url: str | None = None,
    ) -> None:
        if dsn is None and pool is None:
            raise ValueError("PostgresStore needs a DSN or a pool")
        if not _SCHEMA_NAME.fullmatch(schema):
            raise ValueError(f"schema must be a lower-case SQL identifier, not {schema!r}")
        if not connect_timeout > 0:
            raise ValueError("connect_timeout must be positive")
        self.dsn = dsn
        shown = url or dsn
        self.url = mask_url(shown) if shown else "postgresql://(pool)"
        self.connect_timeout = connect_timeout
        self.schema = schema
        self.poll_interval = poll_interval
        self._pool = pool
        self._own_pool = pool is None
        self._min_size = min_size
        self._max_size = max_size
        self._listener: asyncpg.Connection | None = None
        self._listening: asyncio.Task[None] | None = None
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self.channel = f"asgi_disconnect_{schema}"
        t = f'"{schema}".asgi_disconnect_'
        self._t = t
        self._sql = _statements(t)

    @property
    def pool(self) -> asyncpg.Pool:
        assert self._pool is not None, "the store is not open"
        return self._pool

    async def open(self) -> None:
        try:
            import asyncpg
        except ImportError as exc:
            raise BackendUnavailable(
                f"cannot connect to {self.url}: the PostgreSQL backend needs asyncpg, which is "
                "not installed; pip install 'asgi-disconnect[postgres]'"
            ) from exc

        if self._pool is None:
            assert self.dsn is not None
            try:
                self._pool = await asyncpg.create_pool(
                    self.dsn,
                    min_size=self._min_size,
                    max_size=self._max_size,
                    # Bounds connecting and authenticating; a refused connection fails at once.
                    timeout=self.connect_timeout,
                    command_timeout=30,
                    # The pool is ours alone: skip asyncpg's reset query, a round trip per
                    # release (a claim must cost one round trip, not two).
                    reset=_rollback_if_needed,
                )
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                why = _connect_failure(exc, self.dsn, self.connect_timeout)
                raise BackendUnavailable(f"cannot connect to {self.url}: {why}") from exc
        try:
            async with self.pool.acquire(timeout=10) as conn, conn.transaction():
                await conn.execute("set local lock_timeout = '15s'")
                await conn.execute("select pg_advisory_xact_lock(hashtext('asgi_disconnect'))")
                await conn.execute(f'create schema if not exists "{self.schema}"')
                await conn.execute(_schema(self._t))
                version = await conn.fetchval(
                    f"select value from {self._t}meta where key = 'schema_version'"
                )
                if version is None:
                    await conn.execute(
                        f"insert into {self._t}meta (key, value) values ('schema_version', $1)",
                        str(SCHEMA_VERSION),
                    )
                elif int(version) > SCHEMA_VERSION:
                    raise BackendUnavailable(
                        f"{self.url} has schema version {version}, newer than this package "
                        f"supports ({SCHEMA_VERSION}); upgrade asgi-disconnect"
                    )
        except BaseException as exc:
            if self._own_pool:
                await _close_pool(self.pool)
                self._pool = None
            if isinstance(exc, (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)):
                why = _prepare_failure(exc, self.schema)
                raise BackendUnavailable(f"cannot prepare {self.url}: {why}") from exc
            raise
        self._listening = asyncio.ensure_future(self._listen_forever())

    async def aclose(self) -> None:
        if self._listening is not None:
            self._listening.cancel()
            await asyncio.gather(self._listening, return_exceptions=True)
            self._listening = None
        await self._drop_listener()
        if self._own_pool and self._pool is not None:
            await _close_pool(self._pool)
            self._pool = None

    # -- LISTEN ---------------------------------------------------------------------

    async def _listen_forever(self) -> None:
        while True:
            try:
                if self._listener is None or self._listener.is_closed():
                    await self._drop_listener()
                    # Held from here on, so that aclose() releases it even when LISTEN is
                    # cancelled half-way; a lost connection makes the pool's close() hang.
                    self._listener = await self.pool.acquire(timeout=10)
                    await self._listener.add_listener(self.channel, self._notified)
                    self._wake_all()  # anything missed while not listening
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.debug("LISTEN on %s failed (%s); polling meanwhile", self.url, exc)
                await self._drop_listener()
            await asyncio.sleep(self.poll_interval)

    async def _drop_listener(self) -> None:
        conn, self._listener = self._listener, None
        if conn is None:
            return
        with contextlib.suppress(Exception):
            if not conn.is_closed():
                await asyncio.wait_for(conn.remove_listener(self.channel, self._notified), 5)
        # A connection that died with the server is discarded by the pool on release.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.pool.release(conn), 5)

    def _notified(self, conn: Any, pid: int, channel: str, payload: str) -> None:
        for generation_id in payload.split(","):
            self._wake(generation_id)

    def _wake(self, generation_id: str) -> None:
        for waiter in self._waiters.pop(generation_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    def _wake_all(self) -> None:
        for generation_id in list(self._waiters):
            self._wake(generation_id)

    async def changed(self, generation_id: str, seen: tuple[str, int]) -> None:
        """Wait for a notification naming the generation, at most ``poll_interval`` (in
        case one was missed); a notification does not say what changed: None."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(generation_id, set()).add(waiter)
        try:
            await asyncio.wait_for(waiter, self.poll_interval)
        except TimeoutError:
            pass
        finally:
            waiters = self._waiters.get(generation_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[generation_id]

    # -- writes ---------------------------------------------------------------------

    async def flush(self, batch: FlushBatch) -> list[str]:
        # Whatever the batch holds, in order, in one round trip (asgi_disconnect_flush).
        payloads = _notifications(sorted(batch.touched()))
        fenced = await self.pool.fetchval(
            self._sql["flush"],
            *_flush_arrays(batch),
            self.channel,
            payloads,
            *_columns(batch.continued, 0, 1, 2),
            batch.released,
            batch.paid,
        )
        return list(fenced or ())

    async def heartbeat(self, owner: str, lease: float) -> None:
        await self.pool.execute(self._sql["heartbeat"], owner, lease)

    async def settle_generation_claims(
        self, generation_id: str, response: bytes | None, ttl: float
    ) -> int:
        if response is None:
            status = await self.pool.execute(
                f"delete from {self._t}claims where generation_id = $1 and status = 'running'",
                generation_id,
            )
        else:
            status = await self.pool.execute(
                f"update {self._t}claims set status = 'completed', response = $2, "
                "lease_until = null, expires_at = now() + make_interval(secs => $3) "
                "where generation_id = $1 and status = 'running'",
                generation_id,
                response,
                ttl,
            )
        return int(status.split()[-1])

    async def continued_upstreams(self) -> list[str]:
        rows = await self.pool.fetch(
            f"select distinct upstream from {self._t}generations "
            "where status = 'running' and detached and upstream is not null"
        )
        return [row[0] for row in rows]

    async def claim_owed(self, lease: float, limit: int) -> list[str]:
        rows = await self.pool.fetch(self._sql["claim_owed"], lease, limit)
        return [row[0] for row in rows]

    async def lost(self, ids: list[str]) -> list[Adopted]:
        rows = await self.pool.fetch(self._sql["lost"], ids)
        return [adopted_from_row(row) for row in rows]

    async def take_over(
        self, owner: str, lease: float, limit: int, upstreams: list[str], max_attempts: int
    ) -> list[Adopted]:
        rows = await self.pool.fetch(
            self._sql["take_over"], owner, lease, limit, upstreams, max_attempts
        )
        return [adopted_from_row(row) for row in rows]

    # -- claims -----------------------------------------------------------------------

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
        sql = self._sql
        async with self.pool.acquire(timeout=10) as conn:
            won = await conn.fetchval(
                sql["claim"], principal, key, fingerprint, owner, process, lease, ttl
            )
            if won == owner:
                return Claim(state=ClaimState.ACQUIRED)
            row = await conn.fetchrow(sql["claim_row"], principal, key)
        return claim_from_row(None if row is None else tuple(row), fingerprint)

    async def renew_claims(self, owner: str, lease: float) -> None:
        await self.pool.execute(self._sql["renew_claims"], owner, lease)

    async def complete_claim(
        self, principal: str, key: str, *, owner: str, response: StoredResponse, ttl: float
    ) -> bool:
        status = await self.pool.execute(
            self._sql["complete_claim"],
            encode_response(response),
            response.generation_id,
            ttl,
            principal,
            key,
            owner,
        )
        return bool(status == "UPDATE 1")

    async def note_generation(
        self, principal: str, key: str, *, owner: str, generation_id: str
    ) -> None:
        await self.pool.execute(
            f"update {self._t}claims set generation_id = $1 "
            "where principal = $2 and key = $3 and owner = $4 and status = 'running'",
            generation_id,
            principal,
            key,
            owner,
        )

    async def release_claim(self, principal: str, key: str, *, owner: str) -> bool:
        status = await self.pool.execute(self._sql["release_claim"], principal, key, owner)
        return bool(status == "DELETE 1")

    async def sweep(self, ttl: float, max_attempts: int = 1, grace: float = 0.0) -> list[str]:
        rows = await self.pool.fetch(self._sql["sweep"], ttl, max_attempts, grace)
        ids = [row[0] for row in rows]
        if ids:
            await self.pool.execute("select pg_notify($1, $2)", self.channel, ",".join(ids)[:7000])
        return ids

    async def reap(self, limit: int) -> int:
        async with self.pool.acquire(timeout=10) as conn, conn.transaction():
            ids = [row[0] for row in await conn.fetch(self._sql["expired"], limit)]
            if ids:
                await conn.execute(
                    f"delete from {self._t}chunks where generation_id = any($1)", ids
                )
                await conn.execute(f"delete from {self._t}generations where id = any($1)", ids)
            claims = await conn.execute(self._sql["reap_claims"], limit)
            pins = await conn.execute(
                f"delete from {self._t}pins where (principal, session_id) in (select "
                f"principal, session_id from {self._t}pins where expires_at < now() limit $1)",
                limit,
            )
        return max(len(ids), int(claims.split()[-1]), int(pins.split()[-1]))

    # -- session pins -------------------------------------------------------------------

    async def pin_session(self, principal: str, session_id: str, provider: str, ttl: float) -> str:
        t = self._t
        provider = await self.pool.fetchval(
            f"""insert into {t}pins (principal, session_id, provider, expires_at)
            values ($1, $2, $3, now() + make_interval(secs => $4))
            on conflict (principal, session_id) do update set
                provider = case when {t}pins.expires_at <= now()
                                then excluded.provider else {t}pins.provider end,
                expires_at = excluded.expires_at
            returning provider""",
            principal,
            session_id,
            provider,
            ttl,
        )
        return str(provider)

    async def end_session(self, principal: str, session_id: str) -> bool:
        status = await self.pool.execute(
            f"delete from {self._t}pins "
            "where principal = $1 and session_id = $2 and expires_at > now()",
            principal,
            session_id,
        )
        return bool(status == "DELETE 1")

    # -- reads ----------------------------------------------------------------------

    async def recent(self, limit: int, status: str | None) -> list[GenerationInfo]:
        rows = await self.pool.fetch(
            self._sql["info"].replace(
                "where id = $1 and", "where ($1::text is null or status = $1) and"
            )
            + " order by created_at desc limit $2",
            status,
            limit,
        )
        return [info_from_row(row)[0] for row in rows]

    async def info(self, generation_id: str) -> tuple[GenerationInfo, str] | None:
        row = await self.pool.fetchrow(self._sql["info"], generation_id)
        if row is None:
            return None
        return info_from_row(row)

    async def request_cancel(self, generation_id: str) -> bool:
        result = await self.pool.execute(
            f"update {self._t}generations set cancel_requested = true "
            "where id = $1 and status = 'running'",
            generation_id,
        )
        return bool(result != "UPDATE 0")

    async def cancel_requests(self, owner: str) -> list[str]:
        rows = await self.pool.fetch(
            f"select id from {self._t}generations "
            "where status = 'running' and owner = $1 and cancel_requested",
            owner,
        )
        return [row[0] for row in rows]

    async def usage(self, generation_id: str) -> list[bytes]:
        rows = await self.pool.fetch(
            f"select record::text from {self._t}usage where generation_id = $1 order by id",
            generation_id,
        )
        return [row[0].encode() for row in rows]

    async def read(self, generation_id: str, offset: int, limit: int) -> bytes:
        rows = await self.pool.fetch(self._sql["read"], generation_id, offset, 256)
        return join_from(rows, offset, limit)


def _schema(t: str) -> str:
    return f"""
create table if not exists {t}meta (key text primary key, value text not null);
create table if not exists {t}generations (
    id text primary key,
    principal text not null,
    status text not null,
    policy text,
    detached boolean not null default false,
    status_code integer not null,
    content_type text,
    size bigint not null default 0,
    owner text,
    lease_until timestamptz,
    created_at timestamptz not null default now(),
    finished_at timestamptz,
    expires_at timestamptz,
    error text,
    cancel_requested boolean not null default false
);
alter table {t}generations add column if not exists
    cancel_requested boolean not null default false;
alter table {t}generations add column if not exists attempt integer not null default 1;
alter table {t}generations add column if not exists upstream text;
alter table {t}generations add column if not exists continuation bytea;
alter table {t}generations add column if not exists
    record_owed boolean not null default false;
create index if not exists asgi_disconnect_generations_owed
    on {t}generations (lease_until) where record_owed;
create index if not exists asgi_disconnect_generations_lease
    on {t}generations (status, lease_until);
create index if not exists asgi_disconnect_generations_expiry
    on {t}generations (expires_at);
create table if not exists {t}usage (
    id bigserial primary key,
    generation_id text,
    principal text,
    route text not null,
    outcome text not null,
    input_tokens integer,
    output_tokens integer,
    usage_source text not null,
    recorded_at timestamptz not null default now(),
    record jsonb not null,
    request_id text
);
create index if not exists asgi_disconnect_usage_generation on {t}usage (generation_id);
alter table {t}usage add column if not exists request_id text;
create unique index if not exists asgi_disconnect_usage_request on {t}usage (request_id);
create table if not exists {t}claims (
    principal text not null,
    key text not null,
    fingerprint bytea not null,
    owner text not null,
    process text not null,
    status text not null,
    lease_until timestamptz,
    expires_at timestamptz not null,
    response bytea,
    generation_id text,
    primary key (principal, key)
);
create index if not exists asgi_disconnect_claims_expiry on {t}claims (expires_at);
create index if not exists asgi_disconnect_claims_process on {t}claims (process, status);
create index if not exists asgi_disconnect_claims_owner on {t}claims (owner);
create table if not exists {t}chunks (
    generation_id text not null,
    start bigint not null,
    data bytea not null,
    sizes bytea not null,
    primary key (generation_id, start)
);
create table if not exists {t}pins (
    principal text not null,
    session_id text not null,
    provider text not null,
    expires_at timestamptz not null,
    primary key (principal, session_id)
);
create index if not exists asgi_disconnect_pins_expiry on {t}pins (expires_at);
-- A whole flush in one statement, so one round trip: under load the event loop that
-- resumes a flush after each round trip is the bottleneck, not the database. The
-- statements run in order, each seeing the ones before, all in one transaction; a part
-- with nothing to write is skipped.
create or replace function {t}flush(
    c_id text[], c_principal text[], c_policy text[], c_detached boolean[],
    c_status_code int[], c_content_type text[], c_created_at float8[],
    w_owner text, w_lease float8,
    k_id text[], k_start bigint[], k_data bytea[], k_sizes bytea[],
    s_id text[], s_size bigint[],
    h_id text[], h_policy text[], h_detached boolean[],
    u_generation_id text[], u_principal text[], u_route text[], u_outcome text[],
    u_input_tokens int[], u_output_tokens int[], u_source text[], u_record text[],
    u_request_id text[],
    f_id text[], f_status text[], f_size bigint[], f_error text[], f_finished_at float8[],
    f_owed boolean[],
    w_ttl float8, n_channel text, n_payloads text[],
    t_id text[], t_upstream text[], t_continuation bytea[], r_id text[], p_id text[]
) returns text[] language plpgsql as $flush$
declare
    fenced text[] := '{{}}';
begin
    if cardinality(c_id) > 0 then
        insert into {t}generations
            (id, principal, status, policy, detached, status_code, content_type, owner,
             lease_until, created_at)
        select r.id, r.principal, 'running', r.policy, r.detached, r.status_code,
               r.content_type, w_owner, now() + make_interval(secs => w_lease),
               to_timestamp(r.created_at)
        from unnest(c_id, c_principal, c_policy, c_detached, c_status_code, c_content_type,
                    c_created_at)
            as r(id, principal, policy, detached, status_code, content_type, created_at)
        on conflict (id) do nothing;
    end if;
    if cardinality(k_id) > 0 then
        -- Fenced: only the generation's owner appends. The update locks each row first, so
        -- a takeover either waits for this flush or sees the owner changed, and re-checks
        -- the owner on the row's newest version; a generation it skips is another's now.
        with owned as (
            update {t}generations g set size = greatest(g.size, r.size)
            from unnest(s_id, s_size) as r(id, size)
            where g.id = r.id and g.owner = w_owner and g.status = 'running'
            returning g.id
        ), appended as (
            insert into {t}chunks (generation_id, start, data, sizes)
            select k.* from unnest(k_id, k_start, k_data, k_sizes) as k(id, start, data, sizes)
            where k.id in (select id from owned)
            on conflict do nothing
        )
        select coalesce(array_agg(r.id), '{{}}') into fenced
        from unnest(s_id) as r(id) where r.id not in (select id from owned);
    end if;
    if cardinality(t_id) > 0 then
        update {t}generations g set upstream = r.upstream, continuation = r.continuation
        from unnest(t_id, t_upstream, t_continuation) as r(id, upstream, continuation)
        where g.id = r.id and g.owner = w_owner;
    end if;
    if cardinality(r_id) > 0 then
        -- Handed over (a drain): no owner, its lease lapsed, for another replica to take.
        update {t}generations set owner = null, lease_until = now()
        where id = any(r_id) and owner = w_owner and status = 'running';
    end if;
    if cardinality(h_id) > 0 then
        update {t}generations g set policy = r.policy, detached = r.detached
        from unnest(h_id, h_policy, h_detached) as r(id, policy, detached)
        where g.id = r.id and g.owner = w_owner;
    end if;
    if cardinality(u_request_id) > 0 then
        insert into {t}usage (generation_id, principal, route, outcome, input_tokens,
                              output_tokens, usage_source, record, request_id)
        select r.generation_id, r.principal, r.route, r.outcome, r.input_tokens,
               r.output_tokens, r.source, r.record::jsonb, r.request_id
        from unnest(u_generation_id, u_principal, u_route, u_outcome, u_input_tokens,
                    u_output_tokens, u_source, u_record, u_request_id)
            as r(generation_id, principal, route, outcome, input_tokens, output_tokens,
                 source, record, request_id)
        on conflict (request_id) do nothing;
    end if;
    if cardinality(f_id) > 0 then
        update {t}generations g
        set status = r.status, size = r.size, error = r.error,
            finished_at = to_timestamp(r.finished_at),
            expires_at = now() + make_interval(secs => w_ttl), record_owed = r.owed,
            -- A record still owed keeps the lease: the heartbeat renews it till it is paid.
            lease_until = case when r.owed then now() + make_interval(secs => w_lease) end
        from unnest(f_id, f_status, f_size, f_error, f_finished_at, f_owed)
            as r(id, status, size, error, finished_at, owed)
        where g.id = r.id and g.owner = w_owner and g.status = 'running';
    end if;
    if cardinality(p_id) > 0 then
        update {t}generations set record_owed = false, lease_until = null
        where id = any(p_id) and record_owed;
    end if;
    perform pg_notify(n_channel, payload) from unnest(n_payloads) as payload;
    return fenced;
end
$flush$;
"""


def _statements(t: str) -> dict[str, str]:
    flush_args = ", ".join(f"${n}" for n in range(1, 42))
    return {
        "flush": f"select {t}flush({flush_args})",
        "heartbeat": f"""
            with renewed as (
                update {t}generations set lease_until = now() + make_interval(secs => $2)
                where owner = $1 and status = 'running' returning id
            ), owed as (
                -- Ended, their usage record still to be written (see the flush's p_id).
                update {t}generations set lease_until = now() + make_interval(secs => $2)
                where owner = $1 and record_owed
            )
            -- The claims of the generations it runs (taken over ones too) live as long.
            update {t}claims
            set lease_until = greatest(lease_until, now() + make_interval(secs => $2))
            where status = 'running' and generation_id in (select id from renewed)""",
        "sweep": f"""
            update {t}generations
            set status = 'interrupted', finished_at = now(),
                expires_at = now() + make_interval(secs => $1), lease_until = null,
                error = case when continuation is null or not detached
                    then 'its owner stopped renewing its lease'
                    else 'its owner stopped renewing its lease and no replica took it over '
                         '(none has its upstream ' || quote_literal(upstream)
                         || ' registered, or its attempts ran out)' end
            where status = 'running'
              and lease_until < now()
              and (continuation is null or not detached or attempt >= $2
                   or lease_until < now() - make_interval(secs => $3))
            returning id""",
        "lost": f"""
            select id, principal, attempt, size, status_code, content_type, policy,
                   extract(epoch from created_at)::float8, coalesce(continuation, ''::bytea),
                   status, detached
            from {t}generations where id = any($1::text[])""",
        "claim_owed": f"""
            -- Held, not owned: the holder's heartbeat (which renews what its owner owes)
            -- must not keep a mark whose record it failed to make from the next sweep.
            update {t}generations g
            set lease_until = now() + make_interval(secs => $1)
            from (
                select id from {t}generations
                where record_owed and lease_until < now()
                order by lease_until limit $2
                for update skip locked
            ) owed
            where g.id = owed.id
            returning g.id""",
        "take_over": f"""
            update {t}generations g
            set owner = $1, attempt = g.attempt + 1,
                lease_until = now() + make_interval(secs => $2)
            from (
                select id from {t}generations
                where status = 'running' and detached and continuation is not null
                  and upstream = any($4::text[]) and lease_until < now() and attempt < $5
                  -- its own: a heartbeat that came late, not a process that died
                  and owner is distinct from $1
                order by lease_until limit $3
                for update skip locked
            ) as lapsed
            where g.id = lapsed.id
            returning g.id, g.principal, g.attempt, g.size, g.status_code, g.content_type,
                      g.policy, extract(epoch from g.created_at)::float8, g.continuation""",
        "claim": f"""
            insert into {t}claims
                (principal, key, fingerprint, owner, process, status, lease_until, expires_at)
            values ($1, $2, $3, $4, $5, 'running', now() + make_interval(secs => $6),
                    now() + make_interval(secs => $7))
            on conflict (principal, key) do update set
                fingerprint = excluded.fingerprint, owner = excluded.owner,
                process = excluded.process, status = 'running',
                lease_until = excluded.lease_until, expires_at = excluded.expires_at,
                response = null, generation_id = null
            where {t}claims.expires_at < now()
               or ({t}claims.status = 'running' and {t}claims.lease_until < now()
                   and {t}claims.fingerprint = excluded.fingerprint)
            returning owner""",
        "claim_row": f"""
            select status, fingerprint,
                   extract(epoch from lease_until - now())::float8, response, generation_id
            from {t}claims where principal = $1 and key = $2""",
        "complete_claim": f"""
            update {t}claims set status = 'completed', response = $1, generation_id = $2,
                expires_at = now() + make_interval(secs => $3), lease_until = null
            where principal = $4 and key = $5 and owner = $6 and status = 'running'""",
        "release_claim": f"""
            delete from {t}claims
            where principal = $1 and key = $2 and owner = $3 and status = 'running'""",
        "renew_claims": f"""
            update {t}claims set lease_until = now() + make_interval(secs => $2)
            where owner = $1 and status = 'running'""",
        "reap_claims": f"""
            delete from {t}claims where ctid in (
                select ctid from {t}claims where expires_at < now() limit $1)""",
        "expired": f"select id from {t}generations where expires_at < now() limit $1",
        "info": f"""
            select id, status, policy, size, status_code, content_type,
                   extract(epoch from created_at)::float8, extract(epoch from finished_at)::float8,
                   detached, error, principal, attempt, owner
            from {t}generations
            where id = $1 and (expires_at is null or expires_at > now())""",
        "read": f"""
            select start, data from {t}chunks
            where generation_id = $1 and start >= coalesce(
                (select max(start) from {t}chunks where generation_id = $1 and start <= $2), 0)
            order by start limit $3""",
    }


def _columns(rows: Sequence[Sequence[Any]], *indexes: int) -> list[list[Any]]:
    """The rows' fields at ``indexes``, each as the array its ``unnest`` takes."""
    return [[row[i] for row in rows] for i in indexes]


def _flush_arrays(batch: FlushBatch) -> tuple[Any, ...]:
    """A batch as the arguments of asgi_disconnect_flush, but for the notifications."""
    chunks, usage = batch.chunks, batch.usage
    ends = {generation_id: start + len(data) for generation_id, start, data, _ in chunks}
    return (
        *_columns(batch.created, 0, 1, 4, 5, 2, 3, 6),
        batch.owner,
        batch.lease,
        *_columns(chunks, 0, 1, 2, 3),
        list(ends),  # each generation's new end
        list(ends.values()),
        *_columns(batch.changed, 0, 1, 2),
        *_columns(usage, 0, 1, 2, 3, 4, 5, 6),
        [row[7].decode() for row in usage],
        *_columns(usage, 8),
        *_columns(batch.finished, 0, 1, 2, 3, 4, 5),
        batch.ttl,
    )


def _notifications(touched: list[str]) -> list[str]:
    """The generation ids, comma-joined into as few NOTIFY payloads as fit the limit."""
    payloads: list[str] = []
    payload: list[str] = []
    size = 0
    for generation_id in touched:
        if size + len(generation_id) + 1 > _NOTIFY_PAYLOAD and payload:
            payloads.append(",".join(payload))
            payload, size = [], 0
        payload.append(generation_id)
        size += len(generation_id) + 1
    if payload:
        payloads.append(",".join(payload))
    return payloads
