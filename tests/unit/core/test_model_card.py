"""One model card: ``bert-mp export`` writes the same facts as the run's own ``final/README.md``."""

from __future__ import annotations

from support import make_prepared, tiny_config

import bert_mp.pretrain.trainer as train_mod
from bert_mp.cli import main


def _table(card: str) -> dict[str, str]:
    rows = [ln.strip("|").split("|") for ln in card.splitlines() if ln.startswith("| ") and "---" not in ln]
    return {k.strip(): v.strip() for k, v in rows if k.strip()}


def test_exported_card_has_the_training_examples_and_evaluation_of_final(tmp_path):
    data = make_prepared(tmp_path / "data")
    cfg = tiny_config(tmp_path / "run", max_steps=6, save_every=2, save_total_limit=3, eval_every=3)
    train_mod.train(cfg, data)
    run = tmp_path / "run"
    final = _table((run / "final" / "README.md").read_text())
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    exported = _table((tmp_path / "exported" / "README.md").read_text())
    assert "?" not in exported["data"] and "256 training examples" in exported["data"]
    assert exported.pop("checkpoint").startswith("step_00000006 of run")
    assert exported == final  # the same facts, evaluation included
    assert {"eval MLM loss", "eval MLM accuracy"} <= set(final)

    # an older checkpoint: the evaluation it had (step 3), said to be from that step
    assert main(["export", str(run / "checkpoints" / "step_00000004"), "--out", str(tmp_path / "old")]) == 0
    old = _table((tmp_path / "old" / "README.md").read_text())
    assert old["evaluated"].startswith("at step 3") and old["eval MLM loss"] != final["eval MLM loss"]
