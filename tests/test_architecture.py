"""The package's import graph follows its architecture, read from the source with ``ast``.

- a middleware imports no other middleware (``_disconnect`` and ``_writer`` are one);
- a store (``_backends/``) imports no middleware;
- the contract side (``_contract``, ``_records``, ``_errors``, ``_log``) imports no
  middleware and no store.

Every import counts: relative or absolute, at module level, under ``if TYPE_CHECKING:``
or inside a function; and so do imports reached through other modules of the package,
so a rule cannot be kept by importing through a helper. A failure lists each offending
chain of imports, edge by edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = "asgi_disconnect"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

MIDDLEWARES = {
    "DisconnectMiddleware": {"_disconnect", "_writer"},
    "IdempotencyMiddleware": {"_idempotency"},
    "MeteringMiddleware": {"_metering"},
    "TelemetryMiddleware": {"_telemetry"},
    "DrainMiddleware": {"_drain"},
}
CONTRACT_SIDE = {"_contract", "_records", "_errors", "_log"}

Graph = dict[str, set[str]]


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name (``asgi_disconnect._backends._sqlite``) -> file, for every module."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, is_package: bool, source: str, known: Iterable[str]) -> set[str]:
    """The package's modules that the module ``name`` imports, anywhere in ``source``."""
    known = set(known)
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join([*base, node.module] if node.module else base)
            else:
                origin = node.module or ""
            # ``from . import _x`` imports the module ``_x``; other names come from ``origin``.
            submodules = {f"{origin}.{alias.name}" for alias in node.names} & known
            found |= submodules
            if len(submodules) < len(node.names):
                found.add(origin)
    return {module for module in found if module in known and module != name}


def import_graph(root: Path = ROOT) -> Graph:
    modules = module_names(root)
    return {
        name: imports_of(name, path.name == "__init__.py", path.read_text("utf-8"), modules)
        for name, path in modules.items()
    }


def chains(graph: Graph, start: str, targets: set[str]) -> list[list[str]]:
    """The shortest chain of imports from ``start`` to each of ``targets`` it reaches."""
    previous: dict[str, str] = {}
    queue, seen = [start], {start}
    while queue:
        module = queue.pop(0)
        for imported in sorted(graph[module]):
            if imported not in seen:
                seen.add(imported)
                previous[imported] = module
                queue.append(imported)
    found = []
    for target in sorted(targets & seen - {start}):
        chain = [target]
        while chain[-1] != start:
            chain.append(previous[chain[-1]])
        found.append(chain[::-1])
    return found


def short(module: str) -> str:
    return module.removeprefix(PACKAGE + ".")


def violations(graph: Graph) -> list[str]:
    """Each broken rule as ``rule: a -> b -> c``."""

    def full(names: set[str]) -> set[str]:
        return {f"{PACKAGE}.{name}" for name in names}

    middleware_of = {m: owner for owner, names in MIDDLEWARES.items() for m in full(names)}
    backends = {m for m in graph if m.startswith(f"{PACKAGE}._backends")}
    rules: list[tuple[str, set[str], set[str]]] = []
    for owner, names in MIDDLEWARES.items():
        others = {m for m, other in middleware_of.items() if other != owner}
        rules.append((f"{owner} imports another middleware", full(names), others))
    rules.append(("a store imports a middleware", backends, set(middleware_of)))
    rules.append(
        (
            "the contract side imports a middleware or a store",
            full(CONTRACT_SIDE),
            set(middleware_of) | backends,
        )
    )
    found = []
    for rule, sources, forbidden in rules:
        for source in sorted(sources & set(graph)):
            for chain in chains(graph, source, forbidden):
                if not forbidden & set(chain[1:-1]):  # else its first part is reported
                    found.append(f"{rule}: " + " -> ".join(map(short, chain)))
    return found


def test_the_import_graph_follows_the_architecture() -> None:
    broken = violations(import_graph())
    assert not broken, "imports against the architecture:\n" + "\n".join(broken)


def test_every_named_module_exists() -> None:
    modules = set(module_names(ROOT))
    named = {name for names in MIDDLEWARES.values() for name in names} | CONTRACT_SIDE
    missing = {name for name in named if f"{PACKAGE}.{name}" not in modules}
    assert not missing, f"the rules name modules that are gone: {sorted(missing)}"


def test_the_graph_sees_the_imports_it_must() -> None:
    graph = import_graph()
    assert f"{PACKAGE}._writer" in graph[f"{PACKAGE}._disconnect"]
    # Under TYPE_CHECKING.
    assert f"{PACKAGE}._log" in graph[f"{PACKAGE}._contract"]
    # Inside a function, two dots up.
    assert f"{PACKAGE}._backends._sqlite" in graph[f"{PACKAGE}._backends"]
    assert f"{PACKAGE}._records" in graph[f"{PACKAGE}._backends._sqlite"]


SOURCE = """\
from typing import TYPE_CHECKING

import asgi_disconnect._metering
from . import _sibling
from ._contract import RequestState
from .. import _idempotency
from asgi_disconnect import _disconnect as d
from .. import connect

if TYPE_CHECKING:
    from .._records import UsageRecord

def lazy() -> None:
    from .._log import Generation
    from asgi_disconnect._backends._memory import MemoryBackend
"""


@pytest.mark.parametrize(
    ("expected", "present"),
    [
        ("_metering", True),
        ("_backends._sibling", True),
        ("_backends._contract", True),
        ("_idempotency", True),
        ("_disconnect", True),
        ("_records", True),
        ("_log", True),
        ("_backends._memory", True),
        ("", True),  # the package itself, for ``connect``
        ("_backends", False),  # ``from . import _sibling`` is the module, not the package
        ("_contract", False),  # ``from ._contract`` in _backends is _backends._contract
        ("_backends._store", False),
    ],
)
def test_every_form_of_import_counts(expected: str, present: bool) -> None:
    known = {PACKAGE} | {
        f"{PACKAGE}.{name}"
        for name in (
            "_metering",
            "_idempotency",
            "_disconnect",
            "_records",
            "_log",
            "_contract",
            "_backends",
            "_backends._sibling",
            "_backends._contract",
            "_backends._memory",
            "_backends._store",
        )
    }
    found = imports_of(f"{PACKAGE}._backends._store", False, SOURCE, known)
    module = f"{PACKAGE}.{expected}" if expected else PACKAGE
    assert (module in found) is present, sorted(map(short, found))


def test_a_broken_rule_names_its_chain() -> None:
    graph: Graph = {
        f"{PACKAGE}.{name}": set() for name in ("_idempotency", "_resume", "_disconnect")
    }
    graph[f"{PACKAGE}._idempotency"].add(f"{PACKAGE}._resume")
    graph[f"{PACKAGE}._resume"].add(f"{PACKAGE}._disconnect")
    assert violations(graph) == [
        "IdempotencyMiddleware imports another middleware: _idempotency -> _resume -> _disconnect"
    ]
