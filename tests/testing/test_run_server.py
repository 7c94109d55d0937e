from __future__ import annotations

import json
import textwrap
from typing import TYPE_CHECKING

import pytest

from asgi_disconnect.testing import SERVERS, run_server

if TYPE_CHECKING:
    from pathlib import Path

    from starlette.types import ASGIApp, Receive, Scope, Send

    from asgi_disconnect.testing import ServerName

pytestmark = [pytest.mark.anyio, pytest.mark.server]

# An app in a file of its own, for servers that import it; it logs its lifespan to a file.
TINY_APP = textwrap.dedent(
    """
    import json, os

    def log(line):
        with open(os.environ["TINY_APP_LOG"], "a") as file:
            file.write(line + "\\n")

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].rpartition(".")[2]
                log(kind)
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = json.dumps({"http_version": scope["http_version"]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    def make_app():
        return app
    """
)


def recording_app(events: list[str]) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"].rpartition(".")[2]
                events.append(kind)
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        body = json.dumps({"http_version": scope["http_version"]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    return app


def logged(log: Path) -> list[str]:
    return log.read_text().split()


@pytest.fixture
def tiny_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "tiny_app.py").write_text(TINY_APP)
    log = tmp_path / "lifespan.log"
    monkeypatch.setenv("TINY_APP_LOG", str(log))
    monkeypatch.syspath_prepend(str(tmp_path))
    return log


@pytest.mark.parametrize("server", SERVERS)
async def test_each_server_serves_over_its_protocol_and_runs_the_lifespan(
    server: ServerName,
) -> None:
    events: list[str] = []
    with run_server(recording_app(events), server=server) as srv:
        async with srv.client() as client:
            response = await client.get("/")
        tasks = await srv.tasks()
        started = list(events)
    http2 = server == "hypercorn-h2"
    assert (srv.server, srv.http2) == (server, http2)
    assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
    assert response.json() == {"http_version": "2" if http2 else "1.1"}
    with_lifespan = server != "granian-asginl"
    assert started == (["startup"] if with_lifespan else [])
    assert events == (["startup", "shutdown"] if with_lifespan else [])
    assert any(name.startswith("asgi_disconnect.testing._servers.") for name in tasks)


@pytest.mark.parametrize("server", ["uvicorn", "granian"])
async def test_lifespan_off(server: ServerName) -> None:
    events: list[str] = []
    with run_server(recording_app(events), server=server, lifespan=False) as srv:
        async with srv.client() as client:
            assert (await client.get("/")).status_code == 200
    assert events == []


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
async def test_an_import_string_is_served_in_this_process(
    tiny_app: Path, server: ServerName
) -> None:
    with run_server("tiny_app:make_app", server=server, factory=True) as srv:
        async with srv.client() as client:
            response = await client.get("/")
        assert srv.loop is not None
    assert response.json() == {"http_version": "1.1"}
    assert logged(tiny_app) == ["startup", "shutdown"]


async def test_granian_serves_an_import_string_from_a_process_of_its_own(
    tiny_app: Path,
) -> None:
    env = {"PYTHONPATH": str(tiny_app.parent)}
    with run_server("tiny_app:app", server="granian", env=env) as srv:
        async with srv.client() as client:
            response = await client.get("/")
        started = logged(tiny_app)
        with pytest.raises(RuntimeError, match="another process"):
            await srv.tasks()
    assert srv.loop is None
    assert response.headers["server"] == "granian"
    assert response.json() == {"http_version": "1.1"}
    assert started == ["startup"]
    assert logged(tiny_app) == ["startup", "shutdown"]


async def test_a_server_that_cannot_start_is_reported(tiny_app: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="granian exited"),
        run_server("tiny_app:missing", server="granian", env={"PYTHONPATH": str(tiny_app.parent)}),
    ):
        pass


def test_an_unknown_server_is_refused() -> None:
    with (
        pytest.raises(ValueError, match="unknown server 'daphne'"),
        run_server(recording_app([]), server="daphne"),  # type: ignore[arg-type]
    ):
        pass


def test_env_is_only_for_a_granian_process() -> None:
    with (
        pytest.raises(ValueError, match="env applies only"),
        run_server(recording_app([]), server="uvicorn", env={"A": "1"}),
    ):
        pass


async def test_tasks_shows_a_request_still_running() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while (await receive())["type"] != "http.disconnect":
            pass

    with run_server(app, server="uvicorn", lifespan=False) as srv:
        async with srv.client(timeout=5) as client, client.stream("GET", "/") as response:
            assert response.status_code == 200
            during = await srv.tasks()
    assert any(name.endswith("RequestResponseCycle.run_asgi") for name in during), during
