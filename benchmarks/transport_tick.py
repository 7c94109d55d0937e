"""What the transport monitor's once-a-second sample costs the event loop, by watched streams.

N loopback connections, each watched as a streamed response with bytes in flight; the
monitor's tick (one sock_diag query and the bookkeeping per connection) is timed.

    python -m benchmarks.transport_tick [--connections 100 1000] [--ticks 20]

Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import time

from asgi_disconnect._transport import TransportMonitor


async def tick_cost(connections: int, ticks: int) -> float:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(connections)
        pairs = []
        monitor = TransportMonitor(10.0)
        loop = asyncio.get_running_loop()
        try:
            for _ in range(connections):
                client = socket.create_connection(listener.getsockname())
                served, _ = listener.accept()
                pairs.append((client, served))
                scope = {"client": served.getpeername(), "server": served.getsockname()}
                watch = monitor.watch(scope, loop, lambda: None, chunked=True)
                assert watch is not None
                watch.sizes.extend([200] * 20)
                served.send(b"x" * 4000)
            await asyncio.sleep(0.05)
            started = time.perf_counter()
            for _ in range(ticks):
                monitor._tick()
            return (time.perf_counter() - started) / ticks
        finally:
            monitor.close()
            for client, served in pairs:
                client.close()
                served.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--ticks", type=int, default=20)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * max(args.connections) + 100
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    for connections in args.connections:
        seconds = asyncio.run(tick_cost(connections, args.ticks))
        print(
            f"{connections:6,} watched streams: {seconds * 1000:6.2f} ms per tick "
            f"(once a second: {seconds * 100:.2f}% of a core)"
        )


if __name__ == "__main__":
    main()
