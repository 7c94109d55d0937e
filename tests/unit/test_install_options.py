"""install() refuses an option it would only fail on at startup, naming the one meant."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
from starlette.applications import Starlette

from asgi_disconnect import DisconnectMiddleware, MemoryBackend, install


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


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        (
            {"policy": "detatch"},
            ValueError,
            "disconnect policy must be 'cancel' or 'detach', not 'detatch'; did you mean 'detach'?",
        ),
        (
            # A bare string is a sequence of one-character patterns: "/" matches every path.
            {"exclude_paths": "/healthz"},
            TypeError,
            "exclude_paths takes a sequence of path patterns (regular expressions), "
            "not '/healthz': write ['/healthz']",
        ),
        (
            {"exclude_paths": ["/ok", "(unclosed"]},
            ValueError,
            "exclude_paths: '(unclosed' is not a regular expression "
            "(missing ), unterminated subpattern at position 0)",
        ),
        (
            {"backend": 42},
            TypeError,
            "backend must be a backend such as connect('sqlite:///app.db'), not 42",
        ),
        ({"client_timeout": 0.5}, ValueError, "client_timeout must be at least 1 second, or None"),
        (
            {"upstreams": ["openai"]},
            TypeError,
            "upstreams takes a mapping of names to httpx clients, such as "
            "{\"openai\": client}, not ['openai']",
        ),
    ],
)
def test_a_value_that_cannot_work_is_refused_at_install_not_at_the_first_request(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    app = Starlette()
    with pytest.raises(error) as raised:
        install(app, **options)
    assert str(raised.value) == message
    assert app.user_middleware == []


def test_a_backend_url_is_connected_by_install(tmp_path: Any) -> None:
    """``backend="sqlite:///..."`` is what connect() makes of that URL, not an
    AttributeError at the first record."""
    from asgi_disconnect import DurableBackend

    app = Starlette()
    install(app, backend=f"sqlite:///{tmp_path / 'x.db'}")
    (disconnect,) = [m for m in app.user_middleware if m.cls.__name__ == "DisconnectMiddleware"]
    assert isinstance(disconnect.kwargs["backend"], DurableBackend)


def test_connect_names_the_option_meant() -> None:
    from asgi_disconnect import connect

    with pytest.raises(TypeError) as raised:
        connect("sqlite:///x.db", flush_intervall=0.1)
    assert str(raised.value) == (
        "connect('sqlite:///x.db') got an unknown option 'flush_intervall'; "
        "did you mean 'flush_interval'?"
    )
    with pytest.raises(TypeError, match="did you mean 'max_bytes'"):
        connect("memory://", max_byte=1)


def passed_on() -> list[str]:
    """The options install() hands to DisconnectMiddleware."""
    return list(inspect.signature(DisconnectMiddleware).parameters)[1:]


def test_the_reference_lists_every_option_install_passes_on() -> None:
    # The API reference is install()'s docstring: its list of DisconnectMiddleware's
    # options is the one the middleware takes, none missing, none stale.
    doc = inspect.getdoc(install) or ""
    listed = doc.split("``DisconnectMiddleware``'s options, passed to it", 1)[1]
    items = re.findall(r"^- (.*?): ", listed, flags=re.MULTILINE)
    named = [name for item in items for name in re.findall(r"``(\w+)``", item)]
    assert named == passed_on()


def test_install_signature_shows_its_keyword_options_with_the_middlewares_defaults() -> None:
    # The reference renders the signature as written: every option by name, no **options.
    ours = inspect.signature(install).parameters
    theirs = inspect.signature(DisconnectMiddleware).parameters
    assert next(iter(ours)) == "app"
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in list(ours.values())[1:])
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ours.values())
    assert list(ours)[1 : len(passed_on()) + 1] == passed_on()
    for name in passed_on():
        if name != "takeover_sinks":  # None: install()'s own sinks
            assert ours[name].default == theirs[name].default, name
    assert ours["takeover_sinks"].default is None
    assert ours["backend"].annotation == "Backend | str | None"  # a URL is connected
    source = inspect.getsource(inspect.unwrap(install))
    assert "**" not in source.split(") -> None:", 1)[0]
