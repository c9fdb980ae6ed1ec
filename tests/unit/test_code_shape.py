"""Code shape: no function in bert_mp/ is longer than a screen and a half."""

from __future__ import annotations

import ast

from support import ROOT

PACKAGE = ROOT / "bert_mp"
MAX_LINES = 80


def function_lengths() -> list[tuple[int, str]]:
    """(lines, "path:name") of every function and method in the package, decorators excluded."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(PACKAGE)}:{node.name}"))
    return sorted(out, reverse=True)


def test_no_function_is_longer_than_80_lines():
    long = [f"{where} ({n} lines)" for n, where in function_lengths() if n >= MAX_LINES]
    assert not long, "split these into named parts: " + ", ".join(long)
