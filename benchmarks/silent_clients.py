"""A client that vanishes without a FIN, bare FastAPI beside the whole stack, per server.

The gateway of tests/integration/silent_app.py (the quickstart's relay) runs in a network
namespace of its own with FakeProvider; the client reads a stream of ``--tokens`` tokens at
20 tokens/s from a second namespace for ``--read`` seconds, then its link goes down (no FIN,
no RST). Printed per server and app: when the upstream was closed after the vanish, the
tokens generated after it (billed for nobody), and for the stack what the usage record says
was delivered against what the client received.

    python -m benchmarks.silent_clients [--servers uvicorn hypercorn granian] [--tokens 600]

Needs root, ``ip`` and ``tc`` (iproute2). The stack runs with its defaults
(``client_timeout=10``), or ``--client-timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path


async def one(server: str, *, bare: bool, tokens: int, read: float, timeout: float) -> str:
    from tests.integration.silent_app import body_json, eventually, served

    line = f"{server:10} {'bare' if bare else 'install':8}"
    with tempfile.TemporaryDirectory() as tmp:
        options = {} if bare else {"client_timeout": timeout}
        try:
            with served(server, Path(tmp), bare=bare, **options) as setup:
                headers, body = body_json(tokens=tokens, rate=20)
                reader = await setup.open("/v1/chat/completions", headers, body)
                await reader.wait_bytes(1, 10)
                await asyncio.sleep(read)
                setup.cable.cut()
                vanished = time.monotonic()
                await asyncio.sleep(0.2)
                reader.stop()
                received = bytes(reader.body)
                (call,) = setup.provider.requests
                at_vanish = received.count(b'"content":"tok')
                await call.await_closed(tokens / 20 + 30)
                closed = (call.closed_at or time.monotonic()) - vanished
                after = call.tokens_generated - at_vanish
                line += (
                    f" upstream closed {closed:5.1f} s after the vanish; {after:4d} of "
                    f"{call.tokens_generated:4d} tokens generated after it"
                )
                if not bare:
                    await eventually(lambda: setup.records, timeout + 10, "a usage record")
                    (record,) = setup.records
                    line += (
                        f"; record {record.outcome}, delivery={record.delivery}, delivered "
                        f"{record.delivered_bytes:,} B / received {len(received):,} B"
                    )
                reader.close()
                stopping = time.monotonic()
        except RuntimeError as exc:  # the server's shutdown waited on the half-open connection
            return f"{line}; {exc}"
        return f"{line}; the server stopped in {time.monotonic() - stopping:.1f} s"


async def main() -> None:
    from tests.integration import netns

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", nargs="+", default=["uvicorn", "hypercorn", "granian"])
    parser.add_argument("--tokens", type=int, default=600)
    parser.add_argument("--read", type=float, default=3.5, help="seconds read before the cut")
    parser.add_argument("--client-timeout", type=float, default=10.0)
    args = parser.parse_args()
    problem = netns.unavailable()
    if problem is not None:
        sys.exit(f"cannot make network namespaces here: {problem}")
    print(
        f"{args.tokens} tokens at 20/s, the client's link cut after {args.read:g} s; "
        f"client_timeout={args.client_timeout:g}"
    )
    for server in args.servers:
        for bare in (True, False):
            line = await one(
                server,
                bare=bare,
                tokens=args.tokens,
                read=args.read,
                timeout=args.client_timeout,
            )
            print(line, flush=True)


if __name__ == "__main__":
    asyncio.run(main())
