"""Sophia under 2 processes (CPU, gloo, ``accelerate launch``): the ranks' Hessian estimates are
averaged, so every rank takes the same update and the replicas stay equal, bit for bit."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from support import free_port, fresh_process_main, make_prepared, tiny_config

from bert_mp.core.config import save_config
from bert_mp.core.process.spawn import accelerate_launch

pytest.importorskip("pytorch_optimizer")

# Each rank keeps the model it trained and, at exit, saves its parameters to $DUMP/rank<R>.pt. The
# builder is wrapped before the trainer imports it (its default argument binds it at import).
_DUMP_SETUP = (
    "import os, atexit, torch; import bert_mp.model.bert as _mb; _build = _mb.build_model; _kept = []; "
    "_mb.build_model = lambda *a, **k: _kept.append(_build(*a, **k)) or _kept[-1]; "
    "atexit.register(lambda: torch.save({n: p.detach().clone() for n, p in _kept[-1].named_parameters()}, "
    "os.path.join(os.environ['DUMP'], 'rank' + os.environ.get('RANK', '0') + '.pt'))); "
)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
# adamw: a control for reading a sophia failure (AdamW's replicas equal: the difference is Sophia's);
# under -m slow, since it asserts nothing of bert_mp's own that sophia's run does not
@pytest.mark.parametrize("optimizer", [pytest.param("adamw", marks=pytest.mark.slow), "sophia"])
def test_two_process_sophia_keeps_the_replicas_equal(tmp_path, optimizer):
    data_root = tmp_path / "data"
    make_prepared(data_root, n_train=64)
    out = tmp_path / "run"
    # one micro-batch of 4 per rank and step: each rank estimates the Hessian on its own examples
    cfg = tiny_config(out, max_steps=4, global_batch_size=8, micro_batch_size=4, export=False)
    cfg.train.optimizer = optimizer
    cfg.train.sophia_update_period = 1
    cfg_path = tmp_path / "run.yaml"
    save_config(cfg, cfg_path)
    script = tmp_path / "run.py"
    script.write_text(fresh_process_main(_DUMP_SETUP) + "\n")
    dump = tmp_path / "dump"
    dump.mkdir()
    cmd = [
        *accelerate_launch(2, cuda=False, port=free_port()),
        str(script),
        str(cfg_path),
        str(data_root),
    ]
    env = {
        **os.environ,
        "DUMP": str(dump),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (torch.load(Path(dump) / f"rank{r}.pt") for r in (0, 1))
    assert r0.keys() == r1.keys() and r0
    differ = [n for n in r0 if not torch.equal(r0[n], r1[n])]
    assert not differ, f"{len(differ)} of {len(r0)} parameters differ between the ranks: {differ[:5]}"
