"""What a process keeps after many requests: Python's traced memory and its gc-tracked objects
after each round of requests through ``install()`` on SQLite (streams on a cancelling and a
detaching route, a third of the clients leaving mid-stream, every request with an
Idempotency-Key). Flat rounds mean requests leave nothing behind; an RSS that stays at its
peak meanwhile is the allocator keeping its arenas.

    python -m benchmarks.retained --rounds 4 --requests 300
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import tempfile
import tracemalloc
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import disconnect_policy, install
from asgi_disconnect.testing import drive, lifespan

EVENT = b'data: {"choices":[{"delta":{"content":"tok "}}]}\n\n'
END = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":50}}\n\ndata: [DONE]\n\n'


async def _events() -> AsyncIterator[bytes]:
    for _ in range(50):
        yield EVENT
        await asyncio.sleep(0)
    yield END


async def chat(request: Request) -> StreamingResponse:
    return StreamingResponse(_events(), media_type="text/event-stream")


@disconnect_policy("detach")
async def report(request: Request) -> StreamingResponse:
    return StreamingResponse(_events(), media_type="text/event-stream")


async def run(rounds: int, requests: int) -> list[tuple[int, int, int]]:
    logging.getLogger("asgi_disconnect").setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        app = Starlette(
            routes=[Route("/c", chat, methods=["POST"]), Route("/r", report, methods=["POST"])]
        )
        backend = f"sqlite:///{work}/g.db"
        install(app, backend=backend, sinks=[lambda record: None], idempotency=True)
        tracemalloc.start()
        async with lifespan(app):
            for round_ in range(rounds):
                for i in range(requests):
                    headers = [("authorization", "Bearer a"), ("idempotency-key", f"k{round_}-{i}")]
                    leave = 200 if i % 3 == 0 else None
                    await drive(
                        app, method="POST", path="/c" if i % 2 else "/r", headers=headers,
                        body=b"{}", disconnect_after_bytes=leave,
                    )  # fmt: skip
                await asyncio.sleep(1.0)  # detached work ends, the store's flushes land
                gc.collect()
                rows.append((round_ + 1, tracemalloc.get_traced_memory()[0], len(gc.get_objects())))
        tracemalloc.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.retained", description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args(argv)
    for round_, traced, objects in asyncio.run(run(args.rounds, args.requests)):
        print(
            f"after {round_ * args.requests:5d} requests: traced {traced / 2**20:5.2f} MiB, "
            f"{objects} gc-tracked objects"
        )


if __name__ == "__main__":
    main()
