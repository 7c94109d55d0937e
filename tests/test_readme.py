"""Every ```python block of README.md and docs/*.md type-checks under ``mypy --strict``.

Each block becomes a module of its own that starts with ``from readme_prelude import *``:
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
