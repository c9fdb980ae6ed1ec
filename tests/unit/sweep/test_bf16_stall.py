"""bf16_pure: nearest rounding stalls (updates vanish below bf16's spacing) and the verdict says so,
on the same run where Kahan-compensated updates pass - the FAIL path of the verdict, proven."""

from __future__ import annotations

from support import load_fixture, reset_accelerate, tiny_config

import bert_mp.pretrain.trainer as train_mod
from bert_mp.pretrain import parity_monitor
from bert_mp.sweep import parity


def _run(tmp_path, prepared, name: str, **kw) -> parity_monitor.Curves:
    reset_accelerate()
    # LAMB's step moves each weight by about learning_rate x its size: 1e-3 is below half of bf16's
    # relative spacing (2**-9), so with nearest rounding most of every update rounds away
    cfg = tiny_config(tmp_path / name, optimizer="lamb", learning_rate=1e-3, max_steps=12, export=False, **kw)
    train_mod.train(cfg, load_fixture(prepared))
    return parity_monitor.load_curves(tmp_path / name)


def test_bf16_update_none_is_flagged_stalled_where_kahan_passes(tmp_path, prepared):
    ref = _run(tmp_path, prepared, "fp32")
    spread = _run(tmp_path, prepared, "fp32-seed43", seed=43)
    rules = parity.VerdictRules(window=4)
    kahan = _run(tmp_path, prepared, "kahan", precision="bf16_pure", bf16_update="kahan")
    none = _run(tmp_path, prepared, "none", precision="bf16_pure", bf16_update="none")

    ok = parity.verdict(kahan, ref, spread, rules)
    assert ok.status == "pass", ok.reasons
    eff = [v for _, v in kahan.series("train", parity_monitor.STALL_KEY)]
    assert len(eff) == 12 and min(eff) > 0.9

    stalled = parity.verdict(none, ref, spread, rules)
    assert stalled.status == "fail"
    assert any(r.startswith("stalled:") for r in stalled.reasons), stalled.reasons
    assert parity.stall_reason(none) is not None and parity.stall_reason(kahan) is None
