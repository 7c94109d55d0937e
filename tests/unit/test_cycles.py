"""A request's objects are freed by reference counting when it ends: none waits for the
cyclic garbage collector, which a busy server runs late (its oldest generation rarely), so
cycles hold a burst's memory long after it (the soak saw 200,000 blocks so held)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import disconnect_policy, install
from asgi_disconnect.testing import drive, lifespan

pytestmark = pytest.mark.anyio

EVENT = b'data: {"choices":[{"delta":{"content":"tok "}}]}\n\n'
END = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":20}}\n\ndata: [DONE]\n\n'


async def _events() -> AsyncIterator[bytes]:
    for _ in range(20):
        yield EVENT
        await asyncio.sleep(0)
    yield END


async def chat(request: Request) -> StreamingResponse:
    return StreamingResponse(_events(), media_type="text/event-stream")


@disconnect_policy("detach")
async def report(request: Request) -> StreamingResponse:
    return StreamingResponse(_events(), media_type="text/event-stream")


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
