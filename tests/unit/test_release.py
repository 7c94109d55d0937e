"""On a durable backend, memory keeps only what is not yet durable or not yet delivered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from asgi_disconnect import DurableBackend, Status, UsageRecord, connect, install
from asgi_disconnect._contract import RequestState
from asgi_disconnect._log import Generation, Released
from asgi_disconnect.testing import drive
from asgi_disconnect.testing._driver import lifespan
from tests.apps import eventually, http_scope, request_then_disconnect

pytestmark = pytest.mark.anyio

AUTH = ("authorization", "Bearer alice")
KIB = 1024


async def flushed(backend: DurableBackend) -> None:
    while await backend.flush():
        pass


def resident(generation: Generation) -> int:
    """The generation's bytes still held in memory."""
    return sum(map(len, generation.chunks))


class Client:
    delivered_bytes = 0


async def test_what_is_durable_and_delivered_is_released(tmp_path: Path) -> None:
    backend = connect(f"sqlite:///{tmp_path}/g.db", flush_interval=1)
    assert isinstance(backend, DurableBackend)
    await backend.open()
    try:
        generation = Generation("gen_" + "A" * 24, principal="alice")
        client = Client()
        generation.reader = client
        backend.register(generation)
        parts = [b"part %03d;" % n for n in range(100)]
        for part in parts[:50]:
            generation.append(part)
        await flushed(backend)
        # Durable, but the client has none of it yet: all of it stays.
        assert generation.base == 0
        assert resident(generation) == generation.size
        client.delivered_bytes = 25 * len(parts[0]) + 3  # inside the 26th chunk
        for part in parts[50:60]:
            generation.append(part)
        await flushed(backend)
        # Whole chunks the client has and the store has: released; the one it is inside stays.
        assert generation.base == 25 * len(parts[0])
        assert resident(generation) == generation.size - generation.base
        with pytest.raises(Released, match="read them from the store"):
            generation.read(0)
        # The producing process still serves any offset: the store below base, memory above.
        follow = backend.follow(generation.id, 7)
        first = await follow.__anext__()
        assert len(first) >= generation.base - 7
        assert first == b"".join(parts[:60])[7 : 7 + len(first)]
        await follow.aclose()
        # Once the work detached, the client is gone: what is durable goes.
        generation.detached = True
        for part in parts[60:]:
            generation.append(part)
        await flushed(backend)
        assert generation.base == generation.size
        assert resident(generation) == 0
        generation.finish(Status.COMPLETE)
        whole = b"".join(parts)
        assert b"".join([data async for data in backend.follow(generation.id, 0)]) == whole
        await flushed(backend)
        assert b"".join([data async for data in backend.follow(generation.id, 3)]) == whole[3:]
    finally:
        await backend.aclose()


def producing_app(
    parts: list[bytes], peaks: dict[str, int], started: asyncio.Event | None = None
) -> Starlette:
    from asgi_disconnect import disconnect_policy

    @disconnect_policy("detach")
    async def produce(request: Request) -> StreamingResponse:
        state = request.scope["asgi_disconnect"]
        assert isinstance(state, RequestState)

        async def body() -> AsyncIterator[bytes]:
            for part in parts:
                yield part
                generation = state.generation
                assert generation is not None
                peaks["resident"] = max(peaks.get("resident", 0), resident(generation))
                if state.detached:
                    peaks["detached"] = max(peaks.get("detached", 0), resident(generation))
                if started is not None:
                    started.set()
                await asyncio.sleep(0.002)

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/produce", produce, methods=["POST"])])


async def test_a_stream_through_install_keeps_little_in_memory(tmp_path: Path) -> None:
    parts = [b"data: " + b"x" * (4 * KIB) + b"\n\n" for _ in range(300)] + [b"data: [DONE]\n\n"]
    whole = b"".join(parts)
    peaks: dict[str, int] = {}
    records: list[UsageRecord] = []
    app = producing_app(parts, peaks)
    backend = connect(f"sqlite:///{tmp_path}/g.db", flush_interval=0.02)
    install(app, backend=backend, sinks=[records.append], idempotency=True)
    async with lifespan(app):
        result = await drive(
            app, method="POST", path="/produce", headers=[AUTH, ("idempotency-key", "k1")]
        )
        assert result.body == whole
        await eventually(lambda: records)
        # About a flush interval of output, never the 1.2 MB of the stream.
        assert peaks["resident"] < len(whole) // 4
        replay = await drive(
            app, method="POST", path="/produce", headers=[AUTH, ("idempotency-key", "k1")]
        )
        assert replay.header("idempotent-replayed") == "true"
        assert replay.body == whole
    assert [record.outcome for record in records] == ["complete"]


async def test_detached_work_is_released_resumed_whole_and_replayed_whole(
    tmp_path: Path,
) -> None:
    parts = [b"data: %04d " % n + b"y" * 2000 + b"\n\n" for n in range(400)] + [b"data: [DONE]\n\n"]
    whole = b"".join(parts)
    peaks: dict[str, int] = {}
    records: list[UsageRecord] = []
    app = producing_app(parts, peaks)
    backend = connect(f"sqlite:///{tmp_path}/g.db", flush_interval=0.02)
    install(app, backend=backend, sinks=[records.append], idempotency=True)
    headers = [AUTH, ("idempotency-key", "k2")]
    async with lifespan(app):
        cut = await drive(
            app, method="POST", path="/produce", headers=headers, disconnect_after_bytes=50 * KIB
        )
        assert cut.disconnected
        generation_id = cut.header("x-generation-id")
        assert generation_id is not None
        # While it runs detached, a resume from 0 on this replica reads the store, then memory.
        resumed = await drive(
            app, path=f"/generations/{generation_id}/stream", headers=[AUTH], timeout=30
        )
        assert resumed.body == whole
        info = msgspec.json.decode(
            (await drive(app, path=f"/generations/{generation_id}", headers=[AUTH])).body
        )
        assert info["status"] == "complete"
        # Nobody read it as it ran: memory held about a flush interval of it, not all.
        assert peaks["detached"] < len(whole) // 4
        await eventually(lambda: records)
        # The idempotent response was read back from the store, whole.
        replay = await drive(app, method="POST", path="/produce", headers=headers)
        assert replay.header("idempotent-replayed") == "true"
        assert replay.body == whole
    assert len(records) == 1
    assert records[0].outcome == "complete"
    assert records[0].delivered_bytes < len(whole)


class Gate:
    """Where every stream waits, and how many arrived."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.arrived = 0

    async def wait(self) -> None:
        self.arrived += 1
        await self.open.wait()


async def held_per_stream(app: Starlette, streams: int, gate: Gate) -> int:
    """Bytes allocated and still held per stream while ``streams`` wait at ``gate``."""
    import gc
    import tracemalloc

    async def one() -> None:
        finished = asyncio.Event()
        receive = request_then_disconnect(finished)

        async def send(message: dict[str, object]) -> None:
            pass  # a client that keeps up and keeps nothing

        scope = http_scope("/stream", headers=[(b"authorization", b"Bearer alice")])
        await app(scope, receive, send)
        finished.set()

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        tasks = [asyncio.ensure_future(one()) for _ in range(streams)]
        await eventually(lambda: gate.arrived >= streams)
        await asyncio.sleep(0.3)  # a few flush intervals
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
        gate.open.set()
    await asyncio.gather(*tasks)
    held = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return held // streams


def gated_app(gate: Gate) -> Starlette:
    async def stream(request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            for n in range(200):
                if n == 180:
                    await gate.wait()
                yield b"data: " + b"z" * 1000 + b"%04d\n\n" % n  # new bytes each time
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    return Starlette(routes=[Route("/stream", stream)])


async def test_a_running_stream_holds_little_beyond_what_the_bare_app_holds(
    tmp_path: Path,
) -> None:
    """Through install() on SQLite, 40 streams of 200 KB paused at 90%: what each holds
    beyond the bare app is its requests' state, not its output (180 KB by then)."""
    gate = Gate()
    bare = await held_per_stream(gated_app(gate), 40, gate)
    gate = Gate()
    app = gated_app(gate)
    install(app, backend=connect(f"sqlite:///{tmp_path}/g.db", flush_interval=0.02))
    async with lifespan(app):
        wrapped = await held_per_stream(app, 40, gate)
    assert wrapped - bare < 40 * KIB, (bare, wrapped)
