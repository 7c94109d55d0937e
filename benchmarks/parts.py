"""Where DisconnectMiddleware's cost on a small JSON route comes from, part by part.

Each app below adds one part of the middleware's per-request work to the bare app, using
the package's own classes, and is served by uvicorn beside the bare app and the real
middleware; the load alternates between them in rounds as in ``benchmarks.overhead``.
Prints requests/s, the ratio to bare, and the server's user and system CPU per request;
with ``--instructions``, the server's instructions per request under callgrind instead
(as ``benchmarks.instructions`` counts them: steady whatever the machine is doing).

- ``header``: a send wrapper that adds ``x-generation-id`` (what h11 checks and writes);
- ``records``: also a RequestState and a Generation per request, the body appended, the
  generation finished, the state in the scope and the context variable;
- ``records+kept``: also the generation kept in a MemoryBackend of 1,000, as the real
  middleware keeps it for ``GET /generations/{id}`` (retention, eviction, the garbage
  collector's work on what is kept);
- ``wrapped``: DisconnectMiddleware itself.

    python -m benchmarks.parts [--rounds 7] [--seconds 3] [--connections 8] [--instructions]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from typing import TYPE_CHECKING, Any

from asgi_disconnect import MemoryBackend
from asgi_disconnect._contract import Ending, RequestState, current_state, default_principal
from asgi_disconnect._contract import new_generation_id as _new_generation_id
from asgi_disconnect._log import Generation, Status
from benchmarks.apps import make_app
from benchmarks.instructions import count
from benchmarks.overhead import measure, serve

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

_HEADER = b"x-generation-id"


class _Header:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        generation_id = _new_generation_id().encode()

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (_HEADER, generation_id)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


class _Records:
    def __init__(self, app: ASGIApp, backend: MemoryBackend | None) -> None:
        self.app = app
        self.backend = backend

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = RequestState(_new_generation_id())
        scope["asgi_disconnect"] = state
        current_state.set(state)
        backend = self.backend

        async def send_recorded(message: Message) -> None:
            generation: Any = state.generation
            if message["type"] == "http.response.start":
                generation = state.generation = Generation(
                    state.generation_id,
                    principal=default_principal(scope) or "",
                    status_code=message["status"],
                    headers=message.get("headers"),
                )
                if backend is not None:
                    backend.register(generation)
                headers = [*message.get("headers", ()), (_HEADER, state.generation_id.encode())]
                await send({**message, "headers": headers})
                return
            body = message.get("body", b"")
            if body:
                generation.append(body)
            if not message.get("more_body", False):
                generation.finish(Status.COMPLETE)
            await send(message)
            state.delivered_bytes += len(body)

        try:
            await self.app(scope, receive, send_recorded)
        finally:
            state.finish(Ending.DELIVERED)


header_app = _Header(make_app())
records_app = _Records(make_app(), None)
kept_app = _Records(make_app(), MemoryBackend(max_generations=1000))

APPS = {
    "bare": "benchmarks.apps:bare_app",
    "header": "benchmarks.parts:header_app",
    "records": "benchmarks.parts:records_app",
    "records+kept": "benchmarks.parts:kept_app",
    "wrapped": "benchmarks.apps:wrapped_app",
}


def user_and_system(pid: int) -> tuple[float, float]:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--instructions", action="store_true", help="count under callgrind")
    parser.add_argument("--requests", type=int, default=1000, help="with --instructions")
    args = parser.parse_args()
    if args.instructions:
        print("/json on uvicorn (h11, asyncio) under callgrind; instructions per request")
        with tempfile.TemporaryDirectory() as out_dir:
            bare = 0.0
            for name, app in APPS.items():
                per_request = count(app, "/json", args.requests, 200, out_dir)
                bare = bare or per_request
                print(
                    f"{name:14} {per_request:9,.0f}  (+{per_request - bare:7,.0f}); "
                    f"as a throughput ratio {bare / per_request:.3f}",
                    flush=True,
                )
        return
    rows: dict[str, list[tuple[float, float, float]]] = {name: [] for name in APPS}
    with contextlib.ExitStack() as stack:
        servers = {name: stack.enter_context(serve(app)) for name, app in APPS.items()}
        for port, _ in servers.values():  # warm-up
            measure(port, "/json", 4, 0.5)
        for round_ in range(args.rounds):
            names = list(APPS) if round_ % 2 == 0 else list(reversed(APPS))
            for name in names:
                port, pid = servers[name]
                user, system = user_and_system(pid)
                rate = measure(port, "/json", args.connections, args.seconds)
                user_after, system_after = user_and_system(pid)
                requests = rate * args.seconds
                rows[name].append(
                    (rate, (user_after - user) / requests, (system_after - system) / requests)
                )
    print(
        f"/json on uvicorn (h11, asyncio), {args.rounds} rounds x {args.seconds}s, "
        f"{args.connections} connections; median per round"
    )
    bare = statistics.median(row[0] for row in rows["bare"])
    for name, measured in rows.items():
        rate = statistics.median(row[0] for row in measured)
        user = statistics.median(row[1] for row in measured) * 1e6
        system = statistics.median(row[2] for row in measured) * 1e6
        print(
            f"{name:14} {rate:9.1f} requests/s  ratio {rate / bare:.3f}  "
            f"CPU per request: user {user:6.1f} us, system {system:5.1f} us"
        )


if __name__ == "__main__":
    main()
