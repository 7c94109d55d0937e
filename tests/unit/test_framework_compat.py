"""What Starlette and FastAPI apps do bare, they do with the stack installed (with
idempotency and drain on)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import anyio
import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_disconnect import BackendUnavailable, MemoryBackend, install, metered
from asgi_disconnect.testing import drive, lifespan
from tests.apps import Probe, eventually, http_scope, request_then_disconnect, sse_app

pytestmark = pytest.mark.anyio


async def echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"size": len(body)})


def limited_app() -> Starlette:
    """A 25-byte limit for the app; its /echo route allows 100."""
    return Starlette(
        routes=[
            Route("/echo", echo, methods=["POST"], max_body_size=100),
            Route("/small", echo, methods=["POST"]),
        ],
        max_body_size=25,
    )


async def statuses(app: Any, requests: list[tuple[str, int]]) -> list[int]:
    found = []
    for path, size in requests:
        result = await drive(
            app,
            method="POST",
            path=path,
            body=b"x" * size,
            headers=[("content-type", "application/json"), ("content-length", str(size))],
            timeout=5,
        )
        found.append(result.status)
    return found


PLAN = [
    ("/small", 30),  # over the app's limit: 413
    ("/small", 10),  # under it: 200, and the route has been served once
    ("/small", 30),  # over it again: 413 (it hung before: the limit's error was dropped)
    ("/echo", 30),  # over the app's limit, under the route's: 200
    ("/echo", 120),  # over the route's: 413
    ("/echo", 30),
]


@pytest.mark.parametrize("installed", [False, True], ids=["bare", "installed"])
async def test_body_limits_of_the_app_and_its_routes_apply_as_without_the_stack(
    installed: bool,
) -> None:
    app = limited_app()
    if installed:
        install(app, backend=MemoryBackend(), idempotency=True, drain=True)
    assert await statuses(app, PLAN) == [413, 200, 413, 200, 413, 200]


async def test_a_route_limit_above_the_apps_holds_on_the_first_request() -> None:
    app = limited_app()
    install(app, backend=MemoryBackend(), idempotency=True, drain=True)
    # The first request to a route runs supervised (the stack reads ahead for the client):
    # the body is read only when the app asks, after routing set the route's limit.
    assert await statuses(app, [("/echo", 60)]) == [200]


def teardown_app(events: list[str]) -> Starlette:
    async def slow(request: Request) -> JSONResponse:
        events.append("enter")
        try:
            await anyio.sleep(10)
        finally:
            # Async cleanup, as a dependency's teardown or a client's aclose() does.
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.2)
            events.append("cleanup done")
        return JSONResponse({})

    return Starlette(routes=[Route("/slow", slow)])


@pytest.mark.parametrize("installed", [False, True], ids=["bare", "installed"])
@pytest.mark.parametrize("outer", ["anyio", "asyncio"])
async def test_a_request_cancelled_from_outside_returns_after_the_apps_cleanup(
    installed: bool, outer: str
) -> None:
    """docs/behaviour.md: a cancelled request returns only after the app's finally blocks ran. An
    anyio cancel scope around the request cancels again at every await; so is the stack's
    wait for the app."""
    events: list[str] = []
    app = teardown_app(events)
    if installed:
        install(app, backend=MemoryBackend(), idempotency=True, drain=True)
    receive = request_then_disconnect(asyncio.Event())  # the client never leaves

    async def send(message: dict[str, Any]) -> None:
        pass

    scope = http_scope("/slow")
    if outer == "anyio":
        with anyio.move_on_after(0.3):
            await app(scope, receive, send)
    else:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await app(scope, receive, send)
    assert events == ["enter", "cleanup done"]


@pytest.mark.parametrize("installed", [False, True], ids=["bare", "installed"])
@pytest.mark.parametrize("warm", [False, True], ids=["first-request", "warm-route"])
async def test_a_cancel_scope_cancelled_during_the_apps_shielded_cleanup_waits_for_it(
    installed: bool, warm: bool
) -> None:
    """FastAPI shields a dependency's cleanup: a cancel scope around the request that is
    cancelled meanwhile returns after it, the stack's app task as the app run bare."""
    events: list[str] = []
    release, in_cleanup = anyio.Event(), anyio.Event()

    @metered()  # an LLM exchange: it is a generation, and gets a usage record
    async def slow(request: Request) -> JSONResponse:
        events.append("enter")
        try:
            if request.query_params.get("wait") == "1":
                await release.wait()
        finally:
            with anyio.CancelScope(shield=True):
                in_cleanup.set()
                await anyio.sleep(0.1)
            events.append("cleanup done")
        return JSONResponse({})

    app = Starlette(routes=[Route("/slow", slow)])
    backend = MemoryBackend()
    if installed:
        install(app, backend=backend, idempotency=True, drain=True)
    if warm:
        assert (await drive(app, path="/slow")).status == 200
        events.clear()
        in_cleanup = anyio.Event()
        backend.usage.clear()
    at_return: list[list[str]] = []

    async def send(message: dict[str, Any]) -> None:
        pass

    async def client(*, task_status: Any) -> None:
        with anyio.CancelScope() as cancel:
            task_status.started(cancel)
            scope = {**http_scope("/slow"), "query_string": b"wait=1"}
            await app(scope, request_then_disconnect(asyncio.Event()), send)
        at_return.append(list(events))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            cancel = await group.start(client)
            release.set()
            await in_cleanup.wait()
            cancel.cancel()
    assert at_return == [["enter", "cleanup done"]]
    if installed:
        # One usage record, and no stored response that claims a whole answer it did not send.
        for _ in range(100):
            if backend.usage:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        (record,) = backend.usage
        info = await backend.get(record.generation_id)
        assert info is not None
        # The app finished its answer (its cleanup ran, then it returned): the generation
        # and its record say complete; what reached the client is counted apart.
        assert record.outcome == info.status.value == "complete"
        assert record.produced_bytes == 2
        assert record.delivered_bytes <= record.produced_bytes


async def test_requests_after_a_lifespan_ended_are_served_as_before_it_began() -> None:
    """One module-level app used with ``with TestClient(app):`` and without: after the
    lifespan's shutdown, requests are answered (their work ends with them), not 503."""
    probe = Probe()
    app = sse_app(probe, chunks=3, delay=0.001)
    install(app, backend=MemoryBackend(), idempotency=True, drain=True)
    before = await drive(app, path="/cancel", headers=[("authorization", "Bearer t")])
    async with lifespan(app):
        during = await drive(app, path="/cancel", headers=[("authorization", "Bearer t")])
    after = await drive(app, path="/cancel", headers=[("authorization", "Bearer t")])
    assert [before.status, during.status, after.status] == [200, 200, 200]
    assert after.body == before.body
    assert after.body.count(b"data: ") == 3
    # And a second lifespan starts as the first did.
    async with lifespan(app):
        again = await drive(app, path="/cancel", headers=[("authorization", "Bearer t")])
    assert again.status == 200


async def raises_cancelled(request: Request) -> JSONResponse:
    raise asyncio.CancelledError("the app's own")


@pytest.mark.parametrize("installed", [False, True], ids=["bare", "installed"])
async def test_a_cancelled_error_the_app_raises_itself_reaches_the_server(
    installed: bool,
) -> None:
    app = Starlette(routes=[Route("/boom", raises_cancelled)])
    if installed:
        install(app, backend=MemoryBackend(), idempotency=True, drain=True)
    for _ in range(2):  # supervised, then as the route runs once it is known
        task = asyncio.ensure_future(drive(app, path="/boom"))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.shield(task)
        assert task.cancelled()


async def trailers_twice(scope: Any, receive: Any, send: Any) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "trailers": True,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    await send({"type": "http.response.body", "body": b"data: x\n\n"})
    await send({"type": "http.response.trailers", "headers": [], "more_trailers": False})
    await send({"type": "http.response.trailers", "headers": [], "more_trailers": False})


async def test_trailers_after_the_last_trailers_are_an_error() -> None:
    from asgi_disconnect import DisconnectMiddleware

    mw = DisconnectMiddleware(trailers_twice, backend=MemoryBackend())
    with pytest.raises(RuntimeError, match=r"'http\.response\.trailers' sent after the last"):
        await drive(mw, path="/")


def test_an_app_served_on_asyncio_then_trio_says_it_runs_on_asyncio_only() -> None:
    pytest.importorskip("trio")
    from starlette.testclient import TestClient

    app = teardown_app([])
    install(app, backend=MemoryBackend(), idempotency=True, drain=True)
    with TestClient(app) as client:  # asyncio
        assert client.get("/missing").status_code == 404
    with pytest.raises(
        RuntimeError, match="asyncio only, and this server or test client runs trio"
    ):
        TestClient(app, backend="trio").get("/missing")


class UnopenableBackend(MemoryBackend):
    async def open(self) -> None:
        raise BackendUnavailable("cannot open the store: it is down")


def test_a_failed_startup_is_raised_to_the_test_client_as_bare_starlette_does() -> None:
    from starlette.testclient import TestClient

    async def failing(app: Starlette) -> Any:
        raise RuntimeError("the app's own startup failed")
        yield  # an async generator, as lifespans are

    bare = Starlette(lifespan=contextlib.asynccontextmanager(failing))
    with pytest.raises(RuntimeError, match="the app's own startup failed"), TestClient(bare):
        pass
    # The stack's own startup failing: the reason, where it entered and hung at the exit.
    app = Starlette()
    install(app, backend=UnopenableBackend())
    with pytest.raises(BackendUnavailable, match="it is down"), TestClient(app):
        pass
    app = Starlette()
    install(app, backend=MemoryBackend(), idempotency=True, drain=True)
    with pytest.raises(RuntimeError, match="asyncio only"), TestClient(app, backend="trio"):
        pass


async def catching(request: Request) -> JSONResponse:
    try:
        await request.body()
    except HTTPException as exc:
        return JSONResponse({"caught": exc.status_code})
    return JSONResponse({"caught": None})


@pytest.mark.parametrize("installed", [False, True], ids=["bare", "installed"])
async def test_an_endpoint_catches_the_body_limit_itself(installed: bool) -> None:
    app = Starlette(routes=[Route("/catch", catching, methods=["POST"])], max_body_size=25)
    if installed:
        install(app, backend=MemoryBackend(), idempotency=True, drain=True)
    for _ in range(2):  # supervised, then inline
        result = await drive(app, method="POST", path="/catch", body=b"x" * 30)
        assert result.status == 200
        assert result.body == b'{"caught":413}'


@pytest.mark.parametrize("installed", [False, True], ids=["bare", "installed"])
@pytest.mark.parametrize("warm", [False, True], ids=["first-request", "warm-route"])
async def test_an_error_the_apps_cleanup_raises_while_cancelled_reaches_the_caller(
    installed: bool, warm: bool
) -> None:
    """A request cancelled from outside (hypercorn cancels it when its client leaves) whose
    app fails in its cleanup: the caller hears of the app's error, as bare, whether the app
    ran in a task of its own or in the request's; the cancellation is its context."""
    failure = RuntimeError("cleanup failed")
    cleaned, entered = anyio.Event(), anyio.Event()

    async def failing(request: Request) -> JSONResponse:
        entered.set()
        try:
            if request.query_params.get("wait") == "1":
                await anyio.sleep_forever()
            return JSONResponse({})
        finally:
            if request.query_params.get("wait") == "1":
                cleaned.set()
                raise failure

    app = Starlette(routes=[Route("/fail", metered()(failing))])
    backend = MemoryBackend()
    if installed:
        install(app, backend=backend, idempotency=True, drain=True)
    if warm:
        assert (await drive(app, path="/fail")).status == 200
        entered = anyio.Event()
        await asyncio.sleep(0.05)
        backend.usage.clear()

    async def send(message: dict[str, Any]) -> None:
        pass

    raised: list[BaseException] = []

    async def client(*, task_status: Any) -> None:
        with anyio.CancelScope() as scope:
            task_status.started(scope)
            request = {**http_scope("/fail"), "query_string": b"wait=1"}
            try:
                await app(request, request_then_disconnect(asyncio.Event()), send)
            except BaseException as exc:  # what the server would hear
                raised.append(exc)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            scope = await group.start(client)
            await entered.wait()
            scope.cancel()
    assert cleaned.is_set()
    assert raised == [failure]
    assert isinstance(failure.__context__, anyio.get_cancelled_exc_class())
    if installed:
        # One usage record, and nothing stored claims a whole answer.
        await eventually(lambda: backend.usage, timeout=5, what="the usage record")
        await asyncio.sleep(0.05)
        (record,) = backend.usage
        assert record.outcome != "complete"
        info = await backend.get(record.generation_id)
        assert info is None or info.status.value != "complete"
