"""SSE decoding throughput: asgi_disconnect's SSEDecoder vs httpx-sse's and the openai SDK's.

All decoders run side by side in one process on the same bodies cut into the same chunks:
64-byte chunks, 4 KiB chunks, and one chunk per event (how an ASGI app and a network read
usually deliver a stream). Bodies: the recorded vectors in tests/data concatenated and
repeated to about 5 MB, and a synthetic 1,000-token OpenAI chat stream repeated to the same
size. Prints the best of --runs runs in MB/s and the ratio of ours to the fastest peer.

Each decoder hands every event to the caller, which drops it, as a metering tee does; with
--keep every event is kept in one list to the end instead, which adds the cost of growing
the heap by the whole body (the same for every decoder, so the ratios shrink).

When the installed decoder is compiled (hatch_build.py), ``sse.py`` also runs as plain Python
beside it, as an install without a C compiler would run it, with its own ratio.

    python -m benchmarks.sse_decode [--runs 5] [--megabytes 5] [--keep]

The peers are benchmark-only dependencies (``pip install httpx-sse openai``); a peer that is
not installed is reported and skipped.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from asgi_disconnect import sse

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"

# A decoder under test: chunks in, the decoder's own event objects out, one by one.
Decode = Callable[[list[bytes]], Iterator[Any]]


def decoding_with(module: Any) -> Decode:
    def decode(chunks: list[bytes]) -> Iterator[Any]:
        decoder = module.SSEDecoder()
        for chunk in chunks:
            yield from decoder.feed(chunk)
        decoder.close()

    return decode


decode_ours = decoding_with(sse)
COMPILED = not sse.__file__.endswith(".py")


def load_source() -> Decode:
    """asgi_disconnect/sse.py run as plain Python, whether or not the installed one is compiled."""
    name = "asgi_disconnect._sse_as_python"
    spec = importlib.util.spec_from_file_location(name, Path(sse.__file__).with_name("sse.py"))
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return decoding_with(module)


def load_httpx_sse() -> Decode:
    from httpx._decoders import TextDecoder  # what httpx's Response.iter_text() decodes with
    from httpx_sse._decoders import SSEDecoder as HttpxSSEDecoder
    from httpx_sse._decoders import SSELineDecoder

    def decode(chunks: list[bytes]) -> Iterator[Any]:
        # httpx_sse.EventSource.iter_sse(): iter_text() -> SSELineDecoder -> SSEDecoder.decode
        text_decoder = TextDecoder(encoding="utf-8")
        line_decoder = SSELineDecoder()
        decoder = HttpxSSEDecoder()

        def lines() -> Iterator[str]:
            for chunk in chunks:
                yield from line_decoder.decode(text_decoder.decode(chunk))
            text = text_decoder.flush()
            if text:
                yield from line_decoder.decode(text)
            yield from line_decoder.flush()

        for line in lines():
            event = decoder.decode(line.rstrip("\n"))
            if event is not None:
                yield event

    return decode


def load_openai() -> Decode:
    from openai._streaming import SSEDecoder as OpenAISSEDecoder

    def decode(chunks: list[bytes]) -> Iterator[Any]:
        return OpenAISSEDecoder().iter_bytes(iter(chunks))

    return decode


def summary(events: list[Any]) -> list[tuple[str, str]]:
    """Event types and data, for checking that the decoders agree."""
    return [(event.event or "message", event.data) for event in events]


def synthetic_openai_stream(tokens: int = 1000) -> bytes:
    """A chat completion stream of ``tokens`` content deltas, some of them non-ASCII."""
    head = (
        '{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1727346168,'
        '"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_bench","choices":'
    )
    words = [" the", " stream", "é", " 東京", " token", ",", " 🚀", " of"]
    frames = [
        head + '[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}'
    ]
    for index in range(tokens):
        delta = json.dumps({"content": words[index % len(words)]}, ensure_ascii=False)
        frames.append(
            head + f'[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":null}}]}}'
        )
    frames.append(head + '[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}')
    frames.append(
        head + f'[],"usage":{{"prompt_tokens":12,"completion_tokens":{tokens},'
        f'"total_tokens":{tokens + 12}}}}}'
    )
    frames.append("[DONE]")
    return "".join(f"data: {frame}\n\n" for frame in frames).encode()


def repeat_to(body: bytes, size: int) -> bytes:
    return body * max(1, round(size / len(body)))


def chunkings(body: bytes) -> dict[str, list[bytes]]:
    events = body.split(b"\n\n")
    per_event = [event + b"\n\n" for event in events[:-1]]
    if events[-1]:
        per_event.append(events[-1])
    return {
        "64 B": [body[i : i + 64] for i in range(0, len(body), 64)],
        "4 KiB": [body[i : i + 4096] for i in range(0, len(body), 4096)],
        "per event": per_event,
    }


def timed(decode: Decode, chunks: list[bytes], keep: bool) -> float:
    # Both sinks consume the events in C, so every decoder pays the same for them.
    sink: Callable[[Iterator[Any]], object] = list if keep else deque(maxlen=0).extend
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        sink(decode(chunks))
        return time.perf_counter() - start
    finally:
        gc.enable()


def version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--megabytes", type=float, default=5.0)
    parser.add_argument("--keep", action="store_true", help="keep every event to the end")
    args = parser.parse_args()
    size = int(args.megabytes * 1_000_000)

    ours = {"asgi_disconnect": decode_ours}
    if COMPILED:
        ours = {"ours, compiled": decode_ours, "ours, Python": load_source()}
    decoders: dict[str, Decode] = dict(ours)
    for name, package, load in (
        ("httpx-sse", "httpx-sse", load_httpx_sse),
        ("openai", "openai", load_openai),
    ):
        try:
            decoders[name] = load()
        except ImportError as exc:
            print(f"{name}: not installed ({exc}); skipped. `pip install {package}` to compare.")
    print(
        f"Python {platform.python_version()} on {platform.machine()}; "
        f"httpx-sse {version('httpx-sse')}, openai {version('openai')}; best of {args.runs} runs; "
        f"events {'kept to the end' if args.keep else 'dropped once handed over'}"
    )
    print(f"asgi_disconnect.sse: {'compiled by mypyc' if COMPILED else 'plain Python'}")

    vectors = b"".join(
        path.read_bytes() for path in sorted(DATA.glob("*.sse")) if ".synthetic." not in path.name
    )
    bodies = {
        "recorded vectors": repeat_to(vectors, size),
        "synthetic 1,000-token OpenAI": repeat_to(synthetic_openai_stream(), size),
    }
    for body_name, body in bodies.items():
        events = len(list(decode_ours([body])))
        print(f"{body_name}: {len(body) / 1e6:.1f} MB, {events:,} events")
    names = list(decoders)
    peer_names = [name for name in names if name not in ours]
    header = f"{'body':30} {'chunks':10}" + "".join(f"{name + ' MB/s':>22}" for name in names)
    print(header + "".join(f"{name + ' / peer':>22}" for name in ours))
    for body_name, body in bodies.items():
        for chunking, chunks in chunkings(body).items():
            expected = summary(list(decode_ours(chunks)))
            for name, decode in decoders.items():
                if summary(list(decode(chunks))) != expected:
                    sys.exit(f"{name} decoded {body_name} ({chunking}) differently")
            best = dict.fromkeys(names, float("inf"))
            for _ in range(args.runs):
                for name in names:
                    best[name] = min(best[name], timed(decoders[name], chunks, args.keep))
            speeds = {name: len(body) / best[name] / 1e6 for name in names}
            row = f"{body_name:30} {chunking:10}" + "".join(
                f"{speeds[name]:>22.1f}" for name in names
            )
            fastest = max((speeds[name] for name in peer_names), default=0.0)
            ratios = "".join(
                f"{speeds[name] / fastest:>21.2f}x" if fastest else f"{'-':>22}" for name in ours
            )
            print(row + ratios, flush=True)


if __name__ == "__main__":
    main()
