"""The clients of `benchmarks.load`: N concurrent raw-socket SSE readers in one process.

Each client POSTs a streaming chat completion (``connection: close``) and is one of:

- ``complete``: reads to the end; complete when the chunked body ended and held ``[DONE]``;
- ``disconnect``: closes its socket at a random moment of the stream (10-90% of it);
- ``stall``: reads a little (5-30% of the stream), then stops reading with the socket open,
  its receive buffer shrunk so the server feels it, and closes after ``--stall-seconds``.

Prints one JSON object: per client its kind, time to first body byte, how long it lasted,
bytes and tokens read.

    python -m benchmarks._stream_clients --port 8000 --streams 100 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import time
from typing import Any

CHAT = "/v1/chat/completions"


def body_for(client: int) -> bytes:
    """The request; ``user`` names the client, so the provider's record can be matched."""
    return json.dumps(
        {
            "model": "fake-model",
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Write a long report."}],
            "user": f"client-{client}",
        }
    ).encode()


TOKEN = b'"content":"tok'


def dechunk(raw: bytes) -> tuple[bytes, bool]:
    """The body of a chunked response so far and whether its last chunk arrived."""
    head_end = raw.find(b"\r\n\r\n")
    if head_end < 0:
        return b"", False
    pos, body = head_end + 4, bytearray()
    while True:
        line_end = raw.find(b"\r\n", pos)
        if line_end < 0:
            return bytes(body), False
        try:
            size = int(raw[pos:line_end].split(b";")[0], 16)
        except ValueError:
            return bytes(body), False
        if size == 0:
            return bytes(body), True
        start = line_end + 2
        body += raw[start : start + size]
        if start + size + 2 > len(raw):
            return bytes(body), False
        pos = start + size + 2


async def one_client(
    index: int,
    host: str,
    port: int,
    kind: str,
    start_at: float,
    cut_at: float,
    stall_seconds: float,
    give_up_after: float,
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start_at - loop.time()))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    if kind == "stall":
        # A small window: bytes the client does not read soon back up to the server.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = body_for(index)
    request = (
        f"POST {CHAT} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body
    raw = bytearray()
    ttfb: float | None = None
    error: str | None = None
    began = loop.time()
    deadline = began + cut_at
    give_up = began + give_up_after
    try:
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, request)
        head_end = -1
        while True:
            timeout = (give_up if kind == "complete" else deadline) - loop.time()
            if timeout <= 0:
                error = "timeout" if kind == "complete" else None
                break
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 65536), timeout)
            except TimeoutError:
                continue
            if not data:
                break
            raw += data
            if ttfb is None:
                if head_end < 0:
                    head_end = raw.find(b"\r\n\r\n")
                if head_end >= 0 and len(raw) > head_end + 4:
                    ttfb = loop.time() - began
        if kind == "stall":
            await asyncio.sleep(stall_seconds)
    except OSError as exc:
        error = type(exc).__name__
    finally:
        sock.close()
    ended_at = loop.time() - began
    body, ended = dechunk(bytes(raw))
    status = raw[9:12].decode("latin-1") if raw.startswith(b"HTTP/1.1 ") else ""
    return {
        "client": index,
        "sent_at": began,
        "kind": kind,
        "status": status,
        "ttfb": ttfb,
        "duration": ended_at,
        "bytes": len(body),
        "tokens": body.count(TOKEN),
        "complete": ended and b"data: [DONE]" in body,
        "error": error,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    n = args.streams
    kinds = ["disconnect"] * round(n * args.disconnect) + ["stall"] * round(n * args.stall)
    kinds += ["complete"] * (n - len(kinds))
    rng.shuffle(kinds)
    loop = asyncio.get_running_loop()
    origin = loop.time() + 0.05
    tasks = []
    for i, kind in enumerate(kinds):
        if kind == "disconnect":
            cut = rng.uniform(0.1, 0.9) * args.seconds
        elif kind == "stall":
            cut = rng.uniform(0.05, 0.3) * args.seconds
        else:
            cut = 0.0
        start_at = origin + args.ramp * i / n
        give_up = args.seconds * 4 + 30
        tasks.append(
            one_client(i, args.host, args.port, kind, start_at, cut, args.stall_seconds, give_up)
        )
    return list(await asyncio.gather(*tasks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--streams", type=int, required=True)
    parser.add_argument("--seconds", type=float, required=True, help="planned stream length")
    parser.add_argument("--disconnect", type=float, default=0.20)
    parser.add_argument("--stall", type=float, default=0.05)
    parser.add_argument("--stall-seconds", type=float, default=10.0)
    parser.add_argument("--ramp", type=float, default=1.0, help="seconds to open all streams")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    started = time.monotonic()
    clients = asyncio.run(run(args))
    json.dump({"clients": clients, "wall": time.monotonic() - started}, sys.stdout)


if __name__ == "__main__":
    main()
