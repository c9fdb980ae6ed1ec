"""Layering: arrows point down. ``core`` imports nothing from the products, and no modules of
bert_mp import each other in a cycle (imports inside functions count: they only move the cycle to
run time)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "bert_mp"
PRODUCTS = ("data", "model", "pretrain", "finetune", "sweep", "launch")
"""The subpackages ``core`` must not import from."""
MAY_IMPORT = {
    "core": set(),
    "data": {"core"},
    "model": {"core"},
    "pretrain": {"core", "data", "model"},
    "finetune": {"core", "data", "model"},
    "sweep": {"core", "data", "model", "pretrain", "finetune"},
    "launch": {"core"},
}
"""The subpackages each package may import besides itself and ``bert_mp.errors``
(docs/architecture.md, "Packages and what they may import")."""
CORE_ROOMS = ("storage", "config", "numerics", "process", "engine", "checkpoint", "loop")
"""``bert_mp.core``'s sub-packages, bottom up: each imports only the rooms before it (bert_mp/core/__init__.py)."""
KNOWN_CYCLES: set[frozenset[str]] = set()
"""Cycles tolerated for now, each a set of module names with a comment saying why (none today)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module a ``from`` import names (relative imports resolved against ``name``)."""
    if not node.level:
        return node.module or ""
    base = name.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


REGISTRY_ENTRY = re.compile(r"^(bert_mp(?:\.\w+)+):\w+$")
"""A string naming an object by module (``"bert_mp.pretrain.parity_monitor:ParityCallback"``), as registries do:
it imports that module when used, so it counts as an import."""


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The bert_mp modules ``name`` imports anywhere in its file (top level, functions, type blocks),
    string registry entries included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            entry = REGISTRY_ENTRY.match(node.value)
            if entry:
                out.add(entry.group(1))
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, name, path.name == "__init__.py")
            for alias in node.names:  # `from bert_mp.core import checkpoint` imports the module
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported(name, path, known) for name, path in known.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path ``a -> b -> ... -> a``) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_within(graph, g) for g in groups if frozenset(g) not in KNOWN_CYCLES]


def _path_within(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A cycle through the group's first module, by breadth-first search inside the group."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if w not in came:
                    came[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(group)


def test_core_imports_nothing_from_the_products():
    graph = import_graph()
    upward = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        if name.startswith("bert_mp.core")
        for target in sorted(targets)
        if target.split(".")[1] in PRODUCTS
    ]
    assert not upward, (
        "core imports from a product (move the code down, or up into the product): " + "; ".join(upward)
    )


def test_every_package_imports_only_the_packages_below_it():
    graph = import_graph()
    wrong = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        for target in sorted(targets)
        if _package(name) in MAY_IMPORT
        and _package(target) in MAY_IMPORT
        and _package(target) not in MAY_IMPORT[_package(name)] | {_package(name)}
    ]
    assert not wrong, "imports against the layering: " + "; ".join(wrong)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def test_cores_rooms_import_only_the_rooms_below_them():
    graph = import_graph()
    known = modules()
    loose = sorted(
        n
        for n in graph
        if n.count(".") == 2 and n.startswith("bert_mp.core.") and known[n].name != "__init__.py"
    )
    assert not loose, f"modules directly in bert_mp/core (give each a room): {loose}"
    wrong = [
        f"{name} -> {target}"
        for name, targets in sorted(graph.items())
        if _room(name)
        for target in sorted(targets)
        if _room(target) and CORE_ROOMS.index(_room(target)) > CORE_ROOMS.index(_room(name))
    ]
    assert not wrong, "a core room imports a room above it: " + "; ".join(wrong)
    rooms = {p.name for p in (PACKAGE / "core").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert rooms == set(CORE_ROOMS), rooms


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "core" else ""


def test_no_core_module_shares_its_name_with_another_module():
    """A file name says what the file is: outside ``core/config`` (which mirrors the products' config
    sections on purpose) no module of the core is named like another module of bert_mp."""
    by_name: dict[str, list[str]] = {}
    for name, path in modules().items():
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, []).append(name)
    twins = {
        stem: names
        for stem, names in by_name.items()
        if len(names) > 1 and any(n.startswith("bert_mp.core.") and _room(n) != "config" for n in names)
    }
    assert not twins, twins


def test_registry_strings_count_as_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('REG = {"x": "bert_mp.sweep.report:Thing"}\n', encoding="utf-8")
    known = {"bert_mp.core.loop.m": path, "bert_mp.sweep.report": tmp_path / "r.py"}
    assert imported("bert_mp.core.loop.m", path, known) == {"bert_mp.sweep.report"}


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_function_level_imports_and_cycles(tmp_path):
    """The checks themselves: a cycle made only by an import inside a function is found and shown."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    pkg = tmp_path / "bert_mp" / "core"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("def f():\n    from bert_mp.data import prepare\n", encoding="utf-8")
    known = {"bert_mp.core.x": pkg / "x.py", "bert_mp.data.prepare": tmp_path / "p.py"}
    assert imported("bert_mp.core.x", pkg / "x.py", known) == {"bert_mp.data.prepare"}
