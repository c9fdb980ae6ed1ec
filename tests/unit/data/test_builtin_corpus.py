"""The built-in corpus's file walk: excluded folders are skipped without changing what is read."""

from __future__ import annotations

from pathlib import Path

from bert_mp.data import builtin_corpus
from bert_mp.data.builtin_corpus import _EXCLUDED_PARTS, builtin_documents, iter_stdlib_docstrings

FILES = (
    "abc.py",
    "zzz.py",
    ".hidden.py",
    "notes.txt",
    "test_abc.py",
    "_test_helpers.py",
    "email/__init__.py",
    "email/mime/text.py",
    "email/mime/test_mime.py",
    "email/tests/test_email.py",
    "email/_vendor/six.py",
    "test/support.py",
    "test_pkg/mod.py",
    "idlelib/idle_test/htest.py",
    "site-packages/numpy/__init__.py",
    "site-packages/numpy/core/multiarray.py",
    "dist-packages/six.py",
    "deep/site-packages/x.py",
    "deep/kept.py",
    "__pycache__/abc.py",
    "pydoc_data/topics.py",
    "turtledemo/clock.py",
    "a.py/inner.py",  # a folder whose name matches *.py
)


def _old_module_files(root: Path) -> list[tuple[str, Path]]:
    """The walk as it was before pruning: every *.py under the root, filtered afterwards."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _EXCLUDED_PARTS or part.startswith("test_") for part in rel.parts):
            continue
        if rel.name.startswith(("test_", "_test")):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out.append((".".join(parts), path))
    return out


def _fake_stdlib(root: Path) -> Path:
    for i, rel in enumerate(FILES):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'"""Module {rel} number {i}."""\n\n\ndef f():\n    """Function of {rel}."""\n')
    (root / "linked").symlink_to(root / "email", target_is_directory=True)  # not followed, as rglob
    return root


def test_pruned_walk_reads_the_same_files_in_the_same_order(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    want = _old_module_files(root)
    assert list(builtin_corpus._module_files(root)) == want
    modules = [".hidden", "a", "a.py.inner", "abc", "deep.kept", "email", "email.mime.text", "zzz"]
    assert [m for m, _ in want] == modules


def test_pruned_walk_yields_the_same_documents(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    docs = list(iter_stdlib_docstrings(root))
    want = [m for m, _ in _old_module_files(root) if m != "a"]  # a.py is a folder: nothing to read
    assert [d.module for d in docs if d.kind == "module"] == want
    assert [d.text for d in docs][:2] == ["Module .hidden.py number 2.", "Function of .hidden.py."]
    assert [d["id"] for d in builtin_documents(root)][: len(want)] == [f"module:{m}" for m in want]


def test_excluded_folders_are_not_entered(tmp_path, monkeypatch):
    root = _fake_stdlib(tmp_path / "lib")
    entered = []
    real_walk = builtin_corpus.os.walk

    def walk(top, *a, **kw):
        for folder, dirs, files in real_walk(top, *a, **kw):
            entered.append(Path(folder).relative_to(root).parts)
            yield folder, dirs, files

    monkeypatch.setattr(builtin_corpus.os, "walk", walk)
    list(builtin_corpus._module_files(root))
    assert entered and not any(
        part in _EXCLUDED_PARTS or part.startswith("test_") for parts in entered for part in parts
    )
