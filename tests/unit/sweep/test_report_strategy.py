"""The sweep report names the distributed strategy its runs were under (summary.json's ``strategy``)."""

from __future__ import annotations

import json

from unit.sweep.test_report import make_sweep

from bert_mp.sweep.report import build_report


def _set_strategy(root, label_of):
    for summary in root.rglob("summary.json"):
        if summary.parent == root:
            continue
        d = json.loads(summary.read_text())
        d["strategy"] = {"name": "ddp", "label": label_of(summary.parent.name)}
        summary.write_text(json.dumps(d))


def test_the_report_names_the_strategy_of_every_run(tmp_path):
    root = make_sweep(tmp_path / "sweep")
    build_report(root)
    assert "Distributed strategy: **not recorded** (every run)." in (root / "report.md").read_text()
    _set_strategy(root, lambda name: "DDP (nothing sharded; gloo)")
    build_report(root)
    assert (
        "Distributed strategy: **DDP (nothing sharded; gloo)** (every run)."
        in (root / "report.md").read_text()
    )
    _set_strategy(root, lambda name: "single process" if name == "bf16" else "DDP (nothing sharded; gloo)")
    build_report(root)
    md = (root / "report.md").read_text()
    assert "**single process** (bf16)" in md and "**DDP (nothing sharded; gloo)** (fp32, " in md
