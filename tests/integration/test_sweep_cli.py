"""The end-to-end sweep: the real CLI, real training processes, a tiny model on a slice of the built-in
corpus; then a run made to diverge must fail its verdict."""

from pathlib import Path

import forkserver
import pytest
from support import ROOT, TINY_SWEEP_MODEL


def _tiny_overrides(tmp_path: Path) -> list[str]:
    return [
        f"sweep.output_dir={tmp_path / 'sweep'}",
        "sweep.precisions=[fp32,tf32,bf16,fp16]",
        "sweep.reference_seed=7",
        # bf16/fp16 on every CPU (emulated where not native): the sweep's verdicts include them
        "hardware.allow_emulated=true",
        "sweep.parity_window=4",
        "sweep.profile_steps=1",
        f"data.cache_dir={tmp_path / 'data'}",
        "data.max_documents=60",
        *TINY_SWEEP_MODEL,
        "train.max_steps=16",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.learning_rate=0.002",
        "train.warmup_steps=2",
        "train.eval_every=8",
        "train.eval_max_batches=2",
        "train.export=false",
        "train.progress_bar=false",
    ]


def test_tiny_sweep_end_to_end(tmp_path, monkeypatch, capsys):
    """The real CLI: prepare, three precision runs + the fp32 seed run, report; then the divergence
    drill. About a minute on an idle 2-core machine, kept in the default suite on purpose."""
    import json

    import torch

    from bert_mp.cli import main
    from bert_mp.core.numerics import precision
    from bert_mp.core.process import conditions
    from bert_mp.errors import HardwareError
    from bert_mp.pretrain.parity_monitor import load_curves
    from bert_mp.sweep.parity import VerdictRules, verdict

    real = precision.resolve_precision

    def no_tf32(name, device, *a, **k):
        # stands in for hardware without the mode, so the skip path runs on any machine
        if name == "tf32":
            raise HardwareError("train.precision=tf32 needs an Ampere GPU (simulated for this test)")
        return real(name, device, *a, **k)

    monkeypatch.setattr(precision, "resolve_precision", no_tf32)
    monkeypatch.chdir(ROOT)
    forkserver.route_sweep_runs(monkeypatch)  # each run a process of its own, forked from a server
    overrides = _tiny_overrides(tmp_path)
    assert main(["sweep", "configs/quickstart_sweep.yaml", *overrides]) == 0
    out = capsys.readouterr().out
    root = tmp_path / "sweep"
    summary = json.loads((root / "summary.json").read_text())
    verdicts = summary["groups"][0]["verdicts"]
    assert verdicts["fp32"]["status"] == "reference"
    assert verdicts["tf32"]["status"] == "skipped" and "Ampere" in verdicts["tf32"]["reasons"][0]
    # bf16's verdict comes from the curves: its ratios are finite numbers measured against the seed spread
    bf16 = verdicts["bf16"]
    assert bf16["status"] in ("pass", "warn", "fail")
    assert verdicts["fp16"]["status"] in ("pass", "warn", "fail")
    mlm = bf16["checks"]["train:loss/mlm"]
    assert mlm["seed_spread"] > 0 and mlm["ratio"] == pytest.approx(mlm["value"] / mlm["tolerance"])
    md = (root / "report.md").read_text()
    assert "simulated for this test" in md and "Speed ladder" in md and "Kernel check" in md
    assert (root / "diagnostics" / "default" / "bf16.json").is_file()
    assert {"default_loss_curves.png", "default_deviation.png", "default_tokens_per_sec.png"} <= {
        p.name for p in (root / "plots").glob("*.png")
    }
    assert "bert-mp sweep: report" in out and "bf16" in out
    # each trained run's CPU seconds are its processes' (forked from a server or not: never zero)
    trained = [r for r in json.loads((root / "sweep.json").read_text())["runs"] if r["status"] == "completed"]
    assert len(trained) == 4 and all(r["cpu_s"] > 0.2 for r in trained), trained

    # a re-run keeps the finished runs instead of training them again
    assert main(["sweep", "configs/quickstart_sweep.yaml", *overrides]) == 0
    assert capsys.readouterr().out.count("earlier, kept") == 4  # fp32, its second seed, bf16, fp16

    # a run made to diverge on purpose (learning rate 1000x) must fail the verdict: `bert-mp train`
    # called like the sweep above, in this process (the verdict is under test, not the process start)
    bad = root / "runs" / "bf16-lr2"
    monkeypatch.setattr(conditions, "_CHOSEN", [])  # the command's thread choice, undone after the test
    threads = torch.get_num_threads()
    try:
        main(
            [
                "train",
                str(root / "base_config.yaml"),
                "train.precision=bf16",
                "train.learning_rate=2.0",
                "train.warmup_steps=0",
                f"train.output_dir={bad}",
            ]
        )
    finally:
        torch.set_num_threads(threads)  # the command took cores // 1 threads for itself
    err = capsys.readouterr().err
    status = json.loads((bad / "summary.json").read_text())["status"]
    runs = root / "runs"
    v = verdict(
        load_curves(bad),
        load_curves(runs / "fp32"),
        load_curves(runs / "fp32-seed7"),
        VerdictRules(window=4),
        status,
    )
    assert v.status == "fail", (v.reasons, err[-2000:])
