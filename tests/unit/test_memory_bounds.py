"""The memory backend's bounds: bytes and count of finished work, claims, and the RSS they cost."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import textwrap

import pytest

from asgi_disconnect import MemoryBackend, StoredResponse
from asgi_disconnect._log import Generation, Status
from asgi_disconnect._records import ClaimState

pytestmark = pytest.mark.anyio

KIB = 1024
MIB = 1024 * KIB


def generation(number: int, size: int, *, chunk: int = 64 * KIB) -> Generation:
    made = Generation(f"gen_{number:024d}", principal="alice")
    for start in range(0, size, chunk):
        made.append(bytes(min(chunk, size - start)))
    return made


def cost(made: Generation) -> int:
    # The backend counts each chunk's objects too, so many small chunks are not undercounted.
    return made.size + 64 * len(made.chunks)


async def test_finished_generations_are_bounded_by_bytes_oldest_first() -> None:
    backend = MemoryBackend(max_bytes=1 * MIB)
    made = []
    for number in range(10):
        one = generation(number, 300 * KIB)
        backend.register(one)
        one.finish(Status.COMPLETE)
        made.append(one)
        assert backend.kept_bytes <= 1 * MIB
    kept = [one for one in made if await backend.get(one.id) is not None]
    # The newest three fit (3 x 300 KiB and their chunks); every older one was evicted.
    assert kept == made[-3:]
    assert backend.kept_bytes == sum(map(cost, kept))
    assert len(backend) == 3


async def test_running_generations_are_never_evicted_nor_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = MemoryBackend(max_bytes=1 * MIB)
    finished = generation(0, 512 * KIB)
    backend.register(finished)
    finished.finish(Status.COMPLETE)
    running = [generation(number, 2 * MIB) for number in range(1, 4)]
    for one in running:
        backend.register(one)
    # Running ones hold 6 MiB, past the bound: all stay, and so does what finished within it.
    assert all([await backend.get(one.id) is not None for one in running])
    assert await backend.get(finished.id) is not None
    assert backend.kept_bytes == cost(finished)
    # One larger than the bound is not kept once it ends, and a warning says why.
    running[0].finish(Status.COMPLETE)
    assert await backend.get(running[0].id) is None
    assert await backend.get(finished.id) is not None
    assert "larger than max_bytes" in caplog.text
    # A reader that was following it reads it to the end.
    following = running[1].follow(0)
    first = await anext(following)
    running[1].append(b"tail")
    running[1].finish(Status.COMPLETE)
    rest = b"".join([data async for data in following])
    assert len(first + rest) == 2 * MIB + 4
    assert await backend.get(running[1].id) is None
    assert backend.kept_bytes == cost(finished)
    assert await backend.get(running[2].id) is not None


async def test_max_generations_still_bounds_the_count() -> None:
    backend = MemoryBackend(max_generations=5)
    made = [generation(number, 10) for number in range(20)]
    for one in made:
        backend.register(one)
        one.finish(Status.COMPLETE)
        assert len(backend) <= 5
    assert [await backend.get(one.id) is not None for one in made[-5:]] == [True] * 5


async def test_finished_generations_past_their_ttl_are_dropped_when_others_end() -> None:
    backend = MemoryBackend(ttl=0.05)
    old = generation(0, 100 * KIB)
    backend.register(old)
    old.finish(Status.COMPLETE)
    await asyncio.sleep(0.1)  # its ttl runs out: time passing is what is tested
    new = generation(1, 10)
    backend.register(new)
    new.finish(Status.COMPLETE)
    assert backend.kept_bytes == cost(new)
    assert len(backend) == 1


def stored(size: int) -> StoredResponse:
    return StoredResponse(status=200, headers=[], chunks=[bytes(size)])


async def test_completed_claims_count_in_the_byte_bound() -> None:
    backend = MemoryBackend(max_bytes=1 * MIB)
    for number in range(8):
        key = f"k{number}"
        claim = await backend.claim("alice", key, b"fp", owner=key, lease=10, ttl=60)
        assert claim.state is ClaimState.ACQUIRED
        assert await backend.complete_claim(
            "alice", key, owner=key, response=stored(300 * KIB), ttl=60
        )
        assert backend.kept_bytes <= 1 * MIB
    states = [
        (await backend.claim("alice", f"k{n}", b"fp", owner="x", lease=10, ttl=60)).state
        for n in range(5, 8)
    ]
    assert states == [ClaimState.COMPLETED] * 3
    # The oldest were evicted: a retry of k0 runs again.
    again = await backend.claim("alice", "k0", b"fp", owner="x", lease=10, ttl=60)
    assert again.state is ClaimState.ACQUIRED


async def test_claims_are_bounded_oldest_completed_first_never_running_ones() -> None:
    backend = MemoryBackend(max_claims=10)
    for number in range(5):
        await backend.claim("alice", f"run{number}", b"fp", owner="r", lease=60, ttl=600)
    for number in range(30):
        key = f"done{number}"
        await backend.claim("alice", key, b"fp", owner=key, lease=60, ttl=600)
        await backend.complete_claim("alice", key, owner=key, response=stored(1), ttl=600)
        assert backend.claim_count <= 10
    for number in range(5):
        # Still held: a retry is told it runs elsewhere.
        held = await backend.claim("alice", f"run{number}", b"fp", owner="x", lease=60, ttl=600)
        assert held.state is ClaimState.RUNNING
    newest = await backend.claim("alice", "done29", b"fp", owner="x", lease=60, ttl=600)
    assert newest.state is ClaimState.COMPLETED
    # Running claims alone past the bound are all kept.
    for number in range(20):
        await backend.claim("bob", f"run{number}", b"fp", owner="r", lease=60, ttl=600)
    assert backend.claim_count == 25
    held = await backend.claim("bob", "run0", b"fp", owner="x", lease=60, ttl=600)
    assert held.state is ClaimState.RUNNING


async def test_expired_claims_are_evicted() -> None:
    backend = MemoryBackend()
    for number in range(50):
        key = f"k{number}"
        await backend.claim("alice", key, b"fp", owner=key, lease=60, ttl=0.05)
        await backend.complete_claim("alice", key, owner=key, response=stored(KIB), ttl=0.05)
    assert backend.claim_count == 50
    assert backend.kept_bytes > 50 * KIB
    await asyncio.sleep(0.1)  # their ttl runs out: time passing is what is tested
    await backend.claim("alice", "fresh", b"fp", owner="f", lease=60, ttl=60)
    assert backend.claim_count == 1
    assert backend.kept_bytes == 0


def test_bad_bounds_are_refused() -> None:
    for options in ({"max_bytes": 0}, {"max_claims": 0}, {"max_generations": 0}, {"ttl": 0}):
        with pytest.raises(ValueError, match="must be positive"):
            MemoryBackend(**options)  # type: ignore[arg-type]


def test_the_default_bound_is_64_mib() -> None:
    assert MemoryBackend().max_bytes == 64 * MIB


# The process's resident memory while big responses go through install()'s default backend,
# in a process of its own so that no other test's heap is measured. The client discards
# what it receives, as a socket would.
_RSS_SCRIPT = textwrap.dedent(
    """
    import asyncio, ctypes, gc, json, os, sys

    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    from asgi_disconnect import MemoryBackend, install

    PAGE = os.sysconf("SC_PAGE_SIZE")
    BIG, CHUNK = 50 << 20, 64 << 10

    try:
        # glibc keeps freed pages for reuse; trimming them leaves what is still referenced.
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        trim = lambda pad: None

    def rss():
        gc.collect()
        trim(0)
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE

    async def big(request):
        async def body():
            for _ in range(BIG // CHUNK):
                yield b"d" * CHUNK  # written, so its pages are resident
        return StreamingResponse(body(), media_type="text/event-stream")

    async def small(request):
        return StreamingResponse(iter([b"data: x\\n\\n"]), media_type="text/event-stream")

    async def call(app, path):
        sent = []
        requested = False
        done = asyncio.Event()
        async def receive():
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": b"", "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}
        async def send(message):
            if message["type"] == "http.response.body":
                sent.append(len(message.get("body", b"")))
                if not message.get("more_body", False):
                    done.set()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
                 "http_version": "1.1", "method": "GET", "scheme": "http", "path": path,
                 "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"authorization", b"Bearer alice")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        return sum(sent)

    async def main():
        max_bytes = json.loads(sys.argv[1])
        app = Starlette(routes=[Route("/big", big), Route("/small", small)])
        install(app, backend=None if max_bytes is None else MemoryBackend(max_bytes=max_bytes))
        for _ in range(3):
            await call(app, "/small")
        baseline = rss()
        peak = 0
        for _ in range(int(sys.argv[2])):
            assert await call(app, "/big") == BIG
            peak = max(peak, rss())
        for _ in range(3):
            await call(app, "/small")
        print(json.dumps({"baseline": baseline, "peak": peak, "after": rss()}))

    asyncio.run(main())
    """
)


def measure_rss(max_bytes: int | None, responses: int = 6) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, json.dumps(max_bytes), str(responses)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    figures: dict[str, int] = json.loads(done.stdout.splitlines()[-1])
    logging.getLogger("tests").info("RSS (MiB): %s", {k: v / MIB for k, v in figures.items()})
    return figures


def test_rss_returns_near_its_baseline_once_big_responses_are_evicted() -> None:
    # Each 50 MiB response is over a 16 MiB bound, so none is kept after it ends.
    figures = measure_rss(16 * MIB)
    assert figures["after"] - figures["baseline"] < 24 * MIB
    # Nothing accumulates from one response to the next.
    assert figures["peak"] - figures["baseline"] < 160 * MIB


def test_rss_with_the_default_backend_stays_within_its_bound() -> None:
    # Six 50 MiB responses: the newest fits the default 64 MiB and is kept; no more.
    figures = measure_rss(None)
    assert figures["after"] - figures["baseline"] < (64 + 16) * MIB
