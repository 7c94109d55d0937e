"""A pytest plugin that writes each test's outcome to a file (``--outcomes PATH``), a line
``[node id, outcome]`` (JSON) per phase as it ends, so a run that has to be killed still
tells what it ran; :func:`read_outcomes` reads it back as
``{node id: "passed" | "failed" | "skipped" | "xfailed" | "xpassed"}``.

A test passed when its setup, call and teardown all passed; an error in any of them is
"failed", and so is a module that could not be collected. scripts/framework-suites compares
two such files, bare and with the stack.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# The worst phase stands for the test: a teardown error fails a test whose call passed.
RANK = {"passed": 0, "xpassed": 1, "skipped": 2, "xfailed": 3, "failed": 4}


def outcome_of(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    return report.outcome


def read_outcomes(path: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        test, outcome = json.loads(line)
        found[test] = max(found.get(test, "passed"), outcome, key=RANK.__getitem__)
    return found


class Outcomes:
    def __init__(self, path: Path) -> None:
        self.file = path.open("w", buffering=1)

    def write(self, test: str, outcome: str) -> None:
        self.file.write(json.dumps([test, outcome]) + "\n")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.write(report.nodeid, outcome_of(report))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.write(report.nodeid, "failed")

    def pytest_unconfigure(self) -> None:
        self.file.close()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes", metavar="PATH", help="write each test's outcome here (JSON)")


def pytest_configure(config: pytest.Config) -> None:
    # FastAPI's suite marks tests for pytest-xdist and runs with --strict-markers: without
    # xdist installed, those modules would not even load, bare or with the stack.
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist's grouping")
    path = config.getoption("outcomes")
    if path:
        config.pluginmanager.register(Outcomes(Path(path)), "framework-suite-outcomes")
