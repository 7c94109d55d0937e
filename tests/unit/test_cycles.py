"""A request's objects are freed by reference counting when it ends: none waits for the
cyclic garbage collector, which a busy server runs late (its oldest generation rarely), so
cycles hold a burst's memory long after it (the soak saw 200,000 blocks so held)."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from asgi_disconnect import install
from asgi_disconnect.testing import drive, lifespan
from benchmarks.retained import chat, report

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("path", ["/chat", "/report"])
@pytest.mark.parametrize("leave", [None, 300], ids=["read", "leave"])
async def test_a_request_leaves_no_cycle_of_the_packages_objects(
    path: str, leave: int | None, tmp_path: Path
) -> None:
    app = Starlette(
        routes=[Route("/chat", chat, methods=["POST"]), Route("/report", report, methods=["POST"])]
    )
    install(
        app, backend=f"sqlite:///{tmp_path / 'g.db'}", sinks=[lambda record: None], idempotency=True
    )
    async with lifespan(app):
        for i in range(3):  # warm: routes learned, statements prepared
            await drive(
                app, method="POST", path=path, body=b"{}",
                headers=[("authorization", "Bearer a"), ("idempotency-key", f"w{i}")],
            )  # fmt: skip
        await asyncio.sleep(0.3)
        gc.collect()
        gc.disable()
        try:
            for i in range(5):
                await drive(
                    app, method="POST", path=path, body=b"{}", disconnect_after_bytes=leave,
                    headers=[("authorization", "Bearer a"), ("idempotency-key", f"k{i}")],
                )  # fmt: skip
            await asyncio.sleep(0.3)  # detached work ends, its record and claim settle
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            ours = sorted(
                {
                    f"{type(o).__module__}.{type(o).__qualname__}"
                    for o in gc.garbage
                    if type(o).__module__.startswith("asgi_disconnect")
                }
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
    assert ours == []
