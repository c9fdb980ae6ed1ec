"""``sweep.downstream`` end to end through the real CLI, kept to seconds: fp32, its second seed and bf16
pretrain a tiny model for a few steps, each run's final checkpoint is fine-tuned twice on small CSV
files, and the report gains the downstream table, plot and summary.json block; a rerun keeps every
finished fine-tune, and a band made unmeasurable withholds the verdict with the reason."""

import json

import forkserver
from support import ROOT, TINY_SWEEP_MODEL, write_csv


def _overrides(tmp_path):
    files = tmp_path / "task"
    files.mkdir()
    return [
        f"sweep.output_dir={tmp_path / 'sweep'}",
        "sweep.precisions=[fp32,bf16]",
        "sweep.reference_seed=7",
        "hardware.allow_emulated=true",  # bf16 on every CPU (emulated where not native)
        "sweep.parity_window=2",
        "sweep.profile_steps=0",
        f"data.cache_dir={tmp_path / 'data'}",
        "data.max_documents=40",
        *TINY_SWEEP_MODEL,
        "train.max_steps=3",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.eval_every=3",
        "train.eval_max_batches=1",
        "train.progress_bar=false",
        "sweep.downstream.tasks=[local]",
        "sweep.downstream.seeds=[1,2]",
        "finetune.task=local",
        f"finetune.train_file={write_csv(files / 'train.csv', 32)}",
        f"finetune.validation_file={write_csv(files / 'val.csv', 16, offset=500)}",
        f"finetune.test_file={write_csv(files / 'test.csv', 16, offset=900)}",
        "finetune.batch_size=16",
        "finetune.epochs=1",
        "finetune.max_seq_length=32",
        "finetune.progress_bar=false",
    ]


def test_downstream_verdicts_end_to_end(tmp_path, monkeypatch, capsys):
    from bert_mp.cli import main

    monkeypatch.chdir(ROOT)
    forkserver.route_sweep_runs(monkeypatch)  # each run and fine-tune a process, forked from a server
    overrides = _overrides(tmp_path)
    assert main(["sweep", "configs/quickstart_sweep.yaml", *overrides]) == 0
    out = capsys.readouterr().out
    root = tmp_path / "sweep"
    record = json.loads((root / "sweep.json").read_text())
    assert [(e["run"], e["seed"], e["status"]) for e in record["downstream"]] == [
        (run, seed, "completed") for run in ("fp32", "fp32-seed7", "bf16") for seed in (1, 2)
    ]
    summary = json.loads((root / "summary.json").read_text())
    ds = summary["downstream"]
    assert ds["recipe"]["precision"] == "fp32" and ds["seeds"] == [1, 2]
    task = ds["groups"][0]["tasks"]["local"]
    assert task["metric"] == "macro_f1" and task["split"] == "test"
    assert len(task["band"]["values"]) == 4 and task["band"]["withheld"] is None
    bf16 = task["runs"]["bf16"]
    assert len(bf16["values"]) == 2 and bf16["mean"] is not None
    assert bf16["verdict"]["status"] in ("pass", "warn", "fail")  # a verdict, measured against the band
    md = (root / "report.md").read_text()
    assert "## Downstream (fine-tuned checkpoints)" in md and "fine-tuning precision **fp32**" in md
    assert (root / "plots" / "default_downstream_local.png").is_file()
    assert (
        "downstream local" in out and "bert-mp sweep: downstream [6/6] bf16 local seed 2: fine-tuning" in out
    )

    # a rerun keeps every finished pretraining run and fine-tune
    assert main(["sweep", "configs/quickstart_sweep.yaml", *overrides]) == 0
    again = capsys.readouterr().out
    assert again.count("completed earlier, kept") == 3 + 6 and "fine-tuning ..." not in again

    # the second fp32 seed's fine-tunes gone: no band, so no verdict - and the report says why
    for e in record["downstream"]:
        if e["run"] == "fp32-seed7":
            (root / e["dir"] / "summary.json").unlink()
    assert main(["report", str(root)]) == 0
    v = json.loads((root / "summary.json").read_text())["downstream"]["groups"][0]["tasks"]["local"]
    assert v["runs"]["bf16"]["verdict"]["status"] == "n/a"
    assert "the fp32 band is not measurable" in v["runs"]["bf16"]["verdict"]["reasons"][0]
