"""A detached generation outlives its process: two real uvicorn replicas on one store, the
owner SIGKILLed (or partitioned, or drained) mid-generation, and the other replica takes it
over and finishes the same answer, stitched into the same log, through ``install()``.

Each reader reads the whole generation back from the replica that finished it and checks it
against the deterministic answer of the FakeProvider (token i is ``f"tok{i} "``): a
Responses stream byte for byte against an uninterrupted run (the provider's ids and
timestamps aside), the prefill kinds by their text, each with exactly one terminal marker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from asgi_disconnect import connect
from asgi_disconnect.testing import FakeProvider, request
from tests.apps import TESTER
from tests.integration.processes import serve

pytestmark = [pytest.mark.anyio, pytest.mark.server]

LEASE = 1.0
TOKENS = 120
RATE = 60.0  # tokens per second: a two-second generation
FULL_TEXT = "".join(f"tok{i} " for i in range(TOKENS))
HEADERS = {"x-fake-tokens": str(TOKENS), "x-fake-rate": str(RATE)}


def replica(
    url: str, provider: FakeProvider, **env: str
) -> contextlib.AbstractContextManager[tuple[str, subprocess.Popen[bytes]]]:
    return serve(
        "benchmarks._takeover_app:app",
        {
            "ASGI_DISCONNECT_URL": url,
            "ASGI_DISCONNECT_PROVIDER": provider.url,
            "ASGI_DISCONNECT_LEASE": str(LEASE),
            "ASGI_DISCONNECT_FAST": "1",
            "ASGI_DISCONNECT_PRINCIPAL": TESTER,
            **env,
        },
    )


def body_of(kind: str) -> bytes:
    if kind == "responses":
        return json.dumps(
            {"model": "fake-model", "input": "Write the report.", "stream": True}
        ).encode()
    if kind == "prefill":
        return json.dumps(
            {
                "model": "fake-model",
                "max_tokens": 4096,
                "stream": True,
                "messages": [{"role": "user", "content": "Write the report."}],
            }
        ).encode()
    return json.dumps(
        {
            "model": "fake-model",
            "stream": True,
            "messages": [{"role": "user", "content": "Write the report."}],
        }
    ).encode()


def events(stream: bytes) -> Iterator[tuple[str | None, Any]]:
    """(event name, decoded data) of each event; ``[DONE]`` as the string."""
    for frame in stream.split(b"\n\n"):
        if not frame.strip():
            continue
        name = None
        data = []
        for line in frame.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data.append(line[5:].strip())
        raw = b"\n".join(data)
        yield name, raw.decode() if raw == b"[DONE]" else json.loads(raw)


def text_of(kind: str, stream: bytes) -> str:
    parts: list[str] = []
    for name, data in events(stream):
        if kind in ("continue_final_message", "restart") and isinstance(data, dict):
            for choice in data.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
        elif kind == "prefill" and name == "content_block_delta":
            parts.append(data["delta"].get("text", ""))
        elif kind == "responses" and name == "response.output_text.delta":
            parts.append(data["delta"])
    return "".join(parts)


def terminal_markers(kind: str, stream: bytes) -> int:
    if kind in ("continue_final_message", "restart"):
        return sum(data == "[DONE]" for _, data in events(stream))
    if kind == "prefill":
        return sum(name == "message_stop" for name, _ in events(stream))
    return sum(name == "response.completed" for name, _ in events(stream))


_IDS = re.compile(rb'"(resp|msg)_[A-Za-z0-9_]+"|"created_at":\d+(\.\d+)?')


def normalised(stream: bytes) -> bytes:
    """A Responses stream without what differs between two runs: its ids and timestamps."""
    return _IDS.sub(b'"~"', stream)


def reference_id(stream: bytes) -> str:
    """The response id a Responses stream names."""
    for name, data in events(stream):
        if name == "response.created":
            return str(data["response"]["id"])
    raise AssertionError("no response.created event")


async def info(base: str, generation_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{base}/generations/{generation_id}")
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


async def read_whole(base: str, generation_id: str, offset: int = 0) -> bytes:
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream(
            "GET", f"{base}/generations/{generation_id}/stream", params={"offset": offset}
        ) as live,
    ):
        assert live.status_code == 200
        return b"".join([chunk async for chunk in live.aiter_raw()])


async def start(base: str, kind: str) -> str:
    """A detached generation: its client reads the first bytes and leaves."""
    started = await request(
        f"{base}/relay/{kind}",
        method="POST",
        headers={"content-type": "application/json", **HEADERS},
        body=body_of(kind),
        disconnect_after_bytes=1,
    )
    assert started.status == 200, started.body
    return started.headers["x-generation-id"]


async def until(predicate: Any, timeout: float, interval: float = 0.05) -> None:
    async with asyncio.timeout(timeout):
        while not await predicate():
            await asyncio.sleep(interval)


async def until_stored(base: str, generation_id: str, size: float) -> None:
    """Until the store holds at least ``size`` bytes of the generation (read at ``base``)."""

    async def stored() -> bool:
        return int((await info(base, generation_id))["size"]) >= size

    await until(stored, 10)


async def until_taken_over(base: str, generation_id: str) -> None:
    """Until another replica owns the generation as its second attempt."""

    async def taken_over() -> bool:
        return int((await info(base, generation_id)).get("attempt", 1)) == 2

    await until(taken_over, LEASE + 5)


async def uninterrupted(base: str, kind: str) -> bytes:
    generation_id = await start(base, kind)
    whole = await read_whole(base, generation_id)
    assert (await info(base, generation_id))["status"] == "complete"
    return whole


async def usage(url: str, generation_id: str) -> list[Any]:
    backend = connect(url)
    await backend.open()
    try:
        return await backend.usage_of(generation_id)
    finally:
        await backend.aclose()


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider(tokens=TOKENS, tokens_per_second=RATE) as fake:
        yield fake


KINDS = ["responses", "continue_final_message", "prefill"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("at", [0.3, 0.7])
async def test_a_killed_owners_generation_is_finished_by_the_other_replica(
    kind: str, at: float, postgres_url: str, provider: FakeProvider
) -> None:
    with replica(postgres_url, provider) as (a, owner), replica(postgres_url, provider) as (b, _):
        reference = await uninterrupted(b, kind)
        generation_id = await start(a, kind)

        await until_stored(b, generation_id, at * len(reference))
        owner.kill()
        owner.wait()
        killed_at = time.monotonic()
        kept = int((await info(b, generation_id))["size"])

        await until_taken_over(b, generation_id)
        delay = time.monotonic() - killed_at
        whole = await read_whole(b, generation_id)
        final = await info(b, generation_id)
        # A reader that had the first bytes comes back with its offset.
        rest = await read_whole(b, generation_id, kept // 2)
    print(f"{kind} killed at {at:.0%}: taken over {delay * 1000:.0f} ms after the kill")
    assert delay < LEASE + 2.0
    assert final["status"] == "complete", final
    assert whole[kept // 2 :] == rest
    assert terminal_markers(kind, whole) == 1
    assert text_of(kind, whole) == FULL_TEXT
    if kind == "responses":
        assert normalised(whole) == normalised(reference)
    records = {record.attempt: record for record in await usage(postgres_url, generation_id)}
    assert sorted(records) == [1, 2]  # one record per upstream call
    lost, finished = records[1], records[2]
    # The killed attempt's record, written by the replica that took over: estimated.
    assert lost.outcome == "interrupted"
    assert lost.usage_source == "estimated"
    assert lost.error_type == "owner_lost"
    assert finished.outcome == "complete"
    assert finished.usage_source == "provider"
    if kind == "responses":
        # The provider bills the background response once: the attempt that finished it
        # carries all of it, and nothing was generated twice.
        assert lost.output_tokens == 0
        assert finished.output_tokens == TOKENS
        assert provider.output_tokens(reference_id(whole)) == TOKENS
    else:
        # The continuation's input is the prompt plus the stored prefix, as billed.
        assert finished.input_tokens is not None
        assert finished.output_tokens is not None
        assert finished.input_tokens > provider.input_tokens
        assert finished.output_tokens < TOKENS


class Partition:
    """A TCP proxy in front of PostgreSQL, on a thread of its own, that can stop carrying
    bytes, both ways, while every connection stays open: a replica behind it is alive but
    cut off from the store."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._ready = threading.Event()
        self._writers: list[asyncio.StreamWriter] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Partition:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def cut(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._open.set()
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        for writer in self._writers:
            writer.transport.abort()
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._loop.run_until_complete(server.wait_closed())
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(
            "127.0.0.1", self.target_port
        )
        self._writers += [writer, upstream_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await source.read(65536):
                    await self._open.wait()
                    sink.write(data)
                    await sink.drain()
            sink.close()

        await asyncio.gather(
            pipe(reader, upstream_writer), pipe(upstream_reader, writer), return_exceptions=True
        )


def through(url: str, port: int) -> str:
    return re.sub(r"@[^/]+/", f"@127.0.0.1:{port}/", url, count=1)


async def test_a_partitioned_owner_is_fenced_and_the_other_replica_finishes(
    postgres_url: str,
) -> None:
    """The owner's database connections stop carrying bytes while it lives and relays on;
    the other replica takes the generation over; when the owner's connections come back,
    its flush is refused (not one byte more) and it stops its upstream call."""
    port = int(re.search(r"@[^:/]+:(\d+)/", postgres_url).group(1))  # type: ignore[union-attr]
    kind = "continue_final_message"
    with (
        FakeProvider(tokens=TOKENS, tokens_per_second=20.0) as provider,
        Partition(port) as partition,
        replica(through(postgres_url, partition.port), provider) as (a, _),
        replica(postgres_url, provider) as (b, _),
    ):
        generation_id = await start(a, kind)

        await until_stored(b, generation_id, 1001)
        partition.cut()

        await until_taken_over(b, generation_id)
        partition.heal()
        whole = await read_whole(b, generation_id)
        final = await info(b, generation_id)
        owners_call = provider.requests[0]
        # Fenced: the owner stopped its own upstream call before it finished.
        assert await owners_call.await_closed(10)
    assert final["status"] == "complete", final
    assert owners_call.connection_closed_early
    assert owners_call.tokens_generated < TOKENS
    assert terminal_markers(kind, whole) == 1
    assert text_of(kind, whole) == FULL_TEXT


async def test_a_drain_hands_a_detached_report_over_instead_of_interrupting_it(
    postgres_url: str,
) -> None:
    """A rolling restart: the owner's shutdown deadline (0.5 s) is shorter than the report
    (6 s); the report is handed over, finished by the other replica, and nothing is
    interrupted."""
    kind = "prefill"
    with FakeProvider(tokens=TOKENS, tokens_per_second=20.0) as provider:
        with (
            replica(postgres_url, provider, ASGI_DISCONNECT_DRAIN="0.5") as (a, owner),
            replica(postgres_url, provider) as (b, _),
        ):
            generation_id = await start(a, kind)

            await until_stored(b, generation_id, 501)
            stopping_at = time.monotonic()
            owner.terminate()
            owner.wait(30)
            whole = await read_whole(b, generation_id)
            final = await info(b, generation_id)
            took = time.monotonic() - stopping_at
        records = await usage(postgres_url, generation_id)
    print(f"handed over and finished {took:.1f} s after the owner began to stop")
    assert final["status"] == "complete", final
    assert final["attempt"] == 2
    assert terminal_markers(kind, whole) == 1
    assert text_of(kind, whole) == FULL_TEXT
    assert sorted(record.attempt for record in records) == [1, 2]
    first = next(record for record in records if record.attempt == 1)
    assert first.outcome == "interrupted"
    assert (first.stopped_by, first.policy) == ("handover", "detach")


async def test_on_sqlite_a_restarted_process_finishes_its_files_generation(
    sqlite_url: str, provider: FakeProvider
) -> None:
    kind = "continue_final_message"
    with replica(sqlite_url, provider) as (a, owner):
        generation_id = await start(a, kind)

        await until_stored(a, generation_id, 1001)
        owner.kill()
        owner.wait()
    with replica(sqlite_url, provider) as (again, _):
        await until_taken_over(again, generation_id)
        whole = await read_whole(again, generation_id)
        final = await info(again, generation_id)
    assert final["status"] == "complete", final
    assert terminal_markers(kind, whole) == 1
    assert text_of(kind, whole) == FULL_TEXT
    records = await usage(sqlite_url, generation_id)
    assert sorted(record.attempt for record in records) == [1, 2]
    command = [sys.executable, "-m", "asgi_disconnect._cli", "generations", "list"]
    listed = await asyncio.create_subprocess_exec(
        *command, "--backend", sqlite_url, stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await listed.communicate()
    assert listed.returncode == 0
    lines = stdout.decode().splitlines()
    (line,) = [line for line in lines if generation_id in line]
    columns = dict(zip(re.split(r"\s{2,}", lines[0]), re.split(r"\s{2,}", line), strict=True))
    assert columns["STATUS"] == "complete"
    assert columns["ATTEMPT"] == "2"
    assert re.fullmatch(r"[0-9a-f]{16}", columns["OWNER"])  # the process that finished it


async def test_a_refused_prefill_without_a_fallback_ends_interrupted_with_the_reason(
    postgres_url: str,
) -> None:
    """The model refuses prefill and the route chose no fallback: the generation ends
    interrupted with the provider's reason, in one log line and one record."""
    kind = "prefill"
    with FakeProvider(tokens=TOKENS, tokens_per_second=RATE) as provider:
        with (
            replica(postgres_url, provider) as (a, owner),
            replica(postgres_url, provider) as (b, _),
        ):
            generation_id = await start(a, kind)

            await until_stored(b, generation_id, 501)
            provider.prefill_refused_models = {"fake-model"}
            owner.kill()
            owner.wait()

            async def ended() -> bool:
                return (await info(b, generation_id))["status"] != "running"

            await until(ended, LEASE + 5)
            final = await info(b, generation_id)
        records = await usage(postgres_url, generation_id)
    assert final["status"] == "interrupted"
    assert "400" in final["error"]
    assert "prefill" in final["error"].lower()
    by_attempt = {record.attempt: record for record in records}
    assert set(by_attempt) == {1, 2}
    assert by_attempt[2].error_type == "continuation_refused"


async def test_an_idempotency_key_replays_the_whole_stitched_answer_after_a_takeover(
    postgres_url: str, provider: FakeProvider
) -> None:
    """The key's first request ran on the owner, which died; the retry neither pays again
    while the generation is finished elsewhere, nor after: it gets the whole answer."""
    kind = "continue_final_message"
    key = {"idempotency-key": "report-7"}
    with replica(postgres_url, provider) as (a, owner), replica(postgres_url, provider) as (b, _):
        started = await request(
            f"{a}/relay/{kind}",
            method="POST",
            headers={"content-type": "application/json", **HEADERS, **key},
            body=body_of(kind),
            disconnect_after_bytes=1,
        )
        generation_id = started.headers["x-generation-id"]
        await until_stored(b, generation_id, 1001)
        owner.kill()
        owner.wait()
        await until_taken_over(b, generation_id)
        async with httpx.AsyncClient(timeout=30) as client:
            during = await client.post(
                f"{b}/relay/{kind}",
                content=body_of(kind),
                headers={"content-type": "application/json", **HEADERS, **key},
            )
            whole = await read_whole(b, generation_id)
            # As a client told to retry does, until the claim is settled with the end.
            async with asyncio.timeout(5):
                while True:
                    after = await client.post(
                        f"{b}/relay/{kind}",
                        content=body_of(kind),
                        headers={"content-type": "application/json", **HEADERS, **key},
                    )
                    if after.status_code != 409:
                        break
                    await asyncio.sleep(0.1)
        calls = len(provider.requests)
    assert during.status_code == 409  # in progress elsewhere: retry later, not run again
    assert after.status_code == 200
    assert after.headers["x-generation-id"] == generation_id
    assert after.content == whole
    assert text_of(kind, after.content) == FULL_TEXT
    assert calls == 2  # the first attempt and the continuation: nothing paid twice


async def test_a_restart_runs_the_call_again_after_an_event_that_replaces_the_prefix(
    postgres_url: str, provider: FakeProvider
) -> None:
    """OpenAI Chat Completions has no continuation: the route chose a restart."""
    kind = "restart"
    with replica(postgres_url, provider) as (a, owner), replica(postgres_url, provider) as (b, _):
        generation_id = await start(a, kind)
        await until_stored(b, generation_id, 1001)
        owner.kill()
        owner.wait()
        await until_taken_over(b, generation_id)
        whole = await read_whole(b, generation_id)
        final = await info(b, generation_id)
    assert final["status"] == "complete", final
    marker = b"event: asgi_disconnect.restart\ndata: "
    before, _, after = whole.partition(marker)
    assert after, "no restart event"
    notice, _, rest = after.partition(b"\n\n")
    assert json.loads(notice) == {"replaces": len(before)}
    assert FULL_TEXT.startswith(text_of(kind, before))  # what readers had, replaced
    assert text_of(kind, rest) == FULL_TEXT
    assert terminal_markers(kind, whole) == 1
