"""A pytest plugin for Starlette's and FastAPI's own test suites: every app they serve is
served through ``asgi_disconnect.install()``, as the quickstart's gateway adds it (last, so outside
the app's own middleware), with idempotency and drain on.

Only the outermost app of a request gets the stack, as in real use: the app the server (the
test's client) calls. A Starlette or FastAPI app mounted in another is left as it is; it
finds the outer app's ``scope["app"]`` when its own stack is built.

Loaded by scripts/framework-suites with ``-p framework_suite_stack`` in the run "with the
stack"; the run "bare" leaves it out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any

import pytest
from starlette.applications import Starlette

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, install

Build = Callable[[Any], Any]
Call = Callable[..., Coroutine[Any, Any, None]]

# Whether the app whose stack is being built is the one the server called; an app built
# outside any call (a test that builds it by hand) counts as served.
served: ContextVar[bool] = ContextVar("served", default=True)


def with_the_stack(build: Build) -> Build:
    @functools.wraps(build)
    def build_middleware_stack(app: Any) -> Any:
        # A test may drop a built stack to have it built again: install once per app.
        installed = any(entry.cls is DisconnectMiddleware for entry in app.user_middleware)
        if served.get() and not installed:
            install(app, backend=MemoryBackend(), idempotency=True, drain=True)
        return build(app)

    return build_middleware_stack


def telling_whether_served(call: Call) -> Call:
    @functools.wraps(call)
    async def __call__(app: Any, scope: Any, receive: Any, send: Any) -> None:
        # Starlette sets scope["app"] on entering: a mounted app finds its parent's there.
        token = served.set("app" not in scope)
        try:
            await call(app, scope, receive, send)
        finally:
            served.reset(token)

    return __call__


def pytest_configure(config: pytest.Config) -> None:
    classes: list[type[Any]] = [Starlette]
    try:
        from fastapi import FastAPI
    except ImportError:  # Starlette's suite does not need FastAPI
        pass
    else:
        classes.append(FastAPI)
    for cls in classes:
        # FastAPI builds its own stack; each class is wrapped where it defines the method.
        if "build_middleware_stack" in vars(cls):
            cls.build_middleware_stack = with_the_stack(vars(cls)["build_middleware_stack"])
    # FastAPI's __call__ ends in Starlette's, which sets scope["app"] and builds the stack.
    Starlette.__call__ = telling_whether_served(vars(Starlette)["__call__"])  # type: ignore[method-assign]
