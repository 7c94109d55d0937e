"""Run an ASGI app under a real server on loopback, in a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from collections.abc import Iterator

    from starlette.types import ASGIApp

__all__ = ["RunningServer", "run_server"]


@dataclass(frozen=True)
class RunningServer:
    url: str
    host: str
    port: int


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def run_server(
    app: ASGIApp,
    *,
    server: Literal["uvicorn", "hypercorn"] = "uvicorn",
    host: str = "127.0.0.1",
    lifespan: bool = True,
    startup_timeout: float = 10.0,
    shutdown_timeout: float = 30.0,
    **options: Any,
) -> Iterator[RunningServer]:
    """Serve ``app`` with uvicorn or hypercorn until the block exits.

    The server gets its own event loop in a daemon thread, as it would in its own
    process, so a test's client and the server never share a loop.
    """
    started = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []
    port = _free_port(host)

    if server == "uvicorn":
        import uvicorn

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            lifespan="on" if lifespan else "off",
            log_level="warning",
            **options,
        )
        uv = uvicorn.Server(config)

        async def serve() -> None:
            async def watch() -> None:
                while not uv.started and not uv.should_exit:
                    await asyncio.sleep(0.005)
                if uv.started:
                    started.set()
                await asyncio.to_thread(stop.wait)
                uv.should_exit = True

            watcher = asyncio.ensure_future(watch())
            try:
                await uv.serve()
            finally:
                watcher.cancel()

    elif server == "hypercorn":
        from hypercorn.asyncio import serve as hypercorn_serve
        from hypercorn.config import Config

        hconfig = Config()
        hconfig.bind = [f"{host}:{port}"]
        hconfig.loglevel = "WARNING"
        hconfig.graceful_timeout = shutdown_timeout
        for key, value in options.items():
            setattr(hconfig, key, value)

        async def serve() -> None:
            shutdown = asyncio.Event()

            async def trigger() -> None:
                await shutdown.wait()

            async def watch() -> None:
                for _ in range(int(startup_timeout / 0.01)):
                    with contextlib.suppress(OSError):
                        _, writer = await asyncio.open_connection(host, port)
                        writer.close()
                        started.set()
                        break
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(stop.wait)
                shutdown.set()

            watcher = asyncio.ensure_future(watch())
            try:
                await hypercorn_serve(
                    app,  # type: ignore[arg-type]
                    hconfig,
                    shutdown_trigger=trigger,
                    mode="asgi",
                )
            finally:
                watcher.cancel()

    else:
        raise ValueError(f"unknown server {server!r}; use 'uvicorn' or 'hypercorn'")

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as exc:
            errors.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=main, name=f"{server}-{port}", daemon=True)
    thread.start()
    if not started.wait(startup_timeout) or errors:
        stop.set()
        raise RuntimeError(f"{server} did not start on {host}:{port}") from (
            errors[0] if errors else None
        )
    try:
        yield RunningServer(url=f"http://{host}:{port}", host=host, port=port)
    finally:
        stop.set()
        thread.join(shutdown_timeout + 5)
        if thread.is_alive():
            raise RuntimeError(f"{server} did not stop within {shutdown_timeout + 5}s")
        if errors:
            raise errors[0]
