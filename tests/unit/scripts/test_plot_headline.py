"""scripts/figures/plot_headline.py: the README's picture from a sweep folder - a small PNG, with the
speed-ups the report quotes, and none where the report withholds them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support import ROOT, load_script

sys.path.insert(0, str(ROOT / "tests" / "unit" / "sweep"))
from test_report import make_sweep  # noqa: E402  (the report tests' synthetic sweep folder)

plot_headline = load_script("figures/plot_headline")


def _conditions(others: float) -> dict:
    return {
        "threads": 2,
        "threads_source": "2 cores // 1 process",
        "processes": 1,
        "cores": 2,
        "cpu_model": "Test CPU 9000",
        "load_start": [0.2, 0.1, 0.1],
        "load_end": [0.4, 0.2, 0.1],
        "others_cpu_cores": others,
        "gpu": None,
    }


def _set(root: Path, name: str, others: float, step_ms: float | None = None) -> None:
    path = root / "runs" / name / "summary.json"
    s = json.loads(path.read_text())
    s["conditions"] = _conditions(others)
    if step_ms:
        s["throughput"]["step_ms"] = step_ms
    path.write_text(json.dumps(s))


def test_a_small_png_with_the_footer_naming_machine_versions_and_command(tmp_path, capsys):
    root = make_sweep(tmp_path / "sweep")
    for name in ("fp32", "fp32-seed43", "bf16", "fp16", "fp16-bad"):
        _set(root, name, 0.05)
    out = tmp_path / "headline.png"
    assert plot_headline.main([str(root), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 150 * 1024
    assert "plot_headline: " in capsys.readouterr().out
    record, groups = plot_headline.load_sweep(root)
    text = plot_headline.footer(record, groups[0])
    assert text.startswith("bert-mp sweep: ") and "Test CPU 9000 (2 cores)" in text and "torch 9.9" in text


def test_the_picture_withholds_what_the_report_withholds(tmp_path, monkeypatch):
    """A second fp32 seed slowed by other work: the ladder it draws quotes no speed-up."""
    root = make_sweep(tmp_path / "sweep")
    for name in ("fp32", "bf16", "fp16", "fp16-bad"):
        _set(root, name, 0.05)
    _set(root, "fp32-seed43", 1.9, step_ms=9000.0)
    seen = {}
    real = plot_headline.plot_headline

    def spy(group, rules, ladder, footer, path):
        seen["ladder"] = ladder
        return real(group, rules, ladder, footer, path)

    monkeypatch.setattr(plot_headline, "plot_headline", spy)
    assert plot_headline.main([str(root), "--out", str(tmp_path / "h.png")]) == 0
    ladder = {r["name"]: r for r in seen["ladder"]}
    assert "fp32-seed43" in ladder and all(r["speedup_vs_fp32"] is None for r in ladder.values())
