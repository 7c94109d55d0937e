"""docs/testing.md's worked example of the testing helpers runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_worked_example_of_drive_and_lifespan_runs_as_written(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "testing.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, flags=re.DOTALL)
    assert "lifespan(app)" in code
    assert "await drive(" in code
    example = tmp_path / "example.py"
    example.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(example)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert (run.returncode, run.stderr) == (0, ""), run.stderr


def test_the_site_lists_the_page() -> None:
    assert "  - Testing your app: testing.md\n" in (ROOT / "mkdocs.yml").read_text()
