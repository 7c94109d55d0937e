"""The soak in its small configuration: 60 clients for 60 s from network namespaces against
the quickstart's gateway under uvicorn, on PostgreSQL (two replicas, one restarted under
drain) and on SQLite, and the targets it reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration import netns

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.server, pytest.mark.timeout(420)]


def assert_targets(fig: dict[str, Any]) -> None:
    from benchmarks import _soak_targets

    assert _soak_targets.violations(fig) == []


@pytest.mark.parametrize(
    "backend", [pytest.param("postgres", marks=pytest.mark.postgres), "sqlite"]
)
def test_soak_small(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    netns.require()
    database = request.getfixturevalue("postgres_dsn") if backend == "postgres" else None
    figures = tmp_path / "soak.json"
    command = [sys.executable, "-m", "benchmarks.soak", "--clients", "60", "--duration", "60"]
    command += ["--seed", "1", "--backend", backend, "--no-bare", "--json", str(figures)]
    if database is not None:
        command += ["--postgres", database]  # the soak makes a schema of its own there
    command += ["--log", str(tmp_path / "clients.jsonl")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
    }
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert_targets(json.loads(figures.read_text()))
