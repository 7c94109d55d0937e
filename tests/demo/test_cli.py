"""``asgi-disconnect``: the demo starts with one command and serves its routes; operators
list, show and tail the generations it stored; bad input gets a clear message and exit 2."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.server

CLI = [sys.executable, "-m", "asgi_disconnect._cli"]
CHAT = {"model": "fake-model", "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(check: Callable[[], object], what: Callable[[], str], timeout: float = 30) -> None:
    """Poll ``check`` until it is true; fail with ``what()`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what()
        time.sleep(0.1)


@dataclass
class DemoProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text()


@contextlib.contextmanager
def demo_process(*args: str, log: Path, env: dict[str, str] | None = None) -> Iterator[DemoProcess]:
    """``asgi-disconnect demo`` with ``args`` on a free port, ready, until the block exits."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*CLI, "demo", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            env=env,
        )
        demo = DemoProcess(proc, f"http://127.0.0.1:{port}", log)
        try:

            def ready() -> bool:
                assert proc.poll() is None, demo.output()
                try:
                    httpx.get(demo.url + "/readyz", timeout=1)
                except httpx.HTTPError:
                    return False
                return True

            wait_for(ready, demo.output)
            yield demo
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(20)


@contextlib.contextmanager
def running_demo(*args: str, log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """``asgi-disconnect demo`` with ``args`` on a free port, until the block exits."""
    with demo_process(*args, log=log, env=env) as demo:
        yield demo.url


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=60, check=False, cwd=cwd
    )


def test_the_demo_serves_its_routes_and_operators_read_them_back(tmp_path: Path) -> None:
    backend = f"sqlite:///{tmp_path / 'demo.db'}"
    log = tmp_path / "demo.log"
    with running_demo("--backend", backend, "--rate", "500", log=log) as url:
        page = httpx.get(url + "/")
        assert page.status_code == 200
        assert '<form id="ask" method="post" action="/ask"' in page.text
        chat = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert chat.text.endswith("data: [DONE]\n\n")
        messages = httpx.post(
            f"{url}/v1/messages",
            json={**CHAT, "max_tokens": 50},
            headers={"anthropic-version": "2023-06-01"},
            timeout=30,
        )
        assert "event: message_stop" in messages.text
        bad = httpx.post(f"{url}/v1/reports", content=b"{not json", timeout=30)
        assert bad.status_code == 400
        assert bad.headers["content-type"] == "application/problem+json"
        no_prompt = httpx.post(f"{url}/ask", data={}, timeout=30)
        assert no_prompt.status_code == 422
        assert no_prompt.headers["content-type"] == "application/problem+json"
        assert no_prompt.json()["type"] == "urn:asgi-disconnect:problem:invalid-request"
        unknown = httpx.get(f"{url}/demo/usage/gen_nothing")
        assert unknown.status_code == 404
        assert unknown.json()["type"] == "urn:asgi-disconnect:problem:usage-not-settled"
        stats = httpx.get(f"{url}/demo/stats").json()
        assert stats["in_flight"] == 0
        generation_id = chat.headers["x-generation-id"]
    port = url.rsplit(":", 1)[1]
    banner = log.read_text()
    assert f"open        http://127.0.0.1:{port}/" in banner
    assert "FakeProvider on http://127.0.0.1:" in banner

    listed = cli("generations", "list", "--backend", backend)
    assert listed.returncode == 0, listed.stderr
    assert generation_id in listed.stdout
    assert "complete" in listed.stdout
    shown = cli("generations", "show", generation_id, "--backend", backend)
    assert shown.returncode == 0, shown.stderr
    assert '"status": "complete"' in shown.stdout
    assert '"outcome": "complete"' in shown.stdout  # its usage record
    tail = cli("generations", "tail", generation_id, "--backend", backend)
    assert tail.returncode == 0
    assert tail.stdout == chat.text
    size = len(chat.content)
    rest = cli(
        "generations", "tail", generation_id, "--offset", str(size - 14), "--backend", backend
    )
    assert rest.returncode == 0
    assert rest.stdout == "data: [DONE]\n\n"
    past = cli("generations", "tail", generation_id, "--offset", "99999999", "--backend", backend)
    assert past.returncode == 2
    assert past.stderr == (
        f"asgi-disconnect: Offset Out Of Range: offset 99999999 is past the {size} bytes "
        "produced.\n"
    )
    assert past.stdout == ""
    missing = cli("generations", "show", "gen_" + "x" * 24, "--backend", backend)
    assert missing.returncode == 1
    assert "no generation" in missing.stderr


def test_bad_input_gets_a_clear_message() -> None:
    wrong = cli("generations", "list", "--backend", "mysql://nowhere")
    assert wrong.returncode == 2
    assert wrong.stderr.startswith("asgi-disconnect: ")
    assert "Traceback" not in wrong.stderr
    usage = cli("generations", "frobnicate")
    assert usage.returncode == 2
    assert "invalid choice" in usage.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("generations", "list", "--limit", "-3"), "argument --limit: must be 1 or more, not -3"),
        (("generations", "list", "--limit", "ten"), "argument --limit: 'ten' is not a whole"),
        (("generations", "tail", "gen_x", "--offset", "-5"), "--offset: must be 0 or more, not -5"),
        (("demo", "--port", "70000"), "argument --port: a port is 0 to 65535, not 70000"),
        (("demo", "--rate", "0"), "argument --rate: must be above 0, not 0"),
        (("demo", "--tokens", "-1"), "argument --tokens: must be 1 or more, not -1"),
    ],
)
def test_numbers_out_of_range_are_refused_by_the_parser(
    args: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    refused = cli(*args, cwd=tmp_path)
    assert refused.returncode == 2
    assert message in refused.stderr
    assert "Traceback" not in refused.stderr
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing created


def test_every_option_of_every_command_says_what_it_is_for() -> None:
    from asgi_disconnect._cli import parser

    def walk(command: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.Action]]:
        for action in command._actions:
            yield name, action
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield from walk(sub, f"{name} {sub_name}")

    actions = list(walk(parser(), "asgi-disconnect"))
    without = [
        f"{name}: {action.option_strings or action.dest}"
        for name, action in actions
        if not action.help
    ]
    assert without == []
    commands = {name for name, _ in actions}
    assert commands == {
        "asgi-disconnect",
        "asgi-disconnect demo",
        "asgi-disconnect generations",
        "asgi-disconnect generations list",
        "asgi-disconnect generations show",
        "asgi-disconnect generations tail",
    }


def test_a_sqlite_file_that_is_not_there_is_refused_not_created(tmp_path: Path) -> None:
    for args in (("list",), ("show", "gen_x"), ("tail", "gen_x")):
        missing = cli("generations", *args, cwd=tmp_path)
        assert missing.returncode == 2
        assert missing.stderr.startswith(
            f"asgi-disconnect: no SQLite database at {tmp_path / 'demo-generations.db'}: "
        )
        assert "--backend" in missing.stderr
    elsewhere = tmp_path / "elsewhere.db"
    named = cli("generations", "list", "--backend", f"sqlite:///{elsewhere}", cwd=tmp_path)
    assert named.returncode == 2
    assert f"no SQLite database at {elsewhere}: " in named.stderr
    assert list(tmp_path.iterdir()) == []
    # Asked for, the file is made: an empty store, which lists nothing.
    made = cli(
        "generations", "list", "--create", "--backend", f"sqlite:///{elsewhere}", cwd=tmp_path
    )
    assert (made.returncode, made.stderr) == (0, ""), made.stderr
    assert elsewhere.exists()
    again = cli("generations", "list", "--backend", f"sqlite:///{elsewhere}", cwd=tmp_path)
    assert (again.returncode, again.stdout) == (made.returncode, made.stdout)


def test_a_port_in_use_is_named_with_how_to_pick_another(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = cli("demo", "--port", str(port), cwd=tmp_path)
    assert busy.returncode == 2
    assert busy.stdout == ""  # no banner for a demo that does not start
    assert busy.stderr.startswith(f"asgi-disconnect: port {port} on 127.0.0.1 is taken ")
    suggested = int(busy.stderr.rsplit("pick another with --port ", 1)[1])
    assert suggested > port
    assert "Traceback" not in busy.stderr
    assert "Errno" not in busy.stderr


def test_the_port_suggested_is_free_and_not_the_one_fakeprovider_takes_alone(
    tmp_path: Path,
) -> None:
    # The quickstart runs FakeProvider on 8001 and its app on 8000: 8000 taken is no
    # reason to send the demo to 8001.
    with socket.socket() as taken:
        with contextlib.suppress(OSError):  # else another program has it: taken all the same
            taken.bind(("127.0.0.1", 8000))
            taken.listen()
        busy = cli("demo", "--port", "8000", cwd=tmp_path)
    assert busy.returncode == 2
    assert busy.stderr.startswith("asgi-disconnect: port 8000 on 127.0.0.1 is taken ")
    suggested = int(busy.stderr.rsplit("pick another with --port ", 1)[1])
    assert suggested not in (8000, 8001)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", suggested))  # free when it was named


@pytest.mark.parametrize(
    ("backend", "said"),
    [
        ("sqlite:////nonexistent/dir/demo.db", "the directory /nonexistent/dir does not exist"),
        ("postgresql://postgres@127.0.0.1:1/demo", "nothing listens at 127.0.0.1:1"),
        ("mysql://nowhere", "unknown backend URL scheme 'mysql'"),
    ],
)
def test_a_store_the_demo_cannot_use_is_refused_before_its_banner(
    backend: str, said: str, tmp_path: Path
) -> None:
    if backend.startswith("postgresql") and not importlib.util.find_spec("asyncpg"):
        pytest.skip("needs asyncpg")
    run = cli("demo", "--port", str(free_port()), "--backend", backend, cwd=tmp_path)
    assert run.returncode == 2
    assert run.stdout == ""  # no banner for a demo that does not start
    assert run.stderr.startswith("asgi-disconnect: ")
    assert said in run.stderr
    assert run.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("unimportable", "named"),
    [
        (("python_multipart", "multipart"), "python-multipart"),
        (("fastapi", "uvicorn"), "fastapi, uvicorn"),
    ],
)
def test_the_demo_names_what_is_missing_and_the_one_line_that_installs_it(
    unimportable: tuple[str, ...], named: str, tmp_path: Path
) -> None:
    # As after `pip install asgi-disconnect fastapi uvicorn`: the modules cannot be imported.
    hide = "".join(f"sys.modules[{name!r}] = None; " for name in unimportable)
    script = f"import sys; {hide}from asgi_disconnect._cli import main; sys.exit(main())"
    run = subprocess.run(
        [sys.executable, "-c", script, "demo", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr == (
        f"asgi-disconnect: the demo needs {named}, which "
        f"{'are' if ',' in named else 'is'} not installed: pip install -e '.[demo]' in a clone of "
        f"asgi-disconnect (bash scripts/demo does it), else pip install {named.replace(',', '')}\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_says_what_it_waits_for_and_a_second_one_interrupts_it(tmp_path: Path) -> None:
    backend = f"sqlite:///{tmp_path / 'demo.db'}"
    # A report that would run for hours: only an interruption ends it.
    slow = ("--backend", backend, "--tokens", "100000", "--rate", "5")
    with demo_process(*slow, log=tmp_path / "demo.log") as demo:
        received = b""
        with httpx.stream("POST", f"{demo.url}/v1/reports", json=CHAT, timeout=30) as report:
            generation_id = report.headers["x-generation-id"]
            for chunk in report.iter_bytes():
                received += chunk
                if received.count(b"\n\n") >= 3:
                    break
        # The client has gone; the report goes on, detached.
        demo.proc.send_signal(signal.SIGINT)
        wait_for(lambda: "Press Ctrl-C again" in demo.output(), demo.output)
        assert (
            "INFO:     Stopping: waiting up to 30 s for 1 generation still running to finish "
            "(new requests get 503).\n"
            "INFO:     Press Ctrl-C again to interrupt it now: what it produced is kept, marked "
            "interrupted.\n"
        ) in demo.output()
        assert demo.proc.poll() is None  # it waits
        refused = httpx.post(f"{demo.url}/v1/chat/completions", json=CHAT, timeout=30)
        assert refused.status_code == 503
        assert refused.json()["type"] == "urn:asgi-disconnect:problem:draining"
        demo.proc.send_signal(signal.SIGINT)
        # Well within the 30 s it would otherwise wait (the report alone runs for hours).
        assert demo.proc.wait(20) == 0
    output = demo.output()
    assert (
        "INFO:     Interrupting 1 generation: what was produced is kept (status interrupted).\n"
    ) in output
    assert "Traceback" not in output
    assert "draining:" not in output  # said once, by the demo, not again by the drain
    assert output.endswith("INFO:     Stopped.\n")
    assert output.count("Stopped.") == 1

    shown = cli("generations", "show", generation_id, "--backend", backend)
    assert shown.returncode == 0, shown.stderr
    generation = json.loads(shown.stdout)["generation"]
    assert generation["status"] == "interrupted"
    assert generation["size"] > len(received)
    kept = subprocess.run(
        [*CLI, "generations", "tail", generation_id, "--backend", backend],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert kept.returncode == 0
    assert kept.stdout.startswith(received)  # the prefix it produced, as the client read it
    assert b"[interrupted: " in kept.stderr


def test_a_stream_still_read_at_the_second_ctrl_c_ends_with_a_frame_that_says_why(
    tmp_path: Path,
) -> None:
    backend = f"sqlite:///{tmp_path / 'demo.db'}"
    slow = ("--backend", backend, "--tokens", "100000", "--rate", "20")
    with demo_process(*slow, log=tmp_path / "demo.log") as demo:
        read: list[bytes] = []
        started = threading.Event()

        def client() -> None:
            with httpx.stream(
                "POST", f"{demo.url}/v1/chat/completions", json=CHAT, timeout=60
            ) as chat:
                started.set()
                read.extend(chat.iter_bytes())

        reader = threading.Thread(target=client)
        reader.start()
        assert started.wait(30)
        wait_for(lambda: b"".join(read).count(b"\n\n") >= 2, lambda: repr(read))
        demo.proc.send_signal(signal.SIGINT)
        wait_for(lambda: "Press Ctrl-C again" in demo.output(), demo.output)
        assert "Stopping: waiting up to 30 s for 1 generation still running" in demo.output()
        demo.proc.send_signal(signal.SIGINT)
        assert demo.proc.wait(20) == 0
        reader.join(20)
        assert not reader.is_alive()
    body = b"".join(read)
    assert not body.endswith(b"data: [DONE]\n\n")
    last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"event: error\ndata: ")
    error = json.loads(last.split(b"data: ", 1)[1])["error"]
    assert error["type"] == "interrupted"
    assert error["retry_after"] == 5  # the demo's drain says when to come back
    shown = cli("generations", "show", error["generation_id"], "--backend", backend)
    assert json.loads(shown.stdout)["generation"]["status"] == "interrupted"


def test_ctrl_c_with_nothing_running_stops_at_once(tmp_path: Path) -> None:
    with demo_process(
        "--backend", f"sqlite:///{tmp_path / 'demo.db'}", log=tmp_path / "log"
    ) as demo:
        demo.proc.send_signal(signal.SIGINT)
        assert demo.proc.wait(20) == 0
    output = demo.output()
    assert output.endswith("INFO:     Stopping: no generation is running.\nINFO:     Stopped.\n")
    assert "Traceback" not in output


def test_the_demo_proxies_another_upstream_with_the_key_from_the_environment(
    tmp_path: Path,
) -> None:
    import os

    from asgi_disconnect.testing import FakeProvider

    with FakeProvider(tokens=5, tokens_per_second=1000) as provider:
        upstream = provider.url
        env = {**os.environ, "OPENAI_API_KEY": "sk-from-the-environment"}
        log = tmp_path / "demo.log"
        backend = f"sqlite:///{tmp_path / 'demo.db'}"
        with running_demo("--upstream", upstream, "--backend", backend, log=log, env=env) as url:
            answer = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert answer.text.endswith("data: [DONE]\n\n")
        assert len(provider.requests) == 1  # this upstream, not a FakeProvider of its own
    banner = log.read_text()
    assert f"upstream    {upstream}" in banner
    assert "no key" not in banner


def test_generations_list_and_show_say_which_route_when_and_which_counts_are_estimates(
    tmp_path: Path,
) -> None:
    backend = f"sqlite:///{tmp_path / 'demo.db'}"
    with running_demo("--backend", backend, "--rate", "50", log=tmp_path / "demo.log") as url:
        before = time.time()
        whole = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        with httpx.stream("POST", f"{url}/v1/reports", json=CHAT, timeout=30) as cut:
            cut_id = cut.headers["x-generation-id"]
            for _ in cut.iter_bytes():
                break  # the client leaves; the report goes on, detached
        with httpx.stream("POST", f"{url}/v1/messages", json=CHAT, timeout=30) as left:
            left_id = left.headers["x-generation-id"]
            for _ in left.iter_bytes():
                break  # the client leaves; cancel: no usage from the provider, an estimate

        def settled() -> bool:
            return all(
                httpx.get(f"{url}/generations/{g}").json()["status"] != "running"
                for g in (whole.headers["x-generation-id"], left_id, cut_id)
            )

        wait_for(settled, lambda: "still running")

    listed = cli("generations", "list", "--backend", backend)
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    columns = [
        "ID", "STATUS", "POLICY", "ROUTE", "CREATED (UTC)", "BYTES", "OUTPUT TOKENS", "ATTEMPT",
        "OWNER",
    ]  # fmt: skip
    assert re.split(r"  +", header) == columns
    cells = {
        row.split()[0]: dict(zip(columns, re.split(r"  +", row.strip()), strict=True))
        for row in rows
        if row.startswith("gen_")
    }
    complete = cells[whole.headers["x-generation-id"]]
    assert complete["ROUTE"] == "/v1/chat/completions"
    assert complete["STATUS"] == "complete"
    assert complete["OUTPUT TOKENS"] == "200"  # the provider's count, as it is
    assert complete["ATTEMPT"] == "1"
    assert re.fullmatch(r"[0-9a-f]{16}", complete["OWNER"])  # the process that produced it
    created = datetime.strptime(complete["CREATED (UTC)"], "%Y-%m-%d %H:%M:%S")
    assert abs(created.replace(tzinfo=UTC).timestamp() - before) < 60
    assert cells[cut_id]["ROUTE"] == "/v1/reports"
    assert cells[cut_id]["POLICY"] == "detach, detached"
    cancelled = cells[left_id]
    assert cancelled["ROUTE"] == "/v1/messages"
    assert cancelled["OUTPUT TOKENS"].endswith(" (estimated)")
    assert rows[-1].startswith("(estimated): counted from the text, not reported by the provider")

    shown = cli("generations", "show", left_id, "--backend", backend)
    assert shown.returncode == 0, shown.stderr
    answer = json.loads(shown.stdout)
    generation, (record,) = answer["generation"], answer["usage"]
    for when in (generation["created_at"], generation["finished_at"], record["started_at"]):
        assert when.endswith("+00:00")
        assert abs(datetime.fromisoformat(when).timestamp() - before) < 60
    assert record["usage_source"] == "estimated"
    assert record["usage_note"].startswith("estimated")
