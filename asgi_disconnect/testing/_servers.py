"""Run an ASGI app under a real server on loopback: in a thread of its own, or (granian
from an import string) in a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

import httpx

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Iterator, Mapping
    from typing import TypeAlias

    from starlette.types import ASGIApp

    # A server to run in a thread: `serve(started, stop)` calls `started()` once it accepts
    # connections and returns once `stop` is set.
    _Serve: TypeAlias = Callable[[Callable[[], None], threading.Event], Coroutine[Any, Any, None]]

__all__ = ["SERVERS", "RunningServer", "ServerName", "run_server"]

ServerName = Literal["uvicorn", "hypercorn", "hypercorn-h2", "granian", "granian-asginl"]
SERVERS: tuple[ServerName, ...] = get_args(ServerName)

# granian configures logging itself; this sends its records to the root logger instead of
# a stdout handler of its own, so they are captured like everyone else's.
_GRANIAN_LOGGING: dict[str, Any] = {
    "handlers": {},
    "loggers": {
        "_granian": {"handlers": [], "propagate": True},
        "granian.access": {"handlers": [], "propagate": True},
    },
}


@dataclass(frozen=True)
class RunningServer:
    """Where a server started by ``run_server`` listens, and how to talk to it.

    `http2` means clients must speak HTTP/2 with prior knowledge (h2c): use
    ``client``, ``h2_request`` or ``h2_stalled_request``. `loop` is the
    server's event loop when it runs in this process, else None.
    """

    url: str
    host: str
    port: int
    server: ServerName = "uvicorn"
    http2: bool = False
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False, compare=False)

    def client(self, **options: Any) -> httpx.AsyncClient:
        """An httpx client for this server, speaking the protocol it is served with."""
        return httpx.AsyncClient(
            base_url=self.url, http1=not self.http2, http2=self.http2, **options
        )

    async def tasks(self) -> list[str]:
        """The tasks alive on the server's event loop, sorted, each named by its coroutine's
        module and qualified name (``"asgi_disconnect._disconnect._AppRun.run"``).

        A request that left a task behind shows here after its connection closed. Only for
        servers running in this process.
        """
        loop = self.loop
        if loop is None:
            raise RuntimeError(f"{self.server} runs in another process; its tasks are not here")
        future = asyncio.run_coroutine_threadsafe(_task_names(), loop)
        return await asyncio.wrap_future(future)


async def _task_names() -> list[str]:
    me = asyncio.current_task()
    names = []
    for task in asyncio.all_tasks():
        if task is not me:
            coro: Any = task.get_coro()
            frame = getattr(coro, "cr_frame", None)
            module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
            names.append(f"{module}.{getattr(coro, '__qualname__', type(coro).__name__)}")
    return sorted(names)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


async def _wait_listening(host: str, port: int, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return True
        await asyncio.sleep(0.01)
    return False


def _import(target: str, factory: bool) -> ASGIApp:
    module_name, _, attribute = target.partition(":")
    value: Any = importlib.import_module(module_name)
    for name in (attribute or "app").split("."):
        value = getattr(value, name)
    return value() if factory else value  # type: ignore[no-any-return]


@contextlib.contextmanager
def run_server(
    app: ASGIApp | str,
    *,
    server: ServerName = "uvicorn",
    host: str = "127.0.0.1",
    lifespan: bool = True,
    factory: bool = False,
    env: Mapping[str, str] | None = None,
    startup_timeout: float = 10.0,
    shutdown_timeout: float = 30.0,
    **options: Any,
) -> Iterator[RunningServer]:
    """Serve ``app`` on loopback until the block exits.

    `server`:

    - ``"uvicorn"``, ``"hypercorn"``: HTTP/1.1.
    - ``"hypercorn-h2"``: hypercorn again, for clients that speak HTTP/2 over cleartext
      with prior knowledge (h2c); hypercorn switches on the connection preface, so this is
      the server with `RunningServer.http2` set.
    - ``"granian"``: granian's ASGI interface, with lifespan; ``"granian-asginl"`` (or
      `lifespan=False`) is its interface without lifespan.

    `app` is an ASGI callable, or an import string ``"module:attribute"`` (with `factory`,
    a callable that returns the app). A callable runs in this process, its server on an
    event loop of its own in a daemon thread, so a test's client and the server never share
    a loop; granian is then run through its embedded server (``granian.server.embed``,
    which granian calls experimental). An import string is imported by uvicorn and
    hypercorn in the same way, while granian serves it from its command line in a process
    of its own, as it runs in production, with `env` added to the environment.

    `lifespan=False` turns the lifespan protocol off (uvicorn, granian). Other `options`
    go to the server: uvicorn's ``Config``, hypercorn's ``Config`` attributes, granian's
    embedded ``Server`` keywords, or granian's command-line flags (``http="2"`` becomes
    ``--http 2``, ``True``/``False`` become ``--name``/``--no-name``).
    """
    if server not in SERVERS:
        raise ValueError(f"unknown server {server!r}; use one of {', '.join(SERVERS)}")
    port = _free_port(host)
    interface = "asgi" if lifespan and server == "granian" else "asginl"
    if server.startswith("granian") and isinstance(app, str):
        with _granian_process(
            app,
            server=server,
            host=host,
            port=port,
            interface=interface,
            factory=factory,
            env=env,
            options=options,
            startup_timeout=startup_timeout,
            shutdown_timeout=shutdown_timeout,
        ) as running:
            yield running
        return
    if env is not None:
        raise ValueError("env applies only to granian serving an import string")
    if server == "uvicorn":
        serve = _uvicorn(app, host, port, lifespan, factory, options)
    else:
        target = _import(app, factory) if isinstance(app, str) else app
        if server.startswith("granian"):
            serve = _granian_embedded(target, host, port, interface, startup_timeout, options)
        else:
            serve = _hypercorn(target, host, port, startup_timeout, shutdown_timeout, options)
    with _in_thread(
        serve,
        server=server,
        host=host,
        port=port,
        startup_timeout=startup_timeout,
        shutdown_timeout=shutdown_timeout,
    ) as running:
        yield running


@contextlib.contextmanager
def _in_thread(
    serve: _Serve,
    *,
    server: ServerName,
    host: str,
    port: int,
    startup_timeout: float,
    shutdown_timeout: float,
) -> Iterator[RunningServer]:
    ready = threading.Event()
    ended = threading.Event()
    stop = threading.Event()
    errors: list[BaseException] = []
    loops: list[asyncio.AbstractEventLoop] = []

    def started() -> None:
        loops.append(asyncio.get_running_loop())
        ready.set()

    def main() -> None:
        try:
            asyncio.run(serve(started, stop))
        except BaseException as exc:
            errors.append(exc)
        finally:
            ended.set()

    thread = threading.Thread(target=main, name=f"{server}-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not ready.wait(0.01) and not ended.is_set() and time.monotonic() < deadline:
        pass
    if not ready.is_set() or errors:
        stop.set()
        raise RuntimeError(f"{server} did not start on {host}:{port}") from (
            errors[0] if errors else None
        )
    try:
        yield RunningServer(
            url=f"http://{host}:{port}",
            host=host,
            port=port,
            server=server,
            http2=server == "hypercorn-h2",
            loop=loops[0],
        )
    finally:
        stop.set()
        thread.join(shutdown_timeout + 5)
        if thread.is_alive():
            raise RuntimeError(f"{server} did not stop within {shutdown_timeout + 5}s")
        if errors:
            raise errors[0]


def _uvicorn(
    app: ASGIApp | str, host: str, port: int, lifespan: bool, factory: bool, options: Any
) -> _Serve:
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on" if lifespan else "off",
        log_level="warning",
        factory=factory,
        **options,
    )
    uv = uvicorn.Server(config)

    async def serve(started: Callable[[], None], stop: threading.Event) -> None:
        async def watch() -> None:
            while not uv.started and not uv.should_exit:
                await asyncio.sleep(0.005)
            if uv.started:
                started()
            await asyncio.to_thread(stop.wait)
            uv.should_exit = True

        watcher = asyncio.ensure_future(watch())
        try:
            await uv.serve()
        finally:
            watcher.cancel()

    return serve


def _hypercorn(
    app: ASGIApp,
    host: str,
    port: int,
    startup_timeout: float,
    shutdown_timeout: float,
    options: Any,
) -> _Serve:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.loglevel = "WARNING"
    config.graceful_timeout = shutdown_timeout
    for key, value in options.items():
        setattr(config, key, value)

    async def serve(started: Callable[[], None], stop: threading.Event) -> None:
        shutdown = asyncio.Event()

        async def watch() -> None:
            if await _wait_listening(host, port, startup_timeout):
                started()
            await asyncio.to_thread(stop.wait)
            shutdown.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await hypercorn_serve(
                app,  # type: ignore[arg-type]
                config,
                shutdown_trigger=shutdown.wait,
                mode="asgi",
            )
        finally:
            watcher.cancel()

    return serve


def _granian_embedded(
    app: ASGIApp, host: str, port: int, interface: str, startup_timeout: float, options: Any
) -> _Serve:
    from granian.constants import Interfaces
    from granian.log import LogLevels
    from granian.server.embed import Server

    async def serve(started: Callable[[], None], stop: threading.Event) -> None:
        # Built on the loop that runs it: the embedded server binds asyncio objects to it.
        granian = Server(
            app,
            address=host,
            port=port,
            interface=Interfaces(interface),
            log_level=LogLevels.warning,
            log_dictconfig=_GRANIAN_LOGGING,
            **options,
        )

        async def watch() -> None:
            if await _wait_listening(host, port, startup_timeout):
                started()
            await asyncio.to_thread(stop.wait)
            granian.stop()  # type: ignore[no-untyped-call]

        watcher = asyncio.ensure_future(watch())
        try:
            await granian.serve()
        finally:
            watcher.cancel()

    return serve


def _flag(name: str, value: Any) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + flag[2:]]
    return [flag, str(value)]


@contextlib.contextmanager
def _granian_process(
    target: str,
    *,
    server: ServerName,
    host: str,
    port: int,
    interface: str,
    factory: bool,
    env: Mapping[str, str] | None,
    options: Mapping[str, Any],
    startup_timeout: float,
    shutdown_timeout: float,
) -> Iterator[RunningServer]:
    command = [sys.executable, "-m", "granian", "--interface", interface]
    command += ["--host", host, "--port", str(port), "--workers", "1", "--log-level", "warning"]
    if factory:
        command.append("--factory")
    for name, value in options.items():
        command += _flag(name, value)
    command.append(target)
    process = subprocess.Popen(command, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"granian exited with {process.returncode} before it started")
            with contextlib.suppress(OSError), socket.create_connection((host, port), 0.2):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"granian did not start on {host}:{port}")
            time.sleep(0.02)
        yield RunningServer(url=f"http://{host}:{port}", host=host, port=port, server=server)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(shutdown_timeout + 5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise RuntimeError(f"granian did not stop within {shutdown_timeout + 5}s") from None
