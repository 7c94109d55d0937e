"""DrainMiddleware and SIGTERM, in-process and with real signals: the handler the process
had (set with ``loop.add_signal_handler`` by a plain asyncio program, or with
``signal.signal`` as uvicorn does) gets SIGTERM once the drain is over, or at once on a
second SIGTERM; the process's other signals reach it meanwhile; its signal set-up is as it
was once the lifespan ends; without a handler, or off the main thread, SIGTERM is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Iterator

import pytest

from asgi_disconnect import DrainMiddleware
from asgi_disconnect.testing import drive
from asgi_disconnect.testing._driver import lifespan
from tests.apps import eventually
from tests.unit.test_drain import app_with, frames

pytestmark = pytest.mark.anyio

HOW = ["loop.add_signal_handler", "signal.signal"]


@contextlib.contextmanager
def sigterm_handler(how: str, handler: Callable[[], None]) -> Iterator[None]:
    """The process's own SIGTERM handler, set as a server or a program sets it."""
    if how == "loop.add_signal_handler":
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, handler)
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
    else:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: handler())
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def wiring() -> tuple[object, int]:
    """The process's signal set-up for SIGTERM: its handler, and the wakeup fd."""
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return signal.getsignal(signal.SIGTERM), fd


class Program:
    """What the process's handler saw: when each SIGTERM reached it."""

    def __init__(self, drain: DrainMiddleware) -> None:
        self.drain = drain
        self.sigterms: list[str] = []
        self.got = asyncio.Event()

    def on_sigterm(self) -> None:
        if self.drain.drained:
            self.sigterms.append("after the drain")
        else:
            self.sigterms.append("during the drain" if self.drain.draining else "no drain")
        self.got.set()

    async def wait(self) -> None:
        await asyncio.wait_for(self.got.wait(), 5)


def sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("how", HOW)
async def test_sigterm_drains_then_reaches_the_handler_the_process_had(how: str) -> None:
    app, drain = app_with(deadline=0.3, signals=True)
    program = Program(drain)
    with sigterm_handler(how, program.on_sigterm):
        before = wiring()
        async with lifespan(app):
            stream = asyncio.create_task(drive(app, path="/chat", query_string=b"events=300"))
            await eventually(lambda: drain.in_flight == 1)
            sigterm()
            await eventually(lambda: drain.draining, what="a drain on SIGTERM")
            refused = await drive(app, path="/hello")
            assert refused.status == 503
            result = await stream
            assert [frame["type"] for frame in frames(result.body)] == ["interrupted"]
            await program.wait()
            assert program.sigterms == ["after the drain"]
            assert wiring() == before
        assert wiring() == before


@pytest.mark.parametrize("how", HOW)
async def test_a_second_sigterm_while_draining_reaches_the_handler_at_once(how: str) -> None:
    app, drain = app_with(deadline=5, signals=True)
    program = Program(drain)
    with sigterm_handler(how, program.on_sigterm):
        async with lifespan(app):
            stream = asyncio.create_task(drive(app, path="/chat", query_string=b"events=100"))
            await eventually(lambda: drain.in_flight == 1)
            sigterm()
            await eventually(lambda: drain.draining, what="a drain on SIGTERM")
            sigterm()
            await program.wait()
            assert program.sigterms == ["during the drain"]
            result = await stream
            assert frames(result.body) == []  # the drain went on: the stream ended whole
            await drain.drain()
            assert program.sigterms == ["during the drain"]  # not handed over twice


async def test_a_programs_other_signals_reach_its_loop_while_sigterm_is_held() -> None:
    app, drain = app_with(deadline=5, signals=True)
    program = Program(drain)
    usr1 = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, usr1.set)
    try:
        with sigterm_handler("loop.add_signal_handler", program.on_sigterm):
            async with lifespan(app):
                stream = asyncio.create_task(drive(app, path="/chat", query_string=b"events=100"))
                await eventually(lambda: drain.in_flight == 1)
                sigterm()
                await eventually(lambda: drain.draining, what="a drain on SIGTERM")
                os.kill(os.getpid(), signal.SIGUSR1)
                await asyncio.wait_for(usr1.wait(), 5)
                assert program.sigterms == []
                await stream
                await program.wait()
                assert program.sigterms == ["after the drain"]
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)


@pytest.mark.parametrize("how", HOW)
async def test_after_the_lifespan_sigterm_goes_straight_to_the_handler(how: str) -> None:
    app, drain = app_with(signals=True)
    program = Program(drain)
    with sigterm_handler(how, program.on_sigterm):
        before = wiring()
        async with lifespan(app):
            pass
        assert wiring() == before
        sigterm()
        await program.wait()
    assert program.sigterms == ["no drain"]


async def test_without_a_handler_sigterm_is_not_taken(caplog: pytest.LogCaptureFixture) -> None:
    app, _ = app_with(signals=True)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        before = wiring()
        with caplog.at_level(logging.INFO, logger="asgi_disconnect"):
            async with lifespan(app):
                assert wiring() == before  # SIGTERM still ends the process at once
        assert "SIGTERM has no handler of the server's; not taken" in caplog.text
    finally:
        signal.signal(signal.SIGTERM, previous)


async def test_off_the_main_thread_sigterm_is_left_to_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, drain = app_with(signals=True)
    program = Program(drain)
    handlers: list[object] = []

    async def serve() -> None:
        async with lifespan(app):
            handlers.append(signal.getsignal(signal.SIGTERM))

    with sigterm_handler("signal.signal", program.on_sigterm):
        before = wiring()
        with caplog.at_level(logging.INFO, logger="asgi_disconnect"):
            await asyncio.to_thread(asyncio.run, serve())
        assert handlers == [before[0]]
        assert wiring() == before
    assert "not in the main thread, SIGTERM is left to the server" in caplog.text


async def test_sigterm_says_once_what_it_waits_for_detached_generations_included(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, drain = app_with(deadline=0.5, signals=True)
    program = Program(drain)
    with sigterm_handler("signal.signal", program.on_sigterm):
        async with lifespan(app):
            # The client left; the report goes on, its request over.
            await drive(app, path="/report", query_string=b"events=500", disconnect_after_bytes=1)
            assert drain.in_flight == 0
            await eventually(lambda: drain.detached == 1)
            with caplog.at_level(logging.INFO, logger="asgi_disconnect"):
                sigterm()
                await program.wait()
    said = [r.getMessage() for r in caplog.records if r.pathname.endswith("_drain.py")]
    waits = [line for line in said if "waiting" in line]
    assert waits == [
        "SIGTERM: draining before the server shuts down: waiting up to 0.5s for 0 request(s) "
        "in flight and 1 detached generation(s) to finish, then interrupting what is left; "
        "new requests get 503"
    ]
    assert (
        said[-1] == "drained: 0 request(s) still in flight, 0 detached generation(s) still running"
    )
