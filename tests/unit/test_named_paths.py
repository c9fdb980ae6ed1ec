"""Every repository path that configs/, docs/ and the README name exists: a file moved or renamed
leaves no comment or page pointing at nothing (files, folders, globs, ``bert_mp.x.y`` modules, test
ids relative to tests/, and the pages' relative links). A retired script is named with the commit that
held it (``git show abc1234:scripts/bench/x.py``): its path may then appear in that page, and the commit
must hold it."""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path

from support import ROOT

TOP = ("bert_mp", "scripts", "configs", "tests", "docs", ".ci")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./*{},-]*[\w/*}])")
MODULE = re.compile(r"(?<![\w./-])(bert_mp(?:\.[a-z_0-9]+)+)")
TEST_ID = re.compile(r"(?<![\w./-])((?:unit|integration)/[\w/]+\.py)")
LINK = re.compile(r"\]\(([^)#\s]+)")
RETIRED = re.compile(r"\b([0-9a-f]{7,40}):((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*\w)")
"""``COMMIT:PATH``: a file that the commit held and the tree no longer does (a retired script)."""


def named_files() -> list[Path]:
    return sorted([*(ROOT / "configs").rglob("*.yaml"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])


def _expand_braces(pattern: str) -> list[str]:
    """``a_{x,y}.json`` -> ``a_x.json``, ``a_y.json`` (as a shell expands it)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _exists(rel: str) -> bool:
    return all(
        any(ROOT.glob(p)) if "*" in p else (ROOT / p).exists() for p in _expand_braces(rel.rstrip("."))
    )


def _module_exists(dotted: str) -> bool:
    """``bert_mp.a.b`` is a module or package, or ``bert_mp.a.b.name`` a name its source defines."""
    parts = dotted.split(".")
    for i in range(len(parts), 1, -1):
        base = ROOT.joinpath(*parts[:i])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[i:]
            return (
                not rest
                or re.search(rf"\b{re.escape(rest[0])}\b", source.read_text(encoding="utf-8")) is not None
            )
    return False


def _in_history(commit: str, rel: str) -> bool:
    """Whether ``commit`` held ``rel`` (true where git or the history is not there to ask)."""
    try:
        r = subprocess.run(["git", "cat-file", "-e", f"{commit}:{rel}"], cwd=ROOT, capture_output=True)
    except OSError:
        return True
    has_history = (
        subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode == 0
    )
    return r.returncode == 0 or not has_history


def missing_paths(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    retired = dict((rel, commit) for commit, rel in RETIRED.findall(text))
    missing = [f"{c}:{rel}" for rel, c in retired.items() if not _in_history(c, rel)]
    missing += [p for p in PATH.findall(text) if "<" not in p and p not in retired and not _exists(p)]
    missing += [f"tests/{t}" for t in TEST_ID.findall(text) if not (ROOT / "tests" / t).is_file()]
    missing += [m for m in MODULE.findall(text) if not _module_exists(m)]
    if path.suffix == ".md":
        links = [ln for ln in LINK.findall(text) if not ln.startswith(("http://", "https://", "mailto:"))]
        missing += [f"link {ln}" for ln in links if not (path.parent / ln).exists()]
    return missing


def test_every_path_named_in_configs_and_docs_exists():
    missing = {str(p.relative_to(ROOT)): m for p in named_files() if (m := missing_paths(p))}
    assert not missing, f"paths named but not in the repository: {missing}"


def test_the_check_finds_a_path_that_is_not_there(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "set up in bert_mp/distributed.py and bert_mp.core.nothing; see [x](nowhere.md), "
        "`configs/quickstart.yaml`, `bert_mp/core/config/`, `docs/benchmarks/prepare_memory_{500MB,5GB}.json`\n"
    )
    assert missing_paths(page) == ["bert_mp/distributed.py", "bert_mp.core.nothing", "link nowhere.md"]


def test_a_retired_script_is_named_with_a_commit_that_held_it(tmp_path):
    page = tmp_path / "page.md"
    held = "made by `scripts/bench/gone.py` at 7cf4666 (`git show 7cf4666:scripts/bench/processes.py`)"
    page.write_text(held.replace("gone", "processes") + "\n")
    assert missing_paths(page) == []  # the commit held it: named, though the tree no longer does
    page.write_text(held.replace("7cf4666:scripts/bench/processes", "7cf4666:scripts/bench/gone") + "\n")
    assert missing_paths(page) == ["7cf4666:scripts/bench/gone.py"]
