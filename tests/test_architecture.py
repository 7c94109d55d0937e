"""The package's import graph follows its architecture, read from the source with ``ast``.

- a middleware imports no other middleware (``_disconnect`` and ``_writer`` are one);
- a store (``_backends/``) imports no middleware, and not the live log (``_log``): it is
  handed records and bytes, and knows a running generation as the contract's ``LiveLog``;
- the contract side (``_contract``, ``_records``, ``_errors``, ``_log``) imports no
  middleware and no store; ``_contract`` imports neither the live log nor a policy module;
- only DisconnectMiddleware, which owns the log, imports it: the other middlewares
  (IdempotencyMiddleware among them) read a generation through the contract;
- ``upstream`` reaches the request only through the contract: it imports no middleware, no
  store, not the live log and no metering (``metering``, ``_metering``); it reads streams
  with the stream parser, ``_llm_stream``, a low module that metering uses too;
- a low module (the records, the exceptions, SSE framing, the stream parser) imports no
  module of the package above it;
- the response side (``_outbound``, ``_outcome``, ``_writer``) frames an event stream with
  ``_frames`` and knows the upstream errors from ``_errors``: it imports neither the resume
  endpoints (``_resume``) nor ``upstream``;
- the package has no import cycle; a failure names each cycle as its chain;
- no module imports another library's private names (``x._y``, ``from x import _y``).

Every import counts: relative or absolute, at module level, under ``if TYPE_CHECKING:``
or inside a function; and so do imports reached through other modules of the package,
so a rule cannot be kept by importing through a helper. A failure lists each offending
chain of imports, edge by edge.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

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
# The generation log itself: its owner (DisconnectMiddleware) writes it; the others know a
# generation by the contract's protocols (GenerationOutput, LiveLog).
LIVE_LOG = "_log"
LOG_OWNER = "DisconnectMiddleware"
# Where a disconnect policy is chosen (the contract names only the Policy enum).
POLICY_MODULES = {"_policy"}
UPSTREAM = "upstream"
METERING = {"metering", "_metering"}
# Imported by the modules above them, never the reverse: the records, the exceptions, SSE
# framing, and the stream parser (the SSE decoder, the provider adapters, StreamMeter).
LOW_MODULES = {"_records", "_errors", "_frames", "_llm_stream", "_adapters", "sse"}
# DisconnectMiddleware's response side, below the exchange that serves the resume endpoints.
RESPONSE_SIDE = {"_outbound", "_outcome", "_writer"}
RESUME = "_resume"

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


def chains(
    graph: Graph, start: str, targets: set[str], avoid: Iterable[str] = ()
) -> list[list[str]]:
    """The shortest chain of imports from ``start`` to each of ``targets`` it reaches, not
    through ``avoid``."""
    previous: dict[str, str] = {}
    queue, seen = [start], {start, *avoid}
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


def full(names: Iterable[str]) -> set[str]:
    return {f"{PACKAGE}.{name}" for name in names}


class Rule(NamedTuple):
    name: str
    sources: set[str]
    forbidden: set[str]


def violations(graph: Graph) -> list[str]:
    """Each broken rule as ``rule: a -> b -> c``."""
    middleware_of = {m: owner for owner, names in MIDDLEWARES.items() for m in full(names)}
    backends = {m for m in graph if m.startswith(f"{PACKAGE}._backends")}
    rules: list[Rule] = []
    for owner, names in MIDDLEWARES.items():
        others = {m for m, other in middleware_of.items() if other != owner}
        rules.append(Rule(f"{owner} imports another middleware", full(names), others))
    rules.append(Rule("a store imports a middleware", backends, set(middleware_of)))
    rules.append(
        Rule(
            "the contract side imports a middleware or a store",
            full(CONTRACT_SIDE),
            set(middleware_of) | backends,
        )
    )
    log = full({LIVE_LOG})
    rules.append(Rule("a store imports the live log", backends, log))
    rules.append(
        Rule(
            "the contract imports the live log or a policy module",
            full({"_contract"}),
            log | full(POLICY_MODULES),
        )
    )
    for owner, names in MIDDLEWARES.items():
        if owner != LOG_OWNER:
            rules.append(Rule(f"{owner} imports the live log", full(names), log))
    rules.append(
        Rule(
            "upstream imports metering, a middleware, a store or the live log",
            full({UPSTREAM}),
            full(METERING) | set(middleware_of) | backends | log,
        )
    )
    low = full(LOW_MODULES)
    rules.append(Rule("a low module imports a higher one", low, set(graph) - low))
    rules.append(
        Rule(
            "the response side imports _resume or upstream",
            full(RESPONSE_SIDE),
            full({RESUME, UPSTREAM}),
        )
    )
    found = []
    for rule in rules:
        for source in sorted(rule.sources & set(graph)):
            for chain in chains(graph, source, rule.forbidden):
                if not rule.forbidden & set(chain[1:-1]):  # else its first part is reported
                    found.append(f"{rule.name}: " + " -> ".join(map(short, chain)))
    return found


def cycles(graph: Graph) -> list[list[str]]:
    """Each import cycle as its chain, ``a -> b -> ... -> a``: for every import that lies on
    a cycle, the shortest way back; each cycle once, from its first module by name."""
    found: set[tuple[str, ...]] = set()
    for module in graph:
        for imported in graph[module]:
            for back in chains(graph, imported, {module}):
                ring = [module, *back[:-1]]
                first = ring.index(min(ring))
                ring = ring[first:] + ring[:first]
                found.add((*ring, ring[0]))
    return [list(cycle) for cycle in sorted(found)]


def test_the_import_graph_follows_the_architecture() -> None:
    broken = violations(import_graph())
    assert not broken, "imports against the architecture:\n" + "\n".join(broken)


def test_the_package_has_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(map(short, c)) for c in found)


def test_a_cycle_is_named_by_its_chain() -> None:
    graph = graph_of(
        [
            ("_records", "_frames"),
            ("_frames", "_errors"),
            ("_errors", "_records"),
            ("_errors", "_frames"),
            ("upstream", "_records"),
        ]
    )
    assert [" -> ".join(map(short, cycle)) for cycle in cycles(graph)] == [
        "_errors -> _frames -> _errors",
        "_errors -> _records -> _frames -> _errors",
    ]
    assert cycles(graph_of([("upstream", "_records"), ("_records", "_errors")])) == []


def test_every_named_module_exists() -> None:
    modules = set(module_names(ROOT))
    named = {name for names in MIDDLEWARES.values() for name in names} | CONTRACT_SIDE
    named |= {LIVE_LOG, UPSTREAM, RESUME} | POLICY_MODULES | METERING | LOW_MODULES
    named |= RESPONSE_SIDE
    missing = {name for name in named if f"{PACKAGE}.{name}" not in modules}
    assert not missing, f"the rules name modules that are gone: {sorted(missing)}"


def test_the_graph_sees_the_imports_it_must() -> None:
    graph = import_graph()
    assert f"{PACKAGE}._writer" in graph[f"{PACKAGE}._disconnect"]
    # Under TYPE_CHECKING.
    assert f"{PACKAGE}._records" in graph[f"{PACKAGE}._contract"]
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


@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        (
            [("_backends._memory", "_helper"), ("_helper", "_log")],
            "a store imports the live log: _backends._memory -> _helper -> _log",
        ),
        (
            [("_contract", "_policy")],
            "the contract imports the live log or a policy module: _contract -> _policy",
        ),
        (
            [("_contract", "_problem"), ("_problem", "_log")],
            "the contract imports the live log or a policy module: _contract -> _problem -> _log",
        ),
        (
            [("_idempotency", "_helper"), ("_helper", "_log")],
            "IdempotencyMiddleware imports the live log: _idempotency -> _helper -> _log",
        ),
        (
            [("upstream", "metering"), ("metering", "_metering")],
            "upstream imports metering, a middleware, a store or the live log: "
            "upstream -> metering",
        ),
        (
            [("upstream", "_helper"), ("_helper", "_metering")],
            "upstream imports metering, a middleware, a store or the live log: "
            "upstream -> _helper -> _metering",
        ),
        (
            [("upstream", "_llm_stream"), ("_llm_stream", "_adapters")],
            None,
        ),
        (
            [("upstream", "_backends"), ("_backends", "_backends._sqlite")],
            "upstream imports metering, a middleware, a store or the live log: "
            "upstream -> _backends",
        ),
        (
            [("_records", "_contract")],
            "a low module imports a higher one: _records -> _contract",
        ),
        (
            [("_frames", "_helper"), ("_helper", "_records")],
            "a low module imports a higher one: _frames -> _helper",
        ),
        (
            [("_llm_stream", "_adapters"), ("_adapters", "sse"), ("_errors", "_frames")],
            None,
        ),
        (
            [("_writer", "_helper"), ("_helper", "_resume")],
            "the response side imports _resume or upstream: _writer -> _helper -> _resume",
        ),
        (
            [("_outcome", "_resume")],
            "the response side imports _resume or upstream: _outcome -> _resume",
        ),
        (
            [("_outcome", "upstream")],
            "the response side imports _resume or upstream: _outcome -> upstream",
        ),
        (
            # Up to the exchange, which serves the resume endpoints: a way round counts too.
            [("_outbound", "_disconnect"), ("_disconnect", "_resume")],
            "the response side imports _resume or upstream: _outbound -> _disconnect -> _resume",
        ),
    ],
)
def test_each_rule_names_its_chain(edges: list[tuple[str, str]], expected: str | None) -> None:
    assert violations(graph_of(edges)) == ([] if expected is None else [expected])


def graph_of(edges: list[tuple[str, str]]) -> Graph:
    graph: Graph = {}
    for source, target in edges:
        graph.setdefault(f"{PACKAGE}.{source}", set()).add(f"{PACKAGE}.{target}")
        graph.setdefault(f"{PACKAGE}.{target}", set())
    return graph


def test_disconnect_middleware_owns_the_log() -> None:
    graph: Graph = {f"{PACKAGE}._disconnect": {f"{PACKAGE}._log"}, f"{PACKAGE}._log": set()}
    assert violations(graph) == []


# -- other libraries' private internals ---------------------------------------------------

# What reaches into another library's internals: asyncio's task bookkeeping, a function's
# code object and closure cells, the loop's signal handlers and a handle's callback, a server
# recognised by the module its objects come from. Dunder names that are plain Python
# (``__name__``, ``__self__``, ...) are not on the list.
PRIVATE_ATTRIBUTES = {
    "__closure__",
    "__code__",
    "__module__",
    "cell_contents",
    "co_consts",
    "co_freevars",
}
# Names with a leading underscore that are documented API: a named tuple's methods.
DOCUMENTED = {"_asdict", "_field_defaults", "_fields", "_make", "_replace"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in DOCUMENTED


def private_internals(source: str, own: set[str]) -> set[str]:
    """Other libraries' private names that ``source`` uses: imported (``from x import _y``,
    ``x._y``), read as an attribute of something that is not the package's own (``own``:
    names it defines), or through ``getattr`` with a constant."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith(PACKAGE):
                found.update(p for p in node.module.split(".") if _private(p))
                found.update(a.name for a in node.names if _private(a.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith(PACKAGE):
                    found.update(p for p in alias.name.split(".") if _private(p))
        elif isinstance(node, ast.Attribute):
            if node.attr in PRIVATE_ATTRIBUTES or (_private(node.attr) and node.attr not in own):
                found.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            name = node.args[1].value
            if name in PRIVATE_ATTRIBUTES or (_private(name) and name not in own):
                found.add(name)
    return found


def own_names(root: Path = ROOT) -> set[str]:
    """Every private name the package defines on its objects: its functions and classes,
    the attributes it assigns (``self._x = ...``, class attributes) and its slots."""
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
                if isinstance(node, ast.ClassDef):
                    names.update(_class_attributes(node))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {name for name in names if _private(name)}


def _class_attributes(node: ast.ClassDef) -> set[str]:
    """A class body's assigned names, its ``__slots__`` entries among them."""
    names: set[str] = set()
    for statement in node.body:
        targets: list[ast.expr] = []
        if isinstance(statement, ast.Assign):
            targets = statement.targets
        elif isinstance(statement, ast.AnnAssign | ast.AugAssign):
            targets = [statement.target]
        for target in targets:
            if isinstance(target, ast.Name):
                names.add(target.id)
                if target.id == "__slots__":
                    names.update(
                        c.value
                        for c in ast.walk(statement)
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)
                    )
    return names


def test_other_libraries_private_internals_are_only_the_known_ones() -> None:
    own = own_names()
    found = {
        (path.name, name)
        for path in sorted(ROOT.rglob("*.py"))
        for name in private_internals(path.read_text("utf-8"), own)
    }
    assert found == set(), f"private internals of another library: {sorted(found)}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from asyncio.tasks import _enter_task", {"_enter_task"}),
        ("from starlette._utils import is_async_callable", {"_utils"}),
        ("import anyio._core._eventloop", {"_core", "_eventloop"}),
        ("handlers = loop._signal_handlers", {"_signal_handlers"}),
        ("x = getattr(loop, '_signal_handlers', {})", {"_signal_handlers"}),
        ("code = send.__code__", {"__code__"}),
        ("self._own = 1\nx = self._own", set()),
        ("from asgi_disconnect._log import Generation", set()),
        ("name = request.__class__.__name__", set()),
        ("url = parts._replace(query='')", set()),
    ],
)
def test_a_private_internal_is_found_however_it_is_reached(source: str, expected: set[str]) -> None:
    assert private_internals(source, {"_own"}) == expected


# -- other libraries' private names, imported ----------------------------------------------


def _foreign(module: str) -> bool:
    return module != PACKAGE and not module.startswith(PACKAGE + ".")


def private_imports(source: str) -> list[tuple[int, str]]:
    """Each import of another library's private name in ``source``, anywhere, by line: a
    private module on its path (``import x._y``, ``from x._y import z``) or a private name
    taken from a module (``from x import _y``). The package's own imports do not count, nor
    a private alias of a public name (``from asyncio import tasks as _tasks``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _foreign(alias.name) and any(map(_private, alias.name.split("."))):
                    found.append((node.lineno, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if not _foreign(node.module):
                continue
            names = [alias.name for alias in node.names]
            if not any(map(_private, node.module.split("."))):
                names = [name for name in names if _private(name)]
            if names:
                found.append((node.lineno, f"from {node.module} import {', '.join(names)}"))
    return sorted(found)


def test_no_module_imports_another_librarys_private_names() -> None:
    found = [
        f"{short(name)}:{line}: {statement}"
        for name, path in module_names(ROOT).items()
        for line, statement in private_imports(path.read_text("utf-8"))
    ]
    assert not found, "imports of another library's private names:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "from asyncio.tasks import _enter_task, current_task",
            ["from asyncio.tasks import _enter_task"],
        ),
        ("import anyio._core._eventloop", ["import anyio._core._eventloop"]),
        (
            "from starlette._utils import is_async_callable",
            ["from starlette._utils import is_async_callable"],
        ),
        (
            "def f():\n    from asyncio.events import _get_running_loop",
            ["from asyncio.events import _get_running_loop"],
        ),
        ("from asyncio import tasks as _tasks", []),
        ("import asyncio.tasks", []),
        ("from __future__ import annotations", []),
        ("from asgi_disconnect._log import Generation", []),
        ("from ._log import Generation\nfrom .. import _contract", []),
    ],
)
def test_a_private_import_is_found_however_it_is_written(source: str, expected: list[str]) -> None:
    assert [statement for _, statement in private_imports(source)] == expected


# -- the exchange's stages, as docs/architecture.md draws them ------------------------------


def documented_moves(heading: str) -> dict[str, set[str]]:
    """The moves the table under ``### {heading}`` of docs/architecture.md allows."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text("utf-8")
    section = text.split(f"### {heading}", 1)[1].split("\n#", 1)[0]
    moves: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            targets = {name.strip(" `") for name in cells[1].split(",") if name.strip()}
            moves[cells[0].strip("`")] = targets
    return moves


TABLES = [
    ("Stage:", "MOVES", "Stage"),
    ("Client:", "CLIENT_MOVES", "Client"),
    ("Delivery:", "DELIVERY_MOVES", "Delivery"),
]


@pytest.mark.parametrize(("heading", "table", "kind"), TABLES)
def test_the_documented_states_are_the_codes(heading: str, table: str, kind: str) -> None:
    from asgi_disconnect import _states

    moves = getattr(_states, table)
    code = {start.value: {to.value for to in targets} for start, targets in moves.items()}
    assert set(code) == {state.value for state in getattr(_states, kind)}
    assert documented_moves(heading) == code


@pytest.mark.parametrize(("heading", "table", "kind"), TABLES)
def test_a_move_the_table_does_not_allow_raises_naming_both(
    heading: str, table: str, kind: str
) -> None:
    from asgi_disconnect import _states

    moves = getattr(_states, table)
    for start in getattr(_states, kind):
        for to in getattr(_states, kind):
            if to in moves[start]:
                assert _states.moved(moves, start, to) is to
            else:
                with pytest.raises(RuntimeError, match=f"from {start.value} to {to.value}"):
                    _states.moved(moves, start, to)


def test_the_exchange_moves_its_stage_by_the_table() -> None:
    from asgi_disconnect._disconnect import _Exchange
    from asgi_disconnect._states import Stage

    exchange = _Exchange.__new__(_Exchange)
    exchange.stage = Stage.ENDED
    with pytest.raises(RuntimeError, match="from ended to running"):
        exchange.move(Stage.RUNNING)
    assert exchange.stage is Stage.ENDED


def test_only_the_exchange_writes_where_its_client_stands() -> None:
    """``client`` is assigned in ``_disconnect`` alone (the exchange); every other part
    reports to it (``client_left``)."""
    found = []
    for name, path in module_names(ROOT).items():
        if short(name) == "_disconnect":
            continue
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr == "client":
                        found.append(f"{short(name)}:{node.lineno}")
    assert not found, found


# -- the client writer owns delivery ---------------------------------------------------------


def writer_fields_assigned(source: str) -> list[str]:
    """Assignments to a client writer's fields (``writer.x = ...``, ``self.out.writer.x += ...``)
    in ``source``, as ``writer.x``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if not isinstance(part, ast.Attribute) or not isinstance(part.ctx, ast.Store):
                    continue
                owner = part.value
                if (isinstance(owner, ast.Name) and owner.id == "writer") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "writer"
                ):
                    found.append(f"writer.{part.attr}")
    return found


def test_only_the_writer_assigns_its_fields() -> None:
    """The exchange and the response side ask the client writer (its methods); they never
    set its state, its counters or what it handed over."""
    found = {
        f"{short(name)}: {assigned}"
        for name, path in module_names(ROOT).items()
        if short(name) != "_writer"
        for assigned in writer_fields_assigned(path.read_text("utf-8"))
    }
    assert not found, sorted(found)


def test_an_assignment_to_a_writers_field_is_found() -> None:
    source = "writer.direct = False\nself.out.writer.delivery = 1\nx.count += 1\nself.writer = w\n"
    assert writer_fields_assigned(source) == ["writer.direct", "writer.delivery"]


# What DisconnectMiddleware writes of a request's state and the others read as one frozen
# ``Outcome`` (``RequestState.progress()``, ``on_end``): read by name only where written.
OUTCOME_FIELDS = {
    "policy",
    "delivered_bytes",
    "delivery",
    "detached",
    "ending",
    "disconnect_reason",
    "response_status",
    "idempotency",
    "stopped_by",
}
# DisconnectMiddleware's modules, and the contract that builds the Outcome from them.
OUTCOME_WRITERS = {"_disconnect", "_writer", "_outbound", "_outcome", "_contract"}


def state_fields_read(source: str) -> list[str]:
    """Reads of the outcome's fields on a request's state (``state.detached``,
    ``self.state.ending``, ``tee.state.delivery``) in ``source``, as ``state.x``;
    assignments are not reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and node.attr in OUTCOME_FIELDS
        ):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "state") or (
                isinstance(owner, ast.Attribute) and owner.attr == "state"
            ):
                found.append(f"state.{node.attr}")
    return found


def test_the_other_middlewares_read_how_an_exchange_went_only_from_its_outcome() -> None:
    """Metering, idempotency, telemetry, drain and the helpers read the frozen Outcome,
    never the fields DisconnectMiddleware writes on the state."""
    found = {
        f"{short(name)}: {read}"
        for name, path in module_names(ROOT).items()
        if short(name) not in OUTCOME_WRITERS
        for read in state_fields_read(path.read_text("utf-8"))
    }
    assert not found, sorted(found)


def test_a_read_of_an_outcome_field_is_found() -> None:
    source = (
        "state.detached\nself.state.ending\nx = tee.state.delivery\n"
        "state.idempotency = 'fresh'\nprogress.detached\nstate.generation\n"
    )
    assert state_fields_read(source) == ["state.detached", "state.ending", "state.delivery"]
