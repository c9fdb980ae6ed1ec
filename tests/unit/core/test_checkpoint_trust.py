"""Checkpoints you can trust: content checksums, state files without pickle, older size-only
checkpoints, crafted pickles that never run (through the CLI entry point, in this process)."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import load_fixture, load_script, tiny_config

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.checkpoint import state_codec as state_io
from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.storage import checksums as integrity
from bert_mp.errors import TrainingError

drill = load_script("drills/fault")


# --------------------------------------------------------------------------------------------------
# state files: exact round trips, nothing but plain values
# --------------------------------------------------------------------------------------------------
def test_a_state_tree_round_trips_exactly_and_is_a_plain_safetensors_file(tmp_path):
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)}, 7: {"m": torch.zeros(0)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 7], "foreach": None}],
        "odd": {"nan": float("nan"), "inf": -math.inf, "big": 2**70, "flag": True, "text": "ü"},
        "dtypes": [torch.ones(2, dtype=d) for d in (torch.bfloat16, torch.float16, torch.bool, torch.int64)],
        "__dunder": 1,
    }
    entry = state_io.save_tree(tmp_path / "s.safetensors", state)
    assert entry == integrity.file_entry(tmp_path / "s.safetensors")  # hashed while written == read back
    back = state_io.load_tree(tmp_path / "s.safetensors")
    assert set(back["state"]) == {0, 7}  # int keys stay ints
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)  # tuples stay tuples
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert back["state"][0]["step"].shape == () and back["state"][7]["m"].shape == (0,)
    assert math.isnan(back["odd"]["nan"]) and back["odd"]["inf"] == -math.inf and back["odd"]["big"] == 2**70
    assert [t.dtype for t in back["dtypes"]] == [torch.bfloat16, torch.float16, torch.bool, torch.int64]
    assert back["__dunder"] == 1
    assert len(load_file(str(tmp_path / "s.safetensors"))) == 7  # any safetensors reader opens it


def test_a_state_file_builds_only_plain_values(tmp_path):
    from bert_mp.core.checkpoint.state_codec import FORMAT, StateFileError, write_safetensors

    bad = {"__class__": "os.system"}
    write_safetensors(tmp_path / "x.safetensors", {}, {"format": FORMAT, "structure": json.dumps(bad)})
    with pytest.raises(StateFileError, match="unexpected keys"):
        state_io.load_tree(tmp_path / "x.safetensors")
    (tmp_path / "y.safetensors").write_bytes(b"\x80\x04not a safetensors file")
    with pytest.raises(StateFileError, match="y.safetensors is not a readable safetensors file"):
        state_io.load_tree(tmp_path / "y.safetensors")
    with pytest.raises(TypeError, match="cannot checkpoint a object at z.x"):
        state_io.save_tree(tmp_path / "z.safetensors", {"x": object()})


# --------------------------------------------------------------------------------------------------
# a finished run to damage (module scope: copied, never modified)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished(tmp_path_factory, prepared):
    run = tmp_path_factory.mktemp("trust") / "run"
    cfg = tiny_config(run, max_steps=6, save_every=2, save_total_limit=3, precision="fp16")
    cfg.model.hidden_dropout_prob = cfg.model.attention_probs_dropout_prob = 0.1
    train_mod.train(cfg, load_fixture(prepared))
    return run, cfg


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_flipped_byte_in_any_file_is_found_and_named(tmp_path, finished):
    run, _ = finished
    files = sorted(p.name for p in (run / "checkpoints" / "step_00000006").iterdir())
    assert files == [
        "COMPLETE",
        "custom_state_0.safetensors",
        "loop_state.json",
        "model.safetensors",
        "optimizer.safetensors",
        "rng_state_0.safetensors",
        "scaler.safetensors",
    ]
    for name in files:
        for where in ("first", "middle", "last"):
            folder = tmp_path / f"{name}-{where}"
            shutil.copytree(run / "checkpoints" / "step_00000006", folder)
            size = (folder / name).stat().st_size
            _flip(folder / name, {"first": 0, "middle": size // 2, "last": size - 2}[where])
            problem = ckpt.verify(folder)
            assert problem is not None, f"{name} ({where}): a flipped byte passed"
            if name != ckpt.MARKER:
                assert (
                    problem
                    == f"{name} does not match its checksum (corrupted or altered since it was written)"
                )


# --------------------------------------------------------------------------------------------------
# checkpoints written before checksums (Accelerate's pickle layout, size-only manifest)
# --------------------------------------------------------------------------------------------------
def write_legacy_layout(monkeypatch) -> None:
    """Make checkpoints as bert_mp wrote them before: ``accelerator.save_state`` and a size-only marker."""

    def save_state(accelerator, folder):
        accelerator.save_state(str(folder))
        return {}

    def size_only(folder, name, known=None, only=None):
        folder = Path(folder)
        sizes = {
            p.relative_to(folder).as_posix(): p.stat().st_size
            for p in sorted(folder.rglob("*"))
            if p.is_file()
        }
        integrity.atomic_write_json(folder / name, {"files": sizes})
        return {k: {"size": v} for k, v in sizes.items()}

    monkeypatch.setattr(state_io, "write_state", save_state)
    monkeypatch.setattr(integrity, "write_manifest", size_only)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # fp16: scaler.pt
def test_an_older_size_only_checkpoint_resumes_bit_identical_with_a_note(
    tmp_path, prepared, monkeypatch, precision
):
    def cfg_for(out, **kw):
        cfg = tiny_config(out, max_steps=6, save_every=2, precision=precision, **kw)
        cfg.model.hidden_dropout_prob = cfg.model.attention_probs_dropout_prob = 0.1
        return cfg

    train_mod.train(cfg_for(tmp_path / "straight"), load_fixture(prepared))
    with monkeypatch.context() as m:
        write_legacy_layout(m)
        train_mod.train(cfg_for(tmp_path / "old"), load_fixture(prepared))
    old = tmp_path / "old" / "checkpoints" / "step_00000004"
    names = {p.name for p in old.iterdir()}
    assert {"optimizer.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"} <= names
    assert ("scaler.pt" in names) == (precision == "fp16")
    shutil.rmtree(tmp_path / "old" / "checkpoints" / "step_00000006")
    with pytest.warns(UserWarning, match=r"step_00000004 has a size-only manifest .* weights_only=True"):
        summary = train_mod.train(cfg_for(tmp_path / "old", resume="latest"), load_fixture(prepared))
    assert summary["resumed_from"].endswith("step_00000004")
    assert drill.compare(tmp_path / "straight", tmp_path / "old") == []
    # what the resume wrote next is the new layout
    assert ckpt.is_hashed(tmp_path / "old" / "checkpoints" / "step_00000006")


# --------------------------------------------------------------------------------------------------
# crafted pickles: no code runs, the error is one line
# --------------------------------------------------------------------------------------------------
class Payload:
    """Unpickling this runs ``touch marker``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _cli_overrides(out: Path, data_cache: Path, **extra) -> list[str]:
    base = {
        "data.cache_dir": data_cache,
        "data.source": "builtin",
        "data.max_documents": 300,
        "data.vocab_size": 256,
        "data.max_seq_length": 32,
        "data.max_predictions_per_seq": 5,
        "model.preset": "tiny",
        "model.hidden_size": 32,
        "model.num_hidden_layers": 2,
        "model.num_attention_heads": 2,
        "model.intermediate_size": 64,
        "train.output_dir": out,
        "train.max_steps": 4,
        "train.global_batch_size": 8,
        "train.micro_batch_size": 8,
        "train.save_every": 2,
        "train.progress_bar": "false",
        "train.export": "false",
        "train.eval_max_batches": 1,
        "hardware.allow_emulated": "true",
        **extra,
    }
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Two finished 4-step fp16 runs through ``bert-mp train``: the current layout and the older one."""
    from bert_mp.cli import main

    root = tmp_path_factory.mktemp("cli")
    assert main(["train", *_cli_overrides(root / "new", root / "data", **{"train.precision": "fp16"})]) == 0
    with pytest.MonkeyPatch.context() as m:
        write_legacy_layout(m)
        assert (
            main(["train", *_cli_overrides(root / "old", root / "data", **{"train.precision": "fp16"})]) == 0
        )
    return root


def _plant(folder: Path, name: str, marker: Path, legacy: bool) -> None:
    """Replace ``name`` with a crafted pickle and make the marker vouch for it (an attacker can)."""
    torch.save({"state": Payload(marker)}, folder / name)
    if name == ckpt.MARKER:
        return
    if legacy:
        sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != ckpt.MARKER}
        (folder / ckpt.MARKER).write_text(json.dumps({"files": sizes}))
    else:
        integrity.write_manifest(folder, ckpt.MARKER)


@pytest.mark.parametrize("layout", ["new", "old"])
def test_a_crafted_pickle_in_any_checkpoint_file_runs_no_code(tmp_path, cli_runs, capsys, layout):
    from bert_mp.cli import main

    source = cli_runs / layout
    marker = tmp_path / "code-ran"
    # the payload is live: unpickled the way Accelerate loads registered objects, it runs
    torch.save({"state": Payload(marker)}, tmp_path / "probe.pkl")
    torch.load(tmp_path / "probe.pkl", weights_only=False)
    assert marker.exists()
    marker.unlink()
    names = sorted(p.name for p in (source / "checkpoints" / "step_00000004").iterdir())
    if layout == "old":
        assert {"optimizer.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl", "scaler.pt"} <= set(names)
    for name in names:
        run = tmp_path / name
        shutil.copytree(source, run)
        folder = run / "checkpoints" / "step_00000004"
        _plant(folder, name, marker, legacy=layout == "old")
        capsys.readouterr()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rc = main(
                [
                    "train",
                    *_cli_overrides(run, cli_runs / "data", **{"train.precision": "fp16"}),
                    f"train.resume={folder}",
                ]
            )
        err = capsys.readouterr().err.strip().splitlines()
        assert not marker.exists(), f"{layout} layout, {name}: the crafted pickle ran"
        assert rc == 2 and len(err) == 1 and err[0].startswith("bert-mp train: error: "), (name, err)
        assert name in err[0] or "COMPLETE marker" in err[0], (name, err)


# --------------------------------------------------------------------------------------------------
# a damaged newest checkpoint: resume, export and their one-line errors
# --------------------------------------------------------------------------------------------------
def test_bert_mp_export_skips_a_flipped_checkpoint_and_refuses_it_by_name(tmp_path, finished, capsys):
    from bert_mp.cli import main

    run = tmp_path / "run"
    shutil.copytree(finished[0], run)
    newest = run / "checkpoints" / "step_00000006"
    _flip(newest / "model.safetensors", (newest / "model.safetensors").stat().st_size // 2)
    with pytest.warns(
        UserWarning, match=r"skipping checkpoint .*step_00000006: model.safetensors does not match"
    ):
        assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    assert "step_00000004" in (tmp_path / "out" / "README.md").read_text()
    assert integrity.check(tmp_path / "out", "checksums.json", "").problem is None
    capsys.readouterr()
    assert main(["export", str(newest)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"bert-mp export: error: {newest}: cannot export this checkpoint: model.safetensors does not match "
        "its checksum (corrupted or altered since it was written)"
    ]


def test_naming_a_damaged_checkpoint_is_refused_and_latest_falls_back(tmp_path, prepared, finished):
    reference, cfg = finished
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    newest = run / "checkpoints" / "step_00000006"
    _flip(newest / "optimizer.safetensors", 100)
    with pytest.raises(TrainingError, match=r"cannot resume from it: optimizer.safetensors does not match"):
        ckpt.resolve_resume(str(newest), run / "checkpoints")
    cfg = copy.deepcopy(cfg)
    cfg.train.output_dir, cfg.train.resume = str(run), "latest"
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000006: optimizer.safetensors"):
        summary = train_mod.train(cfg, load_fixture(prepared))
    assert summary["resumed_from"].endswith("step_00000004")
    assert drill.compare(reference, run) == []  # fp16 with dropout: scaler and RNG restored exactly


def test_an_export_is_verified_before_it_is_loaded_again(tmp_path, finished):
    from bert_mp.core.config import ModelConfig
    from bert_mp.errors import ConfigError
    from bert_mp.finetune.model import resolve_checkpoint
    from bert_mp.finetune.predict import load_classifier
    from bert_mp.model.bert import check_init_from

    final = tmp_path / "final"
    shutil.copytree(finished[0] / "final", final)
    listed = json.loads((final / "checksums.json").read_text())["files"]
    assert list(listed) == ["model.safetensors"]  # the weights; card, config and tokenizer stay editable
    assert resolve_checkpoint(str(final)) == str(final)
    (final / "README.md").write_text("edited by hand\n")
    check_init_from(ModelConfig(init_from=str(final)))  # still fine
    _flip(final / "model.safetensors", (final / "model.safetensors").stat().st_size - 3)
    why = r"model.safetensors does not match its checksum .*; export it again from its run"
    with pytest.raises(ConfigError, match=rf"^finetune.checkpoint: {final}: {why}"):
        resolve_checkpoint(str(final))
    with pytest.raises(ConfigError, match=rf"^model.init_from={final}: {final}: {why}"):
        check_init_from(ModelConfig(init_from=str(final)))
    with pytest.raises(ConfigError, match=rf"^model: {final}: {why}"):
        load_classifier(str(final))


# --------------------------------------------------------------------------------------------------
# sharded engines keep their own model and optimizer files; the rest is ours
# --------------------------------------------------------------------------------------------------
class _Engine:
    """A stand-in DeepSpeed engine: records what it was asked to save and load."""

    def __init__(self):
        self.calls: list[tuple[str, str, str]] = []

    def save_checkpoint(self, folder, tag):
        self.calls.append(("save", Path(folder).name, tag))
        (Path(folder) / tag).mkdir()
        (Path(folder) / tag / "mp_rank_00_model_states.pt").write_bytes(b"engine bytes")

    def load_checkpoint(self, folder, tag):
        self.calls.append(("load", Path(folder).name, tag))


class _Scheduler:
    def __init__(self):
        self.state = {"last_epoch": 3, "_last_lr": [1e-4, 1e-4]}

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, d):
        self.state = d


def test_under_deepspeed_the_engine_saves_the_model_and_the_rest_is_plain_state(tmp_path):
    from types import SimpleNamespace

    engine, sched = _Engine(), _Scheduler()
    acc = SimpleNamespace(
        distributed_type="DistributedType.DEEPSPEED",
        is_main_process=True,
        process_index=0,
        _models=[engine],
        _optimizers=[object()],  # inside the engine: never saved separately
        _schedulers=[],
        _custom_objects=[sched],
        scaler=None,
    )
    entries = state_io.write_state(acc, tmp_path)
    assert engine.calls == [("save", tmp_path.name, "pytorch_model")]
    assert set(entries) == {"custom_state_0.safetensors", "rng_state_0.safetensors"}
    assert not (tmp_path / "model.safetensors").exists() and not (tmp_path / "optimizer.safetensors").exists()
    integrity.write_manifest(tmp_path, "COMPLETE", entries)  # the engine's files are hashed here
    files = json.loads((tmp_path / "COMPLETE").read_text())["files"]
    assert "pytorch_model/mp_rank_00_model_states.pt" in files
    sched.state = {}
    state_io.read_state(acc, tmp_path, set(files))
    assert engine.calls[-1] == ("load", tmp_path.name, "pytorch_model")
    assert sched.state == {"last_epoch": 3, "_last_lr": [1e-4, 1e-4]}


def test_a_loop_state_of_the_wrong_types_is_one_line(tmp_path):
    (tmp_path / ckpt.LOOP_STATE).write_text(json.dumps({"step": 4, "epoch": "1"}))
    with pytest.raises(TrainingError, match=r"loop_state.json: epoch is not an integer$"):
        ckpt.read_loop_state(tmp_path)
    (tmp_path / ckpt.LOOP_STATE).write_bytes(b"\x80\x04crafted")
    with pytest.raises(TrainingError, match=r"loop_state.json is unreadable"):
        ckpt.read_loop_state(tmp_path)


def test_a_resume_into_fp16_from_an_fp32_checkpoint_starts_a_fresh_loss_scale(tmp_path, prepared):
    cfg = tiny_config(tmp_path / "run", max_steps=2, save_every=2, export=False)
    train_mod.train(cfg, load_fixture(prepared))
    assert not (tmp_path / "run" / "checkpoints" / "step_00000002" / "scaler.safetensors").exists()
    cfg = tiny_config(
        tmp_path / "run", max_steps=3, save_every=2, export=False, precision="fp16", resume="latest"
    )
    summary = train_mod.train(cfg, load_fixture(prepared))
    assert summary["resumed_from"].endswith("step_00000002") and summary["steps"] == 3
