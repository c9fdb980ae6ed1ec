"""A full disk through the real CLI: training, its resume, an export and prepare on a small filesystem.

The filesystem is a size-limited tmpfs mounted in a private mount namespace (``unshare --mount``,
with ``--map-root-user`` when not root), so it vanishes with the processes that use it. Where the
platform allows no such mount the test is skipped: the injected ENOSPC at every write point of a
checkpoint (``unit/pretrain/test_faults.py``) and of an export and of prepared data
(``unit/core/test_storage.py``) still run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.config import load_config
from bert_mp.pretrain.trainer import train

PAGE = 4096


def _unshare(probe_dir: Path) -> list[str] | None:
    """The ``unshare`` command that can mount a tmpfs here, or None."""
    if shutil.which("unshare") is None:
        return None
    probe_dir.mkdir()
    for cmd in (["unshare", "--mount"], ["unshare", "--mount", "--map-root-user"]):
        mount = ["sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe_dir}"]
        if subprocess.run([*cmd, *mount], capture_output=True).returncode == 0:
            return cmd
    return None


def _pages(path: Path) -> int:
    """What ``path`` (a file or a folder) takes on a tmpfs: whole pages per file."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in files)


def _overrides(data_cache: Path) -> list[str]:
    return [
        f"data.cache_dir={data_cache}",
        "data.source=builtin",
        "data.max_documents=300",
        "data.vocab_size=256",
        "data.max_seq_length=32",
        "data.max_predictions_per_seq=5",
        "model.preset=tiny",
        "model.hidden_size=32",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "train.global_batch_size=8",
        "train.micro_batch_size=8",
        "train.save_every=10",
        "train.save_total_limit=5",
        "train.eval_every=0",
        "train.progress_bar=false",
        "train.export=false",
    ]


SCRIPT = """
set -u
mount -t tmpfs -o size={size} tmpfs {mnt}
cd {mnt}
run() {{ name=$1; shift; {py} -m bert_mp "$@" > {out}/$name.out 2> {out}/$name.err; echo $? > {out}/$name.rc; }}
run first train {args} train.max_steps=40 train.output_dir={mnt}/run
run again train {args} train.max_steps=40 train.output_dir={mnt}/run train.resume=latest
cp -a {mnt}/run {out}/run-after
dd if=/dev/zero of={mnt}/filler bs=4096 2>/dev/null
run export export {mnt}/run --out {mnt}/exported
run prepare prepare {args} data.cache_dir={mnt}/cache
find {mnt} -name '.tmp*' > {out}/left.txt
"""


def test_a_full_disk_ends_each_command_in_one_line_and_keeps_what_was_complete(tmp_path):
    unshare = _unshare(tmp_path / "probe")
    if unshare is None:
        pytest.skip("no private tmpfs mount on this platform (the injected-ENOSPC unit tests cover it)")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    py = sys.executable
    args = _overrides(tmp_path / "data")
    # a reference on the ordinary disk, trained in this process (it only measures): how much a
    # checkpoint and the run beside it take; it also prepares the data the commands below reuse
    ref = tmp_path / "reference"
    summary = train(load_config(None, [*args, "train.max_steps=30", f"train.output_dir={ref}"]))
    assert summary["status"] == "completed"
    one = _pages(ref / "checkpoints" / "step_00000010")
    beside = _pages(ref / "config.yaml") + _pages(ref / "metrics.jsonl") + 2 * PAGE
    # room for two checkpoints and half of a third: the save at step 30 cannot fit
    size = beside + 2 * one + (one // 2 // PAGE) * PAGE
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "mnt").mkdir()
    script = SCRIPT.format(size=size, mnt=tmp_path / "mnt", out=out, py=py, args=" ".join(args))
    subprocess.run([*unshare, "sh", "-c", script], env=env, check=True, timeout=1200)

    def result(name: str) -> tuple[int, list[str]]:
        err = (out / f"{name}.err").read_text()
        assert "Traceback" not in err, err[-3000:]
        return int((out / f"{name}.rc").read_text()), [ln for ln in err.splitlines() if ln.strip()]

    cdir = tmp_path / "mnt" / "run" / "checkpoints"
    for name in ("first", "again"):
        rc, err = result(name)
        assert rc == 4, (name, err)
        assert [ln for ln in err if ": error: " in ln] == err[-1:], (name, err)
        assert err[-1].startswith(
            f"bert-mp train: error: could not write checkpoint step_00000030 in {cdir}: [Errno 28] No space "
            "left on device ("
        ), err[-1]
        assert err[-1].endswith(
            "the last complete checkpoint, step_00000020, is intact. Free disk space (or lower "
            "save_total_limit) and rerun with train.resume=latest"
        ), err[-1]
        warned = [ln for ln in err if "this save will probably not fit" in ln]
        assert len(warned) == 1 and warned[0].startswith("bert-mp train: warning: "), (name, err)
    after = out / "run-after" / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(after)] == ["step_00000010", "step_00000020"]
    assert all(ckpt.verify(p) is None for p in ckpt.list_checkpoints(after))
    assert not list(after.glob(".tmp-*"))
    assert "resuming from step 20" in (out / "again.out").read_text()

    rc, err = result("export")
    assert (
        rc == 4
        and len(err) == 1
        and err[0].startswith("bert-mp export: error: could not write the export exported in ")
    ), err
    assert "is untouched. Free disk space and run bert-mp export again" in err[0]
    rc, err = result("prepare")
    assert rc == 4 and err[-1].startswith("bert-mp prepare: error: could not write the prepared data in "), (
        err
    )
    assert [ln for ln in err if ": error: " in ln] == err[-1:]
    assert (out / "left.txt").read_text() == ""  # no temporary folder left behind
