"""install() refuses an option it would only fail on at startup, naming the one meant."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette

from asgi_disconnect import MemoryBackend, install


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"shutdown_timout": 5},
            "install() got an unknown option 'shutdown_timout'; did you mean 'shutdown_timeout'?",
        ),
        ({"sinkz": []}, "install() got an unknown option 'sinkz'; did you mean 'sinks'?"),
        (
            {"request_logs": "json"},
            "install() got an unknown option 'request_logs'; did you mean 'request_log'?",
        ),
        (
            {"idempotency": {"tll": 60}},
            "install(idempotency=...) got an unknown option 'tll'; did you mean 'ttl'?",
        ),
        (
            {"drain": {"dealine": 10}},
            "install(drain=...) got an unknown option 'dealine'; did you mean 'deadline'?",
        ),
    ],
)
def test_a_mistyped_option_is_refused_at_install(options: dict[str, Any], message: str) -> None:
    app = Starlette()
    with pytest.raises(TypeError) as raised:
        install(app, backend=MemoryBackend(), **options)
    assert str(raised.value) == message
    assert app.user_middleware == []  # nothing half-added


def test_an_option_like_nothing_lists_the_options() -> None:
    with pytest.raises(TypeError, match="unknown option 'zzz'; one of backend, policy"):
        install(Starlette(), zzz=1)


def test_the_options_of_every_part_are_taken() -> None:
    app = Starlette()
    install(
        app,
        backend=MemoryBackend(),
        shutdown_timeout=5,
        client_timeout=None,
        idempotency={"ttl": 60},
        drain={"deadline": 10, "signals": False},
    )
    assert len(app.user_middleware) == 4
