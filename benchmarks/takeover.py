"""How long a detached generation waits for another replica after its owner is SIGKILLed,
and how many of its bytes are lost (none may be).

Two uvicorn replicas on one store, the upstream a FakeProvider. Each round starts
``--generations`` detached generations on the first replica (their clients leave at once),
kills it with SIGKILL ``--after`` seconds later, and reads each generation back from the
other replica once it ended: the takeover delay is from the kill to the moment the survivor
reports attempt 2; a generation whose stitched text is not the provider's whole deterministic
answer, or has more or less than one terminal marker, counts its missing bytes as lost::

    python -m benchmarks.takeover --backend postgresql://postgres@127.0.0.1/postgres \\
        --rounds 5 --generations 16 --kind continue_final_message

With the default lease (15 s) the survivor takes a generation over between ``lease`` and
``lease`` + ``takeover_interval`` (1 s) after the owner's last heartbeat, which was at most
``lease / 3`` before the kill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import httpx

from asgi_disconnect.testing import FakeProvider, request
from benchmarks._uvicorn import ROOT, free_port, uvicorn_command, wait_until_listening

PATHS = {
    "responses": "/v1/responses",
    "continue_final_message": "/v1/chat/completions",
    "prefill": "/v1/messages",
}


def _body(kind: str) -> bytes:
    if kind == "responses":
        return json.dumps({"model": "fake-model", "input": "Write it.", "stream": True}).encode()
    payload: dict[str, Any] = {
        "model": "fake-model",
        "stream": True,
        "messages": [{"role": "user", "content": "Write it."}],
    }
    if kind == "prefill":
        payload["max_tokens"] = 8192
    return json.dumps(payload).encode()


def _text(kind: str, stream: bytes) -> tuple[str, int]:
    """The answer's text and its terminal markers."""
    parts: list[str] = []
    ends = 0
    for frame in stream.split(b"\n\n"):
        name, data = None, b""
        for line in frame.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data = line[5:].strip()
        if data == b"[DONE]":
            ends += 1
            continue
        if not data:
            continue
        payload = json.loads(data)
        if kind == "continue_final_message":
            for choice in payload.get("choices") or ():
                parts.append((choice.get("delta") or {}).get("content") or "")
        elif kind == "prefill" and name == "content_block_delta":
            parts.append(payload["delta"].get("text", ""))
        elif kind == "prefill" and name == "message_stop":
            ends += 1
        elif kind == "responses" and name == "response.output_text.delta":
            parts.append(payload["delta"])
        elif kind == "responses" and name == "response.completed":
            ends += 1
    return "".join(parts), ends


def _replica(url: str, provider: str, lease: float) -> tuple[str, subprocess.Popen[bytes]]:
    port = free_port()
    env = {
        **os.environ,
        "ASGI_DISCONNECT_URL": url,
        "ASGI_DISCONNECT_PROVIDER": provider,
        "ASGI_DISCONNECT_LEASE": str(lease),
    }
    proc = subprocess.Popen(
        uvicorn_command("benchmarks._takeover_app:app", port), cwd=ROOT, env=env
    )
    wait_until_listening(port, 30, "a replica")
    return f"http://127.0.0.1:{port}", proc


async def _info(client: httpx.AsyncClient, base: str, generation_id: str) -> dict[str, Any]:
    response = await client.get(f"{base}/generations/{generation_id}")
    return response.json()  # type: ignore[no-any-return]


async def _round(
    url: str, provider: FakeProvider, args: argparse.Namespace, full: str
) -> tuple[list[float], int, int]:
    a, owner = _replica(url, provider.url, args.lease)
    b, survivor = _replica(url, provider.url, args.lease)
    try:
        headers = {
            "content-type": "application/json",
            "x-fake-tokens": str(args.tokens),
            "x-fake-rate": str(args.rate),
        }
        started = await asyncio.gather(
            *[
                request(
                    f"{a}/relay/{args.kind}",
                    method="POST",
                    headers=headers,
                    body=_body(args.kind),
                    disconnect_after_bytes=1,
                )
                for _ in range(args.generations)
            ]
        )
        ids = [result.headers["x-generation-id"] for result in started]
        # Killed at a point of the heartbeat's cycle (every lease / 3) drawn per round.
        await asyncio.sleep(args.after + args.random.uniform(0, args.lease / 3))
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        killed = time.monotonic()
        delays: dict[str, float] = {}
        lost = broken = 0
        async with httpx.AsyncClient(timeout=120) as client:
            async with asyncio.timeout(args.lease * 3 + args.tokens / args.rate + 60):
                while len(delays) < len(ids):
                    for generation_id in ids:
                        if generation_id in delays:
                            continue
                        info = await _info(client, b, generation_id)
                        if info.get("attempt", 1) >= 2 or info["status"] != "running":
                            delays[generation_id] = time.monotonic() - killed
                    await asyncio.sleep(0.02)
                for generation_id in ids:
                    while (await _info(client, b, generation_id))["status"] == "running":
                        await asyncio.sleep(0.1)
                    whole = await client.get(f"{b}/generations/{generation_id}/stream")
                    text, ends = _text(args.kind, whole.content)
                    lost += max(0, len(full) - len(text))
                    broken += ends != 1 or text != full
        return list(delays.values()), lost, broken
    finally:
        for proc in (owner, survivor):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", required=True, help="a PostgreSQL or SQLite URL")
    parser.add_argument("--kind", choices=sorted(PATHS), default="continue_final_message")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--generations", type=int, default=16)
    parser.add_argument("--lease", type=float, default=15.0)
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--rate", type=float, default=20.0, help="tokens per second")
    parser.add_argument(
        "--after",
        type=float,
        default=2.0,
        help="seconds before the kill, plus a draw from 0 to lease / 3",
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.random = random.Random(args.seed)
    url = args.backend
    if url.startswith("postgres"):
        separator = "&" if "?" in url else "?"
        url = f"{url}{separator}schema=takeover_{uuid.uuid4().hex[:8]}"
    full = "".join(f"tok{i} " for i in range(args.tokens))
    delays: list[float] = []
    lost = broken = 0
    with FakeProvider(tokens=args.tokens, tokens_per_second=args.rate) as provider:
        for _ in range(args.rounds):
            round_delays, round_lost, round_broken = await _round(url, provider, args, full)
            delays += round_delays
            lost += round_lost
            broken += round_broken
    delays.sort()
    p99 = delays[min(len(delays) - 1, round(0.99 * (len(delays) - 1)))]
    print(
        f"{args.kind} on {url.split(':')[0]}, lease {args.lease:g} s: {len(delays)} "
        f"generations taken over after SIGKILL; delay p50 {statistics.median(delays):.2f} s, "
        f"p99 {p99:.2f} s, max {delays[-1]:.2f} s; bytes lost {lost}; "
        f"answers not whole or without exactly one terminal marker {broken}"
    )


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
