"""README.md as its reader meets it, and every ```python block of README.md and docs/*.md
type-checking under ``mypy --strict``.

README's first screen says what the package does, gives the two commands that set it up on a
fresh machine (the test one is what CI runs) and a short example, and links on; what it says
to operators and contributors lives in docs/. (README's example is run as written in
test_quickstart.py.)

Each python block becomes a module of its own that starts with ``from readme_prelude import *``:
the prelude declares only what the prose leaves to the reader (the app, a ledger, a
mailer, some chunks, the package's names where a block does not import them).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api", reason="mypy is in the lint extra")

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

PRELUDE = """\
from typing import Any

from fastapi import FastAPI, Request
from asgi_disconnect import (
    DisconnectMiddleware,
    UsageRecord,
    connect,
    idempotent,
    install,
)

app = FastAPI()
ledger: Any  # the reader's billing client
mailer: Any  # the reader's e-mail client
chunks: list[bytes]  # a body as it arrives

__all__ = [
    "Any",
    "DisconnectMiddleware",
    "FastAPI",
    "Request",
    "UsageRecord",
    "app",
    "chunks",
    "connect",
    "idempotent",
    "install",
    "ledger",
    "mailer",
]
"""

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[Path, int, str]]:
    """(document, line of the opening fence, code) for each ```python block."""
    blocks = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            blocks.append((document, text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


def test_the_documents_have_python_examples() -> None:
    found = {document.name for document, _, _ in python_blocks()}
    assert {"README.md", "idempotency.md"} <= found, found


def test_every_python_example_type_checks_under_mypy_strict(tmp_path: Path) -> None:
    (tmp_path / "readme_prelude.py").write_text(PRELUDE, encoding="utf-8")
    documents: dict[str, str] = {}
    for index, (document, fence, code) in enumerate(python_blocks()):
        module = tmp_path / f"example_{index:02d}.py"
        # Padded so that mypy's line numbers are the document's.
        module.write_text("from readme_prelude import *" + "\n" * fence + code, encoding="utf-8")
        documents[str(module)] = str(document.relative_to(ROOT))
    stdout, stderr, status = mypy_api.run(
        [
            "--strict",
            "--python-version=3.11",
            "--config-file=",  # the reader's mypy, not this project's overrides
            f"--cache-dir={tmp_path / '.mypy_cache'}",
            "--no-color-output",
            "--show-error-codes",
            *documents,
        ]
    )
    report = stdout + stderr
    for path, name in documents.items():
        report = report.replace(path, name)
    assert status == 0, f"mypy --strict on the documents' examples:\n{report}"


README = (ROOT / "README.md").read_text(encoding="utf-8")
# What a reader sees before scrolling, give or take a terminal's height.
FIRST_SCREEN = "\n".join(README.splitlines()[:60])


def section(title: str) -> str:
    """README's ``## title`` section, without its heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", README, re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def test_readmes_first_screen_is_for_a_user() -> None:
    """What the package does, the two commands, a short example with ``install()`` and one
    policy decorator on a relaying route, and the way on into the docs; nothing for
    contributors or operators (other Pythons, send costs, server tables)."""
    assert "**cancel**" in FIRST_SCREEN
    assert "**detach**" in FIRST_SCREEN
    assert "bash scripts/demo" in FIRST_SCREEN
    assert "bash scripts/test" in FIRST_SCREEN
    (example,) = re.findall(r"```python\n(.*?)```", FIRST_SCREEN, re.S)
    code = [line for line in example.splitlines() if line.strip() and not line.startswith("#")]
    assert len(code) <= 25, f"README's first example has {len(code)} lines of code"
    assert example.count("install(app") == 1
    assert len(re.findall(r"^@disconnect_policy\(", example, re.M)) == 1
    assert "open_stream(" in example  # the route relays an upstream stream
    assert "](docs/quickstart.md)" in FIRST_SCREEN
    for aside in ("test-versions", "3.12", "| server |", "benchmarks"):
        assert aside not in FIRST_SCREEN, f"README's first screen speaks of {aside!r}"


def test_readme_leaves_operations_benchmarks_and_the_layout_to_the_docs() -> None:
    headings = re.findall(r"^## (.*)$", README, re.M)
    for moved in ("Backends", "Options", "Benchmarks", "Layout", "Deploys and provider cutovers"):
        assert moved not in headings, f"README still has '## {moved}'"
    assert len(README.splitlines()) <= 250
    assert "](docs/development.md#building-the-docs)" in README


def test_readmes_two_commands_are_the_ones_that_set_up_a_fresh_clone_and_ci_runs() -> None:
    (block,) = re.findall(r"```console\n(.*?)```", section("Two commands"), re.S)
    commands = [line[2:].split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["bash scripts/demo", "bash scripts/test"]
    for command in commands:
        script = (ROOT / command.split()[1]).read_text()
        assert "python3 -m venv .venv" in script, f"{command} does not set up .venv/"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash scripts/test" in ci, ".ci/run does not run README's test command"
