"""Storage backends: one object serves every store of the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .._contract import Backend
from ._durable import BackendUnavailable, DurableBackend
from ._memory import MemoryBackend

if TYPE_CHECKING:
    import asyncpg

__all__ = ["Backend", "BackendUnavailable", "DurableBackend", "MemoryBackend", "connect"]


def connect(
    url: str = "memory://",
    *,
    pool: asyncpg.Pool | None = None,
    schema: str | None = None,
    poll_interval: float | None = None,
    **options: Any,
) -> Backend:
    """The backend for ``url``.

    - ``memory://``: this process only, not durable (``ttl``, ``max_generations``);
    - ``sqlite:///relative.db`` or ``sqlite:////absolute.db``: the embedded default, safe
      for several worker processes on one machine;
    - ``postgresql://user:password@host/db`` (``?schema=name`` or ``schema=``), or
      ``pool=`` an existing asyncpg pool with ``url="postgresql://"``: several replicas.

    Durable backends take ``flush_interval`` (default 0.05 s), ``flush_max_bytes``,
    ``lease``, ``sweep_interval``, ``ttl`` (default one day) and ``reap_interval``.
    Nothing connects until ``open()`` (the middleware calls it at lifespan startup).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"backend URL needs a scheme such as 'sqlite:///app.db', got {url!r}")
    scheme = scheme.lower()
    if scheme == "memory":
        return MemoryBackend(**options)
    if scheme == "sqlite":
        from ._sqlite import SQLiteStore

        if not rest.startswith("/") or rest == "/":
            raise ValueError(f"SQLite URLs look like 'sqlite:///path/to/file.db', got {url!r}")
        sqlite = SQLiteStore(rest[1:], url=url, poll_interval=poll_interval or 0.05)
        return DurableBackend(sqlite, **options)
    if scheme in ("postgresql", "postgres"):
        from ._postgres import PostgresStore

        parts = urlsplit(url)
        query = parse_qsl(parts.query, keep_blank_values=True)
        schema = schema or next((v for k, v in query if k == "schema"), None) or "public"
        dsn = urlunsplit(
            parts._replace(query=urlencode([(k, v) for k, v in query if k != "schema"]))
        )
        postgres = PostgresStore(
            None if pool is not None else dsn,
            pool=pool,
            schema=schema,
            poll_interval=poll_interval or 1.0,
        )
        return DurableBackend(postgres, **options)
    raise ValueError(
        f"unknown backend URL scheme {scheme!r} in {url!r}; "
        "use 'memory://', 'sqlite:///path.db' or 'postgresql://...'"
    )
