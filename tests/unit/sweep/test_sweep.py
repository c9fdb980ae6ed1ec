"""Sweep config loading, planning and launching (the end-to-end sweep through the real CLI:
integration/test_sweep_cli.py)."""

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
        ("sweep:\n  base: base.yaml\n  precisions: [fp32, fp4]\n", "sweep.precisions"),
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


def test_each_optimizer_is_a_group_with_its_own_fp32_reference(files):
    cfg, _ = load_sweep_config(
        files[1], ["sweep.optimizers=[adamw,lamb]", "sweep.precisions=[fp32,bf16_pure,fp8]"]
    )
    groups = plan_sweep(cfg)
    assert [g.name for g in groups] == ["adamw", "lamb"]
    assert groups[1].overrides == ["train.optimizer=lamb"]
    assert [(r.name, r.role) for r in groups[1].runs] == [
        ("fp32", "reference"),
        ("fp32-seed43", "seed_spread"),
        ("bf16_pure", "candidate"),
        ("fp8", "candidate"),
    ]
    assert groups[1].runs[2].dir == "runs/lamb/bf16_pure"


def test_a_recipe_run_is_named_and_judged_against_the_base_recipe(files):
    cfg, _ = load_sweep_config(files[1], ["sweep.recipes=[no_attention_dropout]"])
    (group,) = plan_sweep(cfg)
    recipe = group.runs[-1]
    assert (recipe.name, recipe.role, recipe.precision) == ("bf16+no_attention_dropout", "recipe", "bf16")
    assert recipe.overrides == ["train.precision=bf16", "model.attention_probs_dropout_prob=0"]
    assert [r.role for r in group.runs[:2]] == ["reference", "seed_spread"]  # fp32 keeps BERT's dropout
    assert all("dropout" not in o for r in group.runs[:-1] for o in r.overrides)
    for bad, key in (
        ("sweep.recipes=[no_dropout]", "sweep.recipes"),
        ("sweep.recipe_precision=fp16", "recipe_"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_sweep_config(files[1], ["sweep.recipes=[no_attention_dropout]", bad])


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


@pytest.mark.parametrize(
    "name",
    [
        "quickstart_sweep.yaml",
        "sweep_cpu.yaml",
        "sweep_gpu_base.yaml",
        "sweep_frontier_cpu.yaml",
        "sweep_downstream_cpu.yaml",
    ],
)
def test_shipped_sweep_recipes_load(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg, base = load_sweep_config(ROOT / "configs" / name, [])
    assert base is not None and "fp32" in cfg.sweep.precisions
    assert plan_sweep(cfg)


def test_a_completed_run_whose_saved_state_no_longer_verifies_is_resumed(tmp_path, prepared):
    from support import load_fixture, tiny_config

    from bert_mp.pretrain.trainer import train

    run = tmp_path / "fp32"
    train(tiny_config(run, max_steps=4, save_every=2), load_fixture(prepared))
    assert run_action(run) == "keep"
    for damaged in (
        run / "checkpoints" / "step_00000004" / "optimizer.safetensors",
        run / "final" / "model.safetensors",
    ):
        original = damaged.read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x04
        damaged.write_bytes(bytes(flipped))
        assert run_action(run) == "resume", damaged
        damaged.write_bytes(original)
        assert run_action(run) == "keep"
