"""Layering: arrows point down. ``core`` imports nothing from the products, and no modules of
bert_mp import each other in a cycle (imports inside functions count: they only move the cycle to
run time)."""

from __future__ import annotations

import ast
from pathlib import Path

from support import ROOT

PACKAGE = ROOT / "bert_mp"
PRODUCTS = ("data", "model", "pretrain", "finetune", "sweep")
"""The subpackages ``core`` must not import from."""
MAY_IMPORT = {
    "core": set(),
    "data": {"core"},
    "model": {"core"},
    "pretrain": {"core", "data", "model"},
    "finetune": {"core", "data", "model"},
    "sweep": {"core", "data", "model", "pretrain", "finetune"},
}
"""The subpackages each package may import besides itself and ``bert_mp.errors``
(docs/architecture.md, "Packages and what they may import")."""
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


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The bert_mp modules ``name`` imports anywhere in its file (top level, functions, type blocks)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
