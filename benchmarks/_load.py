"""A small keep-alive HTTP/1.1 load generator on raw asyncio streams (no dependencies)."""

from __future__ import annotations

import asyncio
import time


async def _read_response(reader: asyncio.StreamReader) -> int:
    """Read one response; return its body size."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    index = lower.find(b"content-length:")
    if index >= 0:
        end = lower.index(b"\r\n", index)
        length = int(lower[index + 15 : end])
        await reader.readexactly(length)
        return length
    size = 0
    while True:
        line = await reader.readuntil(b"\r\n")
        chunk = int(line[:-2], 16)
        if chunk == 0:
            await reader.readuntil(b"\r\n")
            return size
        await reader.readexactly(chunk + 2)
        size += chunk


async def run_load(
    host: str, port: int, path: str, *, connections: int, duration: float
) -> tuple[int, int]:
    """Requests completed and body bytes read in ``duration`` seconds."""
    request = f"GET {path} HTTP/1.1\r\nhost: {host}\r\n\r\n".encode()
    deadline = time.perf_counter() + duration
    counts = [0, 0]

    async def worker() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while time.perf_counter() < deadline:
                writer.write(request)
                counts[1] += await _read_response(reader)
                counts[0] += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    return counts[0], counts[1]
