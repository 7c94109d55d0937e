"""What Starlette and FastAPI apps do bare, they do with the stack installed."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from asgi_disconnect import MemoryBackend, install
from asgi_disconnect.testing import drive

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
        install(app, backend=MemoryBackend())
    assert await statuses(app, PLAN) == [413, 200, 413, 200, 413, 200]


async def test_a_route_limit_above_the_apps_holds_on_the_first_request() -> None:
    app = limited_app()
    install(app, backend=MemoryBackend())
    # The first request to a route runs supervised (the stack reads ahead for the client):
    # the body is read only when the app asks, after routing set the route's limit.
    assert await statuses(app, [("/echo", 60)]) == [200]


