"""Storage backends: one object serves every store of the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .._contract import Backend
from .._errors import BackendUnavailable
from .._options import refuse_unknown
from ._durable import DurableBackend
from ._memory import MemoryBackend

if TYPE_CHECKING:
    import sqlite3
    from collections.abc import Callable

    import asyncpg

__all__ = ["Backend", "BackendUnavailable", "DurableBackend", "MemoryBackend", "connect"]


def connect(
    url: str = "memory://",
    *,
    pool: asyncpg.Pool | None = None,
    schema: str | None = None,
    poll_interval: float | None = None,
    connect_timeout: float | None = None,
    init: Callable[[sqlite3.Connection], object] | None = None,
    **options: Any,
) -> Backend:
    """The backend for ``url``.

    - ``memory://``: this process only, not durable, bounded (``max_bytes``,
      ``max_generations``, ``max_claims``, ``ttl``);
    - ``sqlite:///relative.db`` or ``sqlite:////absolute.db``: the embedded default, safe
      for several worker processes on one machine;
    - ``postgresql://user:password@host/db`` (``?schema=name`` or ``schema=``), or
      ``pool=`` an existing asyncpg pool with ``url="postgresql://"``: several replicas.
      Connecting gives up after ``connect_timeout`` seconds (``?connect_timeout=`` or
      ``connect_timeout=``, default 5); a refused connection fails at once.

    ``init`` (SQLite) is called with the store's ``sqlite3.Connection`` once it is open, on
    the thread that uses it, after the package's pragmas (so one it sets wins) and before
    the schema is made: a pragma, a function, a trace callback. On PostgreSQL, give
    ``pool=`` an asyncpg pool made with its own ``init=``.

    Durable backends take ``flush_interval`` (default 0.05 s), ``max_flush_interval``
    (how far the flush window may grow under load; default four flush intervals, at most
    1 s), ``flush_max_bytes``, ``max_pending_bytes`` (output not yet written, across the
    process, past which producers wait on the store; default 64 MiB), ``lease``,
    ``sweep_interval``, ``ttl`` (default one day) and ``reap_interval``.
    Nothing connects until ``open()`` (the middleware calls it at lifespan startup), which
    raises ``BackendUnavailable`` saying why and what to do if the store cannot be
    opened. A malformed URL or option is a ``ValueError`` at once.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"backend URL needs a scheme such as 'sqlite:///app.db', got {url!r}")
    scheme = scheme.lower()
    if scheme in ("memory", "sqlite", "postgresql", "postgres"):
        target = MemoryBackend if scheme == "memory" else DurableBackend
        refuse_unknown(f"connect({url!r})", options, target)
    if init is not None and scheme != "sqlite":
        raise ValueError(
            f"init= is for SQLite URLs, not {scheme!r}; on PostgreSQL pass pool= an asyncpg "
            "pool made with init="
        )
    if scheme == "memory":
        return MemoryBackend(**options)
    if scheme == "sqlite":
        from ._sqlite import SQLiteStore

        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"SQLite URLs look like 'sqlite:///path/to/file.db', got {url!r}")
        sqlite = SQLiteStore(rest[1:], url=url, poll_interval=poll_interval or 0.05, init=init)
        return DurableBackend(sqlite, **options)
    if scheme in ("postgresql", "postgres"):
        return _postgres_backend(url, pool, schema, poll_interval, connect_timeout, options)
    raise ValueError(
        f"unknown backend URL scheme {scheme!r} in {url!r}; "
        "use 'memory://', 'sqlite:///path.db' or 'postgresql://...'"
    )


def _postgres_backend(
    url: str,
    pool: asyncpg.Pool | None,
    schema: str | None,
    poll_interval: float | None,
    connect_timeout: float | None,
    options: dict[str, Any],
) -> Backend:
    """A PostgreSQL backend for ``url``: its own options (``schema``, ``connect_timeout``)
    taken from the query, the rest left to asyncpg."""
    from ._postgres import PostgresStore, mask_url

    parts = urlsplit(url)
    if parts.netloc.count("@") > 1:
        # asyncpg splits at the first '@', so the rest of the password would be the host.
        raise ValueError(
            f"percent-encode '@' in the user name or password as %40, in {mask_url(url)!r}"
        )
    try:
        bad_port = parts.port == 0
    except ValueError:  # not a number, or past 65535
        bad_port = True
    if bad_port:
        raise ValueError(f"the port must be a number in 1-65535, in {mask_url(url)!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in ("schema", "connect_timeout")}
    schema = schema or ours.get("schema") or "public"
    if connect_timeout is None:
        try:
            connect_timeout = float(ours.get("connect_timeout") or 5.0)
        except ValueError:
            raise ValueError(
                f"connect_timeout must be a number of seconds, in {mask_url(url)!r}"
            ) from None
    # Ours, not asyncpg's, which would send them to the server as settings.
    dsn = urlunsplit(parts._replace(query=urlencode([(k, v) for k, v in query if k not in ours])))
    postgres = PostgresStore(
        None if pool is not None else dsn,
        pool=pool,
        schema=schema,
        poll_interval=poll_interval or 1.0,
        connect_timeout=connect_timeout,
        url=None if pool is not None else url,
    )
    return DurableBackend(postgres, **options)
