"""Faults during training, in this process: corrupt checkpoints, a full disk, NaN storms, a collapsing
loss scale, death after the final checkpoint. Kills of real training processes (the kill drill):
integration/test_fault_drill.py.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from support import (
    inf_grad_builder,
    load_fixture,
    load_script,
    nan_forward_builder,
    reset_accelerate,
    tiny_config,
)

import bert_mp.pretrain.trainer as train_mod
from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.storage.files import read_jsonl
from bert_mp.errors import TrainingError

drill = load_script("drills/fault")


# --------------------------------------------------------------------------------------------------
# corrupt checkpoints on disk
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, prepared) -> tuple[Path, Any]:
    """A 6-step run with complete checkpoints at steps 2, 4 and 6, and its config (do not modify)."""
    reset_accelerate()
    run = tmp_path_factory.mktemp("finished") / "run"
    cfg = tiny_config(run, max_steps=6, save_every=2, save_total_limit=3)
    train_mod.train(cfg, load_fixture(prepared))
    reset_accelerate()
    return run, cfg


def _corrupt(folder: Path, case: str) -> str:
    """Damage a complete checkpoint; returns the reason ``verify`` must give."""
    if case == "truncated tensor file":
        f = folder / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return r"model.safetensors has \d+ bytes, expected \d+ \(truncated"
    if case == "missing optimizer file":
        (folder / "optimizer.safetensors").unlink()
        return "missing file optimizer.safetensors"
    if case == "flipped byte (same size)":
        f = folder / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
        return r"model.safetensors does not match its checksum \(corrupted or altered"
    if case == "missing loop state":
        (folder / ckpt.LOOP_STATE).unlink()
        return "missing file loop_state.json"
    if case == "garbage marker":
        (folder / ckpt.MARKER).write_bytes(bytes(random.Random(1).randrange(256) for _ in range(64)))
        return "unreadable COMPLETE marker"
    if case == "marker of the wrong shape":
        (folder / ckpt.MARKER).write_text(json.dumps({"files": ["model.safetensors"]}))
        return "unreadable COMPLETE marker"
    if case == "no marker":
        (folder / ckpt.MARKER).unlink()
        return "no COMPLETE marker"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "truncated tensor file",
        "flipped byte (same size)",
        "missing optimizer file",
        "missing loop state",
        "garbage marker",
        "marker of the wrong shape",
        "no marker",
    ],
)
def test_corrupt_newest_checkpoint_is_skipped_for_the_previous_one(
    tmp_path, prepared, finished_run, monkeypatch, case
):
    from bert_mp.core.checkpoint import state_codec as state_io

    reference, cfg = finished_run
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    cfg = copy.deepcopy(cfg)
    cfg.train.output_dir = str(run)
    newest = run / "checkpoints" / "step_00000006"
    reason = _corrupt(newest, case)

    loaded: list[str] = []
    real_read = state_io.read_state
    monkeypatch.setattr(
        state_io,
        "read_state",
        lambda acc, folder, *a, **kw: loaded.append(Path(folder).name) or real_read(acc, folder, *a, **kw),
    )
    cfg.train.resume = "latest"
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*step_00000006: {reason}"):
        summary = train_mod.train(cfg, load_fixture(prepared))
    assert loaded == ["step_00000004"]  # the damaged one was never read
    assert summary["resumed_from"].endswith("step_00000004") and summary["steps"] == 6
    # continuing from the previous good checkpoint reproduces the uninterrupted run exactly
    assert drill.compare(reference, run) == []


# --------------------------------------------------------------------------------------------------
# a failing checkpoint write (disk full)
# --------------------------------------------------------------------------------------------------
def _enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


WRITE_POINTS = (
    "checkpoint folder",
    "model.safetensors",
    "optimizer.safetensors",
    "custom_state_0.safetensors",
    "scaler.safetensors",
    "rng_state_0.safetensors",
    "loop_state.json",
    "COMPLETE",
    "rename into place",
)


def _fail_at(monkeypatch, where: str, step_name: str) -> None:
    """The disk fills up at ``where`` while checkpoint ``step_name`` is written (a file: half-way through it)."""
    from bert_mp.core.storage import checksums as integrity

    def ours(path) -> bool:
        return Path(path).parent.name == f".tmp-{step_name}"

    if where == "checkpoint folder":
        real_start = ckpt._start_folder

        def start(tmp, step):
            real_start(tmp, step)
            if tmp.name == f".tmp-{step_name}":
                raise _enospc()

        monkeypatch.setattr(ckpt, "_start_folder", start)
    elif where == "COMPLETE":
        real_json = integrity.atomic_write_json
        monkeypatch.setattr(
            integrity,
            "atomic_write_json",
            lambda path, obj: (_ for _ in ()).throw(_enospc()) if ours(path) else real_json(path, obj),
        )
    elif where == "rename into place":
        real_replace = os.replace
        monkeypatch.setattr(
            ckpt.os,
            "replace",
            lambda a, b: (
                (_ for _ in ()).throw(_enospc())
                if Path(a).name == f".tmp-{step_name}"
                else real_replace(a, b)
            ),
        )
    else:
        real_write = integrity.HashingWriter.write

        def write(self, data):
            if self.path.name == where and ours(self.path):
                real_write(self, memoryview(data).cast("B")[: memoryview(data).nbytes // 2])
                raise _enospc()
            return real_write(self, data)

        monkeypatch.setattr(integrity.HashingWriter, "write", write)


@pytest.mark.parametrize("where", WRITE_POINTS)
def test_disk_full_at_each_write_point_of_a_checkpoint_keeps_the_previous_one_and_stops(
    tmp_path, prepared, monkeypatch, where
):
    run = tmp_path / "run"
    precision = "fp16" if where == "scaler.safetensors" else "fp32"
    cfg = tiny_config(run, max_steps=8, save_every=2, export=False, precision=precision)
    _fail_at(monkeypatch, where, "step_00000004")
    with pytest.raises(TrainingError) as caught:
        train_mod.train(cfg, load_fixture(prepared))
    message = str(caught.value)
    assert caught.value.exit_code == 4 and "\n" not in message
    assert re.fullmatch(
        rf"could not write checkpoint step_00000004 in {re.escape(str(run / 'checkpoints'))}: "
        r"\[Errno 28\] No space left on device \([\d.]+ [kMGT]?B free, needs about [\d.]+ [kMGT]?B\); "
        r"the last complete checkpoint, step_00000002, is intact\. Free disk space \(or lower "
        r"save_total_limit\) and rerun with train\.resume=latest",
        message,
    ), message
    cdir = run / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(cdir)] == ["step_00000002"]
    assert ckpt.verify(cdir / "step_00000002") is None  # the previous checkpoint is intact
    assert not list(cdir.glob(".tmp-*"))  # the partial write is gone (it would only hold disk space)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == message
    assert summary["steps"] == 4


# --------------------------------------------------------------------------------------------------
# NaN storms and loss-scale collapse
# --------------------------------------------------------------------------------------------------
def _needs(precision: str) -> None:
    from bert_mp.core.numerics.precision import _cpu_supports_bf16, _cpu_supports_fp16

    if not (_cpu_supports_bf16() if precision == "bf16" else _cpu_supports_fp16()):
        pytest.skip(f"CPU without {precision} autocast")


def _weights(run: Path, step: int) -> dict:
    return load_file(str(run / "checkpoints" / ckpt.checkpoint_name(step) / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# (fp32/tf32 take the same non-finite-loss path as bf16; tests/unit/pretrain/test_train.py checks fp32 stops)
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_nan_storm_stops_after_saving_the_last_good_state(tmp_path, prepared, precision):
    kw = dict(
        precision=precision,
        max_steps=4,
        save_every=3,
        save_total_limit=3,
        export=False,
        max_consecutive_skipped_steps=3,
    )
    clean = tmp_path / "clean"
    train_mod.train(tiny_config(clean, **kw), load_fixture(prepared))

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    build = nan_forward_builder(lambda n: n >= 4)  # every forward from step 4 on is NaN
    run = tmp_path / "run"
    expected = "3 optimizer steps in a row overflowed" if precision == "fp16" else "non-finite loss"
    with pytest.raises(TrainingError, match=expected):
        train_mod.train(tiny_config(run, **kw), load_fixture(prepared), build_model=build)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and expected in summary["error"] and summary["steps"] == 3
    assert ckpt.find_latest(run / "checkpoints").name == "step_00000003"
    # the saved state is the last good one: the weights of the clean run after step 3, bit for bit
    assert _same(_weights(run, 3), _weights(clean, 3))
    assert not _same(_weights(run, 3), _weights(clean, 4))


def test_loss_scale_collapse_stops_with_a_clear_message(tmp_path, prepared):
    # every other step overflows: never 20 in a row, but each one halves the scale (8 -> 4 -> 2 -> 1 -> 0.5)
    build = inf_grad_builder(lambda n: n % 2 == 1)
    run = tmp_path / "run"
    cfg = tiny_config(run, precision="fp16", max_steps=20, fp16_init_scale=8.0, export=False)
    with pytest.raises(TrainingError, match="loss scale collapsed"):
        train_mod.train(cfg, load_fixture(prepared), build_model=build)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 3 and summary["skipped_steps"] == 4
    assert ckpt.find_latest(run / "checkpoints").name == "step_00000003"


def test_death_after_the_final_checkpoint_resumes_without_a_duplicate_eval(
    tmp_path, prepared, finished_run, monkeypatch
):
    """Killed between the last checkpoint and the export: the resume only re-evaluates and exports."""
    from accelerate.state import AcceleratorState, GradientState

    reference, cfg = finished_run
    run = tmp_path / "run"
    cfg = copy.deepcopy(cfg)
    cfg.train.output_dir = str(run)

    def die(*args, **kwargs):
        raise KeyboardInterrupt  # stands in for a SIGKILL: nothing after this point runs

    monkeypatch.setattr(ckpt, "export_pretrained", die)
    with pytest.raises(KeyboardInterrupt):
        train_mod.train(cfg, load_fixture(prepared))
    assert ckpt.find_latest(run / "checkpoints").name == "step_00000006" and not (run / "final").exists()
    monkeypatch.undo()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    cfg.train.resume = "latest"
    summary = train_mod.train(cfg, load_fixture(prepared))
    assert summary["resumed_from"].endswith("step_00000006") and summary["status"] == "completed"
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"] == [6]
    assert drill.compare(reference, run) == []
