"""The demo gateway served on loopback in front of FakeProvider, and headless Chromium."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asgi_disconnect.demo import make_app
from asgi_disconnect.testing import FakeProvider, run_server

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# As a sandboxed machine needs it: no sandbox as root, no calls home.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@dataclass
class Demo:
    url: str
    provider: FakeProvider


@contextlib.contextmanager
def demo_server(tmp_path: Path, **provider: Any) -> Iterator[Demo]:
    """The demo gateway on SQLite, in front of a FakeProvider of its own."""
    with FakeProvider(**provider) as upstream:
        app = make_app(upstream=upstream.url, backend_url=f"sqlite:///{tmp_path / 'demo.db'}")
        with run_server(app) as server:
            yield Demo(server.url, upstream)


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[Demo]:
    with demo_server(tmp_path, tokens=60, tokens_per_second=30) as running:
        yield running


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    """Headless Debian Chromium through Playwright; a missing one fails under CI=true."""
    if shutil.which(CHROMIUM) is None:
        message = f"no Chromium at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            await browser.close()


async def screenshot(page: Any, name: str) -> Path:
    """Save what the page shows as a test artifact."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    await page.screenshot(path=str(path), full_page=True)
    return path
