"""Run a FakeProvider in the foreground until Ctrl-C.

python -m asgi_disconnect.testing.fake_provider --host 127.0.0.1 --port 8001 --tokens 200 --rate 20
"""

from __future__ import annotations

import argparse
import contextlib
import threading

from ._fake_provider import FakeProvider


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asgi_disconnect.testing.fake_provider",
        description="Fake OpenAI Chat Completions / Anthropic Messages streaming server.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    parser.add_argument("--tokens", type=int, default=50, help="tokens per response")
    parser.add_argument(
        "--rate", type=float, default=200.0, help="tokens per second (0 or inf: no delay)"
    )
    parser.add_argument("--first-token-delay", type=float, default=0.0, help="seconds")
    parser.add_argument("--input-tokens", type=int, default=12)
    parser.add_argument("--model", default="fake-model")
    args = parser.parse_args(argv)
    provider = FakeProvider(
        tokens=args.tokens,
        tokens_per_second=args.rate,
        first_token_delay=args.first_token_delay,
        input_tokens=args.input_tokens,
        model=args.model,
        host=args.host,
        port=args.port,
    )
    with provider:
        print(f"FakeProvider listening on {provider.url} (Ctrl-C to stop)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
