"""No module of bert_mp and no script over 600 lines: a file that grows past it is split by concern (as
the config tree is, in ``bert_mp/core/config/``, and the GPU check, in ``scripts/gpu/``)."""

from __future__ import annotations

from support import ROOT

MAX_LINES = 600


def test_no_module_over_the_line_limit():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
        for folder in ("bert_mp", "scripts")
        for p in sorted((ROOT / folder).rglob("*.py"))
    }
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"
