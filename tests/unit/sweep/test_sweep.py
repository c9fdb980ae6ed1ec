"""Sweep config loading, planning and launching; the end-to-end sweep through the real CLI."""

import sys
from pathlib import Path

import pytest
from support import ROOT

from bert_mp.errors import ConfigError
from bert_mp.sweep.runner import launch_command, load_sweep_config, plan_sweep, run_action



def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def files(tmp_path):
    base = _write(
        tmp_path / "base.yaml", "train:\n  max_steps: 77\n  learning_rate: 0.002\nmodel:\n  preset: mini\n"
    )
    sweep = _write(
        tmp_path / "sweep.yaml",
        "sweep:\n  base: base.yaml\n  precisions: [fp32, bf16]\ntrain:\n  max_steps: 55\n",
    )
    return base, sweep


def test_layers_base_then_sweep_then_cli(files):
    _, sweep = files
    cfg, base = load_sweep_config(sweep, ["train.warmup_steps=3"])
    assert base.name == "base.yaml"
    assert cfg.model.preset == "mini"  # from the base
    assert cfg.train.learning_rate == 0.002  # from the base
    assert cfg.train.max_steps == 55  # the sweep file wins over the base
    assert cfg.train.warmup_steps == 3  # the CLI wins over both
    assert cfg.sweep.precisions == ["fp32", "bf16"]


def test_cli_can_replace_the_base(files, tmp_path):
    _, sweep = files
    other = _write(tmp_path / "other.yaml", "model:\n  preset: small\n")
    cfg, base = load_sweep_config(sweep, [f"sweep.base={other}"])
    assert base == other and cfg.model.preset == "small" and cfg.train.max_steps == 55


@pytest.mark.parametrize(
    "text, key",
    [
        ("sweep:\n  base: base.yaml\n  precisons: [fp32]\n", "precisons"),
        ("sweep:\n  base: base.yaml\ntrain:\n  max_step: 3\n", "max_step"),
        ("sweep:\n  base: base.yaml\n  precisions: [fp32, fp8]\n", "sweep.precisions"),
        ("sweep:\n  base: base.yaml\n  precisions: [bf16, fp16]\n", "must include fp32"),
        ("sweep:\n  base: missing.yaml\n", "sweep.base"),
        ("sweep:\n  base: base.yaml\n  warn_multiplier: 3\n  fail_multiplier: 2\n", "sweep.fail_multiplier"),
    ],
)
def test_bad_sweep_files_name_the_key(files, tmp_path, text, key):
    bad = _write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError, match=key):
        load_sweep_config(bad, [])


def test_unknown_key_in_the_base_is_caught(tmp_path):
    _write(tmp_path / "base.yaml", "data:\n  vocab: 3\n")
    sweep = _write(tmp_path / "s.yaml", "sweep:\n  base: base.yaml\n")
    with pytest.raises(ConfigError, match="vocab"):
        load_sweep_config(sweep, [])


def test_plan_puts_fp32_and_its_second_seed_first(files):
    cfg, _ = load_sweep_config(files[1], ["sweep.precisions=[bf16,fp16,fp32]", "train.seed=7"])
    (group,) = plan_sweep(cfg)
    assert group.name == "default"
    assert [(r.name, r.role, r.seed) for r in group.runs] == [
        ("fp32", "reference", 7),
        ("fp32-seed8", "seed_spread", 8),
        ("bf16", "candidate", 7),
        ("fp16", "candidate", 7),
    ]
    # identical seed for every precision: only the seed-spread run changes it
    assert all("train.seed" not in o for r in group.runs if r.role != "seed_spread" for o in r.overrides)


def test_plan_axes_make_groups(files):
    cfg, _ = load_sweep_config(
        files[1], ["sweep.micro_batch_sizes=[8,16]", "sweep.seq_lengths=[64]", "sweep.reference_seed=99"]
    )
    groups = plan_sweep(cfg)
    assert [g.name for g in groups] == ["seq64-mb8", "seq64-mb16"]
    assert groups[0].overrides == ["data.max_seq_length=64", "train.micro_batch_size=8"]
    assert groups[1].runs[1].dir == "runs/seq64-mb16/fp32-seed99"


def test_reference_seed_must_differ(files):
    cfg, _ = load_sweep_config(files[1], ["train.seed=5", "sweep.reference_seed=5"])
    with pytest.raises(ConfigError, match="reference_seed"):
        plan_sweep(cfg)


def test_launch_commands(files):
    cfg, _ = load_sweep_config(files[1], [])
    cmd = launch_command(cfg, Path("b.yaml"), ["train.precision=bf16"], cuda=False)
    assert cmd == [sys.executable, "-m", "bert_mp", "train", "b.yaml", "train.precision=bf16"]
    cfg, _ = load_sweep_config(files[1], ["sweep.num_processes=2"])
    cmd = launch_command(cfg, Path("b.yaml"), [], cuda=False)
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    # really N processes on CPU: `--cpu --num_processes 2` would start one in Accelerate 1.x
    assert "--multi_gpu" in cmd and "--cpu" not in cmd and cmd[cmd.index("--num_processes") + 1] == "2"
    assert cmd[-4:] == ["-m", "bert_mp", "train", "b.yaml"]
    cfg, _ = load_sweep_config(files[1], ["sweep.launcher=accelerate"])
    assert "--cpu" in launch_command(cfg, Path("b.yaml"), [], cuda=False)


def test_resume_decisions(tmp_path):
    run = tmp_path / "fp32"
    assert run_action(run) == "fresh"
    run.mkdir()
    (run / "launch.log").write_text("killed before any summary")
    assert run_action(run) == "resume"
    for status, action in (("stopped", "resume"), ("completed", "keep"), ("failed", "keep")):
        (run / "summary.json").write_text(f'{{"status": "{status}"}}')
        assert run_action(run) == action, status


@pytest.mark.parametrize("name", ["quickstart_sweep.yaml", "sweep_cpu.yaml", "sweep_gpu_base.yaml"])
def test_shipped_sweep_recipes_load(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg, base = load_sweep_config(ROOT / "configs" / name, [])
    assert base is not None and "fp32" in cfg.sweep.precisions
    assert plan_sweep(cfg)


# --------------------------------------------------------------------------------------------------
# end to end: the real CLI, real training processes, a tiny model on a slice of the built-in corpus
# --------------------------------------------------------------------------------------------------
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
        "data.vocab_size=512",
        "data.max_seq_length=32",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "model.max_position_embeddings=64",
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
    import subprocess

    from bert_mp.cli import main
    from bert_mp.core import precision
    from bert_mp.errors import HardwareError
    from bert_mp.sweep.parity import VerdictRules, load_curves, verdict

    real = precision.resolve_precision

    def no_tf32(name, device, *a, **k):
        # stands in for hardware without the mode, so the skip path runs on any machine
        if name == "tf32":
            raise HardwareError("train.precision=tf32 needs an Ampere GPU (simulated for this test)")
        return real(name, device, *a, **k)

    monkeypatch.setattr(precision, "resolve_precision", no_tf32)
    monkeypatch.chdir(ROOT)
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

    # a re-run keeps the finished runs instead of training them again
    assert main(["sweep", "configs/quickstart_sweep.yaml", *overrides]) == 0
    assert capsys.readouterr().out.count("earlier, kept") == 4  # fp32, its second seed, bf16, fp16

    # a run made to diverge on purpose (learning rate 1000x) must fail the verdict
    bad = root / "runs" / "bf16-lr2"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bert_mp",
            "train",
            str(root / "base_config.yaml"),
            "train.precision=bf16",
            "train.learning_rate=2.0",
            "train.warmup_steps=0",
            f"train.output_dir={bad}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    status = json.loads((bad / "summary.json").read_text())["status"]
    runs = root / "runs"
    v = verdict(
        load_curves(bad),
        load_curves(runs / "fp32"),
        load_curves(runs / "fp32-seed7"),
        VerdictRules(window=4),
        status,
    )
    assert v.status == "fail", (v.reasons, proc.stderr[-2000:])
