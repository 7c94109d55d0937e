"""Storage backends: one object serves every store of the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ._memory import MemoryBackend

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .._log import Generation, GenerationInfo

__all__ = ["Backend", "MemoryBackend", "connect"]


@runtime_checkable
class Backend(Protocol):
    """Where generations live.

    The middleware hands each live :class:`Generation` to ``register``; appends and the
    final status are recorded on that object without awaiting anything, and a durable
    backend persists them in batches of its own choosing (it pulls from the object).
    Readers go through ``get`` and ``follow``, which must work from any process that
    shares the store.
    """

    url: str

    async def open(self) -> None:
        """Connect and prepare the store; idempotent."""

    async def aclose(self) -> None:
        """Persist what is pending and release connections; idempotent."""

    def register(self, generation: Generation) -> None:
        """Take a new generation; called once, without awaiting, at response start."""

    async def get(self, generation_id: str) -> GenerationInfo | None:
        """The generation's status, or None if it is unknown or expired."""

    async def principal_of(self, generation_id: str) -> str | None:
        """The principal that created the generation, or None if it is unknown."""

    def follow(self, generation_id: str, offset: int) -> AsyncIterator[bytes]:
        """Its bytes from ``offset``, then live until it ends."""


def connect(url: str = "memory://", **options: object) -> Backend:
    """The backend for ``url``: ``memory://`` for now; SQLite and PostgreSQL are planned."""
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise ValueError(f"backend URL needs a scheme such as 'memory://', got {url!r}")
    if scheme == "memory":
        return MemoryBackend(**options)  # type: ignore[arg-type]
    raise ValueError(f"unknown backend URL scheme {scheme!r} in {url!r}; supported: 'memory://'")
