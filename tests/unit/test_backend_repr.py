"""A backend reads as what it is in a log line or a debugger: its URL (a password masked),
whether it is open, and the settings an operator asks about first."""

from __future__ import annotations

from pathlib import Path

import pytest

from asgi_disconnect import DisconnectMiddleware, connect
from asgi_disconnect.testing import drive
from tests.apps import Probe, sse_app

pytestmark = pytest.mark.anyio


async def test_a_durable_backend_shows_its_url_its_state_and_its_timings(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    backend = connect(url, ttl=600)
    assert repr(backend) == (
        f"<DurableBackend {url} (not open): flush_interval=0.05s lease=15s ttl=600s>"
    )
    async with backend:  # type: ignore[attr-defined]
        assert repr(backend).startswith(f"<DurableBackend {url} (open): ")


def test_a_postgresql_password_never_shows() -> None:
    backend = connect("postgresql://app:s3cret@db.internal/llm")
    assert repr(backend).startswith("<DurableBackend postgresql://app:***@db.internal/llm ")
    assert "s3cret" not in repr(backend)


async def test_a_memory_backend_shows_what_it_keeps() -> None:
    backend = connect("memory://", max_bytes=1 << 20)
    assert repr(backend) == (
        "<MemoryBackend memory://: 0 generation(s), 0 claim(s), 0 of 1048576 bytes kept, ttl=3600s>"
    )
    app = DisconnectMiddleware(sse_app(Probe(), chunks=3, delay=0), backend=backend)
    await drive(app, path="/detach")
    assert repr(backend).startswith("<MemoryBackend memory://: 1 generation(s), 0 claim(s), ")
