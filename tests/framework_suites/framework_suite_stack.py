"""A pytest plugin for Starlette's and FastAPI's own test suites: every app they build is
served through ``asgi_disconnect.install()``, as README's gateway adds it (last, so outside
the app's own middleware), with idempotency and drain on.

Loaded by scripts/framework-suites with ``-p framework_suite_stack`` in the run "with the
stack"; the run "bare" leaves it out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
from starlette.applications import Starlette

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, install

Build = Callable[[Any], Any]


def with_the_stack(build: Build) -> Build:
    @functools.wraps(build)
    def build_middleware_stack(app: Any) -> Any:
        # A test may drop a built stack to have it built again: install once per app.
        if not any(entry.cls is DisconnectMiddleware for entry in app.user_middleware):
            install(app, backend=MemoryBackend(), idempotency=True, drain=True)
        return build(app)

    return build_middleware_stack


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
