"""The built-in offline corpus: English prose every Python installation carries.

Docstrings of the standard library (read from source with ``ast``; nothing is imported) and the
``pydoc_data`` help topics. One document per module (its docstrings in source order, test packages
excluded) and one per topic. No download, stable for a given Python version.
"""

from __future__ import annotations

import ast
import inspect
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Folders whose modules are tests, demos or vendored code rather than library prose.
_EXCLUDED_PARTS = {
    "test",
    "tests",
    "idle_test",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "turtledemo",
    "_vendor",
    "pydoc_data",
}


@dataclass(frozen=True)
class Docstring:
    """One docstring with the metadata that says where it came from."""

    module: str  # dotted module name, e.g. "email.mime.text"
    package: str  # top-level package, e.g. "email"
    kind: str  # "module" | "class" | "function"
    qualname: str  # e.g. "Message.get_payload"
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded(part: str) -> bool:
    return part in _EXCLUDED_PARTS or part.startswith("test_")


def _python_files(root: Path) -> list[Path]:
    """``sorted(root.rglob("*.py"))`` without descending into excluded folders: the global
    site-packages below the stdlib holds most of an installation's files, none of them wanted."""
    found = []
    for folder, dirnames, filenames in os.walk(root):
        found += [Path(folder, n) for n in (*filenames, *dirnames) if n.endswith(".py")]
        dirnames[:] = [d for d in dirnames if not _excluded(d)]  # in place: os.walk skips the rest
    return sorted(found)


def _module_files(root: Path) -> Iterator[tuple[str, Path]]:
    for path in _python_files(root):
        rel = path.relative_to(root)
        if any(_excluded(part) for part in rel.parts):
            continue
        if rel.name.startswith(("test_", "_test")):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts:
            continue
        yield ".".join(parts), path


def _clean(doc: str) -> str:
    """Dedent and drop doctest lines (>>> / ...), which are code rather than prose."""
    lines = [ln for ln in inspect.cleandoc(doc).splitlines() if not ln.lstrip().startswith((">>>", "... "))]
    return "\n".join(lines).strip()


def _walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str, str]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qual = f"{prefix}{child.name}"
            doc = ast.get_docstring(child, clean=False)
            if doc:
                yield ("class" if isinstance(child, ast.ClassDef) else "function"), qual, doc
            yield from _walk(child, qual + ".")


def iter_stdlib_docstrings(root: Path | None = None) -> Iterator[Docstring]:
    """Every docstring of the standard library's pure-Python modules, in source order."""
    root = root or stdlib_dir()
    for module, path in _module_files(root):
        try:
            source = path.read_text(encoding="utf-8", errors="replace")
            tree = ast.parse(source)
        except (SyntaxError, ValueError, OSError):
            continue
        package = module.split(".")[0]
        mdoc = ast.get_docstring(tree, clean=False)
        if mdoc and _clean(mdoc):
            yield Docstring(module, package, "module", module, _clean(mdoc))
        for kind, qual, doc in _walk(tree, ""):
            text = _clean(doc)
            if text:
                yield Docstring(module, package, kind, qual, text)


def iter_pydoc_topics() -> Iterator[tuple[str, str]]:
    """(topic name, text) of the interpreter's help topics, if the installation ships them."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some minimal Python builds drop pydoc_data
        return
    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield name, text


def builtin_documents(root: Path | None = None) -> Iterator[dict]:
    """Documents of the built-in corpus as ``{"id", "text"}``; paragraphs separated by blank lines."""
    current, parts = None, []
    for d in iter_stdlib_docstrings(root):
        if d.module != current:
            if parts:
                yield {"id": f"module:{current}", "text": "\n\n".join(parts)}
            current, parts = d.module, []
        parts.append(d.text)
    if parts:
        yield {"id": f"module:{current}", "text": "\n\n".join(parts)}
    for name, text in iter_pydoc_topics():
        yield {"id": f"topic:{name}", "text": text}
