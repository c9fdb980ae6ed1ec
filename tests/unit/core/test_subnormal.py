"""Subnormal floats on CPU: ``hardware.flush_denormal`` flushes them on every thread of torch's pool
(set before the pool starts, as the CLI does), says so where it cannot, and a run's weights and
optimizer state are counted for them bit by bit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bert_mp.core.numerics import subnormal

FRESH = """
import torch
from bert_mp.core.numerics.subnormal import flush_denormal
torch.set_num_threads(2)
{before}
print(flush_denormal(True))
x = torch.full((1 << 20,), 2.0 ** -70)
print(int(((x * x).view(torch.int32) != 0).sum()))  # subnormal results left
"""


def _fresh(before: str = "") -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", FRESH.format(before=before)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()


def test_flushing_set_before_the_thread_pool_holds_on_every_thread():
    effect, left = _fresh()
    if effect == "unsupported":
        pytest.skip("this CPU cannot flush subnormals (not x86 with SSE3)")
    assert (effect, left) == ("on", "0")


def test_flushing_set_after_the_thread_pool_started_is_found_partial():
    """Threads started before keep their setting: the check finds some results still subnormal."""
    effect, left = _fresh(before="(torch.ones(1 << 20) * 2).sum()  # starts the pool")
    if effect == "unsupported":
        pytest.skip("this CPU cannot flush subnormals (not x86 with SSE3)")
    assert effect == "partial" and int(left) > 0


def test_a_partial_flush_is_a_warning_naming_the_key(monkeypatch):
    from bert_mp.errors import BertMPWarning

    monkeypatch.setattr(subnormal, "flush_denormal", lambda on: "partial")
    with pytest.warns(BertMPWarning, match=r"hardware.flush_denormal=true: only some of torch's threads"):
        assert subnormal.apply_flush_denormal(True) == "partial"
    monkeypatch.setattr(subnormal, "flush_denormal", lambda on: "off")
    assert subnormal.apply_flush_denormal(False) == "off"  # not asked for: nothing to say


def _from_bits(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    view = torch.int32 if dtype == torch.float32 else torch.int16
    return torch.tensor(bits, dtype=view).view(dtype)


def test_the_share_counts_fp32_and_bf16_subnormals_from_their_bits():
    # fp32: 1 (smallest subnormal), 0x007FFFFF (largest), 0x00800000 (smallest normal), 0, -subnormal
    fp32 = _from_bits([1, 0x007FFFFF, 0x00800000, 0, 0x80000001 - (1 << 32)], torch.float32)
    bf16 = _from_bits([0x0001, 0x3F80, 0x0000, 0x0080], torch.bfloat16)  # subnormal, 1.0, 0, normal
    fp16 = torch.tensor([1e-6, 1.0], dtype=torch.float16)  # fp16's own subnormals: normal in fp32
    assert subnormal.subnormal_share([fp32]) == pytest.approx(3 / 5)
    assert subnormal.subnormal_share([fp32, bf16, fp16]) == pytest.approx(4 / 9)
    assert subnormal.subnormal_share([fp16]) is None and subnormal.subnormal_share([]) is None


def test_state_tensors_are_the_weights_and_the_optimizer_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    tensors = subnormal.state_tensors(model, opt)
    # weight + bias, and per parameter exp_avg and exp_avg_sq (the scalar step is left out)
    assert len(tensors) == 2 + 2 * 2
    assert subnormal.state_tensors(None, None) == []
