"""The project's layout, read from its source: import graph and module sizes.

Nothing here imports the project: each module under `sdk/`, `server_ext/` and `scripts/` (whose
programs import their sibling modules by their plain names) is parsed with `ast`, and every
import it holds counts, wherever it is written (module level, inside a function, under
`if TYPE_CHECKING:`). A cycle closed by a function-level or type-checking
import is still a cycle: it only moves the failure from import time to call time, and the
modules in it still cannot be read apart.

Edges are the imports as written, resolved to the deepest project module they name
(`from turnkv_server.router import app` is an edge to `turnkv_server.router.app`;
`from turnkv import Session` one to the package `turnkv`, whose `__init__` runs). The parent
packages that Python initialises on the way to a submodule are not edges of their own:
otherwise every package whose `__init__` re-exports a submodule would form "a cycle" with it.

The rules:
- no import cycle among the project's own modules (`turnkv.*`, `turnkv_server.*`, the
  scripts');
- the router and the KV connector never import each other, directly or through other
  project modules: they share the engine protocol, nothing else;
- the SDK (`turnkv.*`) imports nothing of `turnkv_server`, vLLM or NIXL: a client installs
  it without the server's dependencies;
- no module under `sdk/`, `server_ext/` or `scripts/` is over 400 lines.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = (ROOT / "sdk", ROOT / "server_ext", ROOT / "scripts")
ROUTER = "turnkv_server.router"
CONNECTOR = "turnkv_server.connector"
SDK = "turnkv"
SDK_FORBIDDEN = ("turnkv_server", "vllm", "nixl")
MAX_LINES = 400
# Programs under scripts/ (a few, for the check that they are found).
SCRIPTS = ("fuzz_router", "soak")

Graph = dict[str, dict[str, int]]  # module -> {imported project module: line of the import}


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to an absolute dotted name."""

    target: str  # e.g. "turnkv_server.router.app" or "vllm.config"
    line: int
    names: tuple[str, ...] = ()  # `from target import a, b`: each may be a submodule


@dataclass(frozen=True)
class Module:
    name: str
    where: str  # the file, relative to the repository
    lines: int
    imports: tuple[Import, ...]


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target> import ...` written in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def _imports(tree: ast.AST, module: str, is_package: bool) -> tuple[Import, ...]:
    found: list[Import] = []
    # ast.walk reaches every statement: function bodies, `if TYPE_CHECKING:`, try/except.
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(module, is_package, node.level, node.module)
            names = tuple(alias.name for alias in node.names if alias.name != "*")
            found.append(Import(target, node.lineno, names))
    return tuple(found)


def scan(roots: Iterable[Path], relative_to: Path) -> dict[str, Module]:
    """Every module under `roots` (each a folder that holds top-level packages)."""
    found: dict[str, Module] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            text = path.read_text(encoding="utf-8")
            found[name] = Module(name, str(path.relative_to(relative_to)),
                                 len(text.splitlines()),
                                 _imports(ast.parse(text, filename=str(path)), name,
                                          is_package))
    return found


def _deepest_known(name: str, known: dict[str, Module]) -> str | None:
    """The longest prefix of `name` that is a project module (`a.b.C` -> `a.b`)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def import_graph(known: dict[str, Module]) -> Graph:
    """Every import of one scanned module by another (vLLM's, the standard library's and the
    tests' support are not scanned: no edges)."""
    edges: Graph = {name: {} for name in known}
    for module in known.values():
        for imp in module.imports:
            if _deepest_known(imp.target, known) is None:
                continue
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one;
            # otherwise it takes a name from `pkg` (whose `__init__` runs).
            targets = ({f"{imp.target}.{n}" if f"{imp.target}.{n}" in known else imp.target
                        for n in imp.names} if imp.names else {imp.target})
            for target in sorted(targets):
                resolved = _deepest_known(target, known)
                if resolved is not None and resolved != module.name:
                    line = edges[module.name].get(resolved, imp.line)
                    edges[module.name][resolved] = min(line, imp.line)
    return edges


def _components(edges: Graph) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm): a
    knot of modules that all import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def enter(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for root in sorted(edges):
        if root in index:
            continue
        enter(root)
        work = [(root, iter(sorted(edges[root])))]  # iterative: no recursion limit
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    enter(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _shortest_path(start: str, goal: Callable[[str], bool], edges: Graph,
                   within: set[str] | None = None) -> list[str] | None:
    """The shortest import chain from `start` to a module `goal` accepts (`start` itself only
    after at least one step), through modules in `within` (None: any)."""
    queue: deque[list[str]] = deque([[start]])
    seen: set[str] = set()
    while queue:
        path = queue.popleft()
        for child in sorted(edges[path[-1]]):
            if goal(child):
                return [*path, child]
            if child not in seen and (within is None or child in within):
                seen.add(child)
                queue.append([*path, child])
    return None


def _step(known: dict[str, Module], edges: Graph, a: str, b: str) -> str:
    return f"{a} -> {b}  [{known[a].where}:{edges[a][b]}]"


# -- the rules, as reports (empty: the rule holds) -------------------------------------------


def cycle_reports(known: dict[str, Module], edges: Graph) -> list[str]:
    reports = []
    for i, component in enumerate(_components(edges), 1):
        members = set(component)
        circle = _shortest_path(component[0], lambda m, c=component[0]: m == c,
                                edges, members)
        assert circle is not None  # a strongly connected component has one
        # What there is to cut: every import inside the knot.
        inside = [_step(known, edges, a, b) for a in component for b in sorted(edges[a])
                  if b in members]
        reports.append(f"knot {i}: {len(component)} modules import each other: "
                       f"{', '.join(component)}\n"
                       f"  for example {' -> '.join(circle)}\n"
                       f"  the imports inside it:\n    " + "\n    ".join(inside))
    return reports


def crossing_reports(known: dict[str, Module], edges: Graph, one: str, other: str
                     ) -> list[str]:
    """Chains of imports by which a module of package `one` reaches package `other`, or
    back: one report per import that crosses over, with the shortest chain to it."""
    crossings: dict[tuple[str, str], list[str]] = {}
    for source, target in ((one, other), (other, one)):
        for name in sorted(edges):
            if not _in(name, source):
                continue
            chain = _shortest_path(name, lambda m, t=target: _in(m, t), edges)
            if chain is None:
                continue
            key = (chain[-2], chain[-1])
            if key not in crossings or len(chain) < len(crossings[key]):
                crossings[key] = chain
    return [f"{chain[0]} reaches {chain[-1]}:\n    "
            + "\n    ".join(_step(known, edges, a, b) for a, b in pairwise(chain))
            for _, chain in sorted(crossings.items())]


def forbidden_import_reports(known: dict[str, Module], package: str,
                             forbidden: Iterable[str]) -> list[str]:
    forbidden = tuple(forbidden)
    return [f"{module.where}:{imp.line}: {module.name} imports {imp.target}"
            for module in sorted(known.values(), key=lambda m: m.name) if _in(module.name, package)
            for imp in module.imports if any(_in(imp.target, f) for f in forbidden)]


def size_reports(known: dict[str, Module], limit: int) -> list[str]:
    return [f"{m.where}: {m.lines} lines" for m in
            sorted(known.values(), key=lambda m: (-m.lines, m.name)) if m.lines > limit]


@cache
def project() -> tuple[dict[str, Module], Graph]:
    known = scan(SOURCE_ROOTS, ROOT)
    return known, import_graph(known)


def _fail_on(reports: list[str], headline: str) -> None:
    if reports:
        pytest.fail(f"{headline}\n" + "\n".join(f"  {r}" for r in reports), pytrace=False)


# -- the project -----------------------------------------------------------------------------


def test_the_sources_are_found() -> None:
    """Guards the checks below against passing on nothing."""
    known, edges = project()
    for package in (SDK, "turnkv_server", ROUTER, CONNECTOR, *SCRIPTS):
        assert package in known, f"{package} not found under {[str(r) for r in SOURCE_ROOTS]}"
    assert sum(map(len, edges.values())) > 50, "too few imports between project modules"


def test_no_import_cycles() -> None:
    reports = cycle_reports(*project())
    _fail_on(reports, f"{len(reports)} import cycle(s) among the project's modules "
                      "(function-level and TYPE_CHECKING imports count):")


def test_router_and_connector_never_import_each_other() -> None:
    _fail_on(crossing_reports(*project(), ROUTER, CONNECTOR),
             f"the router ({ROUTER}) and the connector ({CONNECTOR}) share only the engine "
             "protocol; these imports reach one from the other, directly or through other "
             "project modules:")


def test_the_sdk_imports_no_server_package() -> None:
    _fail_on(forbidden_import_reports(project()[0], SDK, SDK_FORBIDDEN),
             f"the SDK installs without the server: no import of {', '.join(SDK_FORBIDDEN)} "
             "anywhere in it:")


def test_no_module_over_400_lines() -> None:
    _fail_on(size_reports(project()[0], MAX_LINES), f"modules over {MAX_LINES} lines:")


# -- the checks themselves, on a made-up tree ------------------------------------------------


def test_the_checks_find_what_they_are_for(tmp_path: Path) -> None:
    files = {
        # A cycle closed under TYPE_CHECKING, through a relative import.
        "turnkv/__init__.py": "from turnkv.a import A\n",
        "turnkv/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                       "    from .b import B\nA = 1\n",
        "turnkv/b.py": "def f():\n    from turnkv import a\n    import vllm.config\n",
        # The router reaches the connector through a third module, in a function.
        "turnkv_server/__init__.py": "",
        "turnkv_server/router/__init__.py": "from . import app\n",
        "turnkv_server/router/app.py": "def g():\n    from ..shared import helper\n",
        "turnkv_server/shared.py": "from turnkv_server.connector.params import P\n",
        "turnkv_server/connector/__init__.py": "",
        "turnkv_server/connector/params.py": "P = 1\n" * (MAX_LINES + 1),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    known = scan([tmp_path], tmp_path)
    edges = import_graph(known)
    assert edges["turnkv_server.router"] == {"turnkv_server.router.app": 1}
    assert edges["turnkv_server.router.app"] == {"turnkv_server.shared": 2}

    cycles = cycle_reports(known, edges)
    assert len(cycles) == 1 and "turnkv.a, turnkv.b" in cycles[0], cycles
    assert "turnkv.a -> turnkv.b  [turnkv/a.py:3]" in cycles[0]
    assert "turnkv.b -> turnkv.a  [turnkv/b.py:2]" in cycles[0]

    crossings = crossing_reports(known, edges, "turnkv_server.router",
                                 "turnkv_server.connector")
    assert len(crossings) == 1, crossings
    assert crossings[0].startswith(
        "turnkv_server.router.app reaches turnkv_server.connector.params")
    assert "turnkv_server.shared -> turnkv_server.connector.params  " \
           "[turnkv_server/shared.py:1]" in crossings[0]

    assert forbidden_import_reports(known, "turnkv", SDK_FORBIDDEN) == [
        "turnkv/b.py:3: turnkv.b imports vllm.config"]
    assert size_reports(known, MAX_LINES) == [
        f"turnkv_server/connector/params.py: {MAX_LINES + 1} lines"]


def test_the_checks_cover_the_scripts(tmp_path: Path) -> None:
    """A script imports its sibling modules by their plain names (Python puts scripts/ on the
    path of the script it runs): those imports are edges too, and a script has the modules'
    size limit."""
    files = {
        "server_ext/turnkv_server/__init__.py": "",
        "server_ext/turnkv_server/launcher.py": "X = 1\n",
        "scripts/soak.py": "import json\nfrom soak_cluster import Soak\n"
                           "from turnkv_server import launcher\n",
        "scripts/soak_cluster.py": "def f():\n    import soak\n" + "x = 1\n" * MAX_LINES,
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    known = scan([tmp_path / "server_ext", tmp_path / "scripts"], tmp_path)
    edges = import_graph(known)
    assert edges["soak"] == {"soak_cluster": 2, "turnkv_server.launcher": 3}
    cycles = cycle_reports(known, edges)
    assert len(cycles) == 1 and "soak, soak_cluster" in cycles[0], cycles
    assert "soak_cluster -> soak  [scripts/soak_cluster.py:2]" in cycles[0]
    assert size_reports(known, MAX_LINES) == [
        f"scripts/soak_cluster.py: {MAX_LINES + 2} lines"]
