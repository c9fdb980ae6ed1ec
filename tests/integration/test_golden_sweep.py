"""Golden numbers of a tiny sweep through the real ``bert-mp sweep`` CLI (fp32, its second seed, bf16),
recorded once; the pretraining run's are in unit/pretrain/test_golden_train.py.

What is pinned: the sweep's figures other than timings (verdicts, deviations, steps, final eval
losses). A change that is meant to leave training untouched (a refactor) must pass this unchanged.
How runs on other CPUs are compared, and the command that re-records: the golden section of
support.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import forkserver
from support import GOLDEN_EVAL_KEYS as EVAL_KEYS
from support import GOLDEN_RECORD as RECORD
from support import GOLDEN_RTOL as RTOL
from support import golden_compare as _compare
from support import golden_fingerprint as fingerprint
from support import golden_load as _load
from support import golden_record as _record
from support import make_tokenizer


def _sweep_corpus(path: Path) -> None:
    """Documents of sentences over the fixture tokenizer's words (w0..w58), fixed by a seed."""
    import numpy as np

    rng = np.random.default_rng(3)
    docs = []
    for _ in range(60):
        sentences = []
        for _ in range(int(rng.integers(2, 7))):
            words = rng.integers(0, 59, size=int(rng.integers(3, 10)))
            sentences.append(" ".join(f"w{w}" for w in words) + ".")
        docs.append(" ".join(sentences))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")


def sweep_run(tmp: Path) -> dict[str, Any]:
    """fp32 (+ its second seed) and bf16 through the real ``bert-mp sweep`` CLI; timings left out."""
    from bert_mp.cli import main

    corpus, tok = tmp / "corpus.txt", tmp / "tokenizer"
    _sweep_corpus(corpus)
    make_tokenizer().save_pretrained(str(tok))
    root = tmp / "sweep"
    overrides = [
        f"sweep.output_dir={root}",
        "sweep.precisions=[fp32,bf16]",
        "sweep.reference_seed=7",
        "hardware.allow_emulated=true",  # bf16 on every CPU, emulated where not native
        "sweep.parity_window=4",
        "sweep.profile_steps=0",
        "data.source=text",
        f"data.paths=[{corpus}]",
        f"data.tokenizer={tok}",
        f"data.cache_dir={tmp / 'data'}",
        "data.max_seq_length=32",
        "data.validation_fraction=0.2",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "model.max_position_embeddings=64",
        "train.max_steps=12",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.learning_rate=0.003",
        "train.warmup_steps=2",
        "train.eval_every=6",
        "train.export=false",
        "train.progress_bar=false",
    ]
    assert main(["sweep", *overrides]) == 0
    summary = json.loads((root / "summary.json").read_text())
    (group,) = summary["groups"]
    verdicts = {
        name: {
            "status": v["status"],
            "checks": {
                c: {k: check.get(k) for k in ("value", "tolerance", "ratio", "seed_spread", "status")}
                for c, check in sorted((v.get("checks") or {}).items())
            },
        }
        for name, v in group["verdicts"].items()
    }
    runs = {}
    for entry in summary["runs"]:
        s = json.loads((root / entry["dir"] / "summary.json").read_text())
        runs[entry["name"]] = {
            "status": s["status"],
            "steps": s["steps"],
            "skipped_steps": s["skipped_steps"],
            "final_eval": {k: s["final_eval"][k] for k in EVAL_KEYS},
        }
    return {"verdicts": verdicts, "runs": runs}


# --------------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------------
def run_precision(run_name: str) -> str:
    """A sweep run's precision from its name (``fp32``, ``fp32-seed7``, ``bf16``)."""
    return run_name.split("-")[0]


def test_golden_sweep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    forkserver.route_sweep_runs(monkeypatch)  # each run a process of its own, forked from a server
    got = sweep_run(tmp_path)
    if RECORD:
        _record("sweep", None, got)
        return
    golden = _load("sweep")
    same_machine = golden["fingerprint"] == fingerprint()
    problems: list[str] = []
    want = {"verdicts": golden["verdicts"], "runs": golden["runs"]}
    if same_machine:
        _compare(got, want, None, "sweep", problems)
    else:
        for name, run in want["runs"].items():
            rtol = RTOL["bf16" if run_precision(name) == "bf16" else "fp32"]
            _compare(got["runs"].get(name), run, rtol, f"sweep.runs.{name}", problems)
        # A deviation is a difference of two nearby losses: a 1e-5 relative drift of the losses is up
        # to ~1e-2 of an fp32 seed deviation. bf16's deviations from fp32 (~1e-5) are kernel noise
        # themselves, and its verdict may move near a threshold: it is compared on the same CPU only.
        for name, v in want["verdicts"].items():
            if run_precision(name) == "fp32":
                _compare(got["verdicts"].get(name), v, 1e-2, f"sweep.verdicts.{name}", problems)
    assert not problems, "\n".join(problems[:20])
