"""Telemetry is optional: without OpenTelemetry installed the package imports and serves,
and asking for telemetry then says what to install; bad options are refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from starlette.applications import Starlette

from asgi_disconnect import install

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys

    class NoOpenTelemetry:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, NoOpenTelemetry())
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from asgi_disconnect import MemoryBackend, install
    from asgi_disconnect.testing import drive

    async def hello(request):
        return PlainTextResponse("hello")

    app = Starlette(routes=[Route("/", hello)])
    install(app, backend=MemoryBackend())
    result = asyncio.run(drive(app))
    assert result.body == b"hello", result
    assert not any(name.startswith("opentelemetry") for name in sys.modules)
    try:
        install(Starlette(), backend=MemoryBackend(), telemetry=True)
    except ImportError as exc:
        print("refused:", exc)
    """
)


def test_the_package_serves_without_opentelemetry_and_says_what_telemetry_needs() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "refused: telemetry needs OpenTelemetry: pip install 'asgi-disconnect[otel]'" in (
        done.stdout
    )


def test_telemetry_takes_true_or_false_only() -> None:
    with pytest.raises(TypeError, match="telemetry must be True or False"):
        install(Starlette(), telemetry="yes")  # type: ignore[arg-type]


def test_telemetry_is_added_once_outside_the_stack() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from asgi_disconnect import TelemetryMiddleware

    app = Starlette()
    install(app, tracer_provider=TracerProvider(), idempotency=True)
    assert app.user_middleware[0].cls is TelemetryMiddleware  # outermost
    with pytest.raises(RuntimeError, match="already called"):
        install(app, telemetry=True)
