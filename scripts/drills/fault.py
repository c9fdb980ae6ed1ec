"""Fault drill: kill a running ``bert-mp train`` at random points, resume, and compare bit for bit.

An uninterrupted fp32 run of a tiny model is the reference. Each trial starts the same run in a
fresh output folder and, at seeded random moments, kills the training process - SIGKILL at a random
step, SIGKILL while a checkpoint is being written (the ``.tmp-step_*`` folder exists), and SIGTERM
(the run must save and exit cleanly) - then resumes with ``train.resume=latest`` until it completes.
A trial passes when its per-step loss log (every deterministic field of metrics.jsonl, train and
eval rows) and its final weights equal the reference exactly.

Per kill it records where the process died, the newest complete checkpoint left on disk and the
steps lost (logged steps beyond that checkpoint: at most ``train.save_every`` for SIGKILL, 0 for
SIGTERM). Dropout is on, so the restored RNG streams are checked too.

    python scripts/drills/fault.py --out runs/fault_drill.json
    python scripts/drills/fault.py --prepared DIR --trials 10 --kills 2 --out drill.json

Without ``--prepared`` the data comes from ``bert-mp prepare`` (tiny built-in corpus) and every
training process is the real CLI, ``python -m bert_mp train CONFIG``. ``--prepared DIR`` takes a
folder in the prepared-data layout of docs/architecture.md and runs this script's ``--child`` mode,
which feeds that folder to the same ``bert_mp.pretrain.trainer.train``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from bert_mp.core.checkpoint import store as ckpt
from bert_mp.core.config import Config, load_config, save_config
from bert_mp.core.process import hold
from bert_mp.core.storage.files import read_jsonl
from bert_mp.pretrain import trainer as train_mod

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: its rooms import as packages
from bench.harness import write_report  # noqa: E402

# metrics.jsonl fields that depend on wall-clock time or the machine, not on the computation
_VOLATILE_PREFIXES = ("time/", "throughput/", "memory/", "data/")
CHILD_TIMEOUT_S = 600


@dataclass
class DrillSpec:
    """The drilled run and the kill schedule."""

    max_steps: int = 24
    save_every: int = 4
    trials: int = 10
    kills: int = 2
    """Kills per trial (each followed by a resume); the last resume runs to completion."""
    write_share: float = 0.4
    """Share of SIGKILLs aimed at a checkpoint write instead of a random step."""
    sigterm_trials: int = 2
    """Extra trials whose single interruption is a SIGTERM (must save, exit 143 and lose no step)."""
    seed: int = 0
    """Seed of the kill schedule (the training seed is fixed by the config)."""
    precision: str = "fp32"
    """train.precision of the drilled run (fp16: the GradScaler state must survive every kill too)."""


@dataclass
class KillRecord:
    """What one interruption did."""

    trial: int
    signal: str
    aim: str
    """``step``: a random step; ``write``: inside a checkpoint write; ``term``: SIGTERM at a random step."""
    target: int
    """The step (``step``/``term``) or checkpoint step (``write``) aimed at."""
    stage: str | None = None
    """``write`` only: where inside the write the process is held for the kill (``ckpt.WRITE_STAGES``)."""
    returncode: int | None = None
    logged_step: int = 0
    """Last optimizer step in metrics.jsonl when the process died."""
    resume_step: int = 0
    """Step of the newest complete checkpoint left on disk (0: none, the resume starts fresh)."""
    steps_lost: int = 0
    during_write: bool = False
    """A ``.tmp-step_*`` folder was left behind: the process died inside a checkpoint write."""
    partial_files: list[str] = field(default_factory=list)
    """Files in the interrupted checkpoint folder (what the write had got to)."""
    completed_before_kill: bool = False
    """The run ended before the kill landed (the kill did not happen)."""
    clean_exit: bool | None = None
    """SIGTERM only: exit code 143, status ``stopped``, checkpoint at the last logged step."""


# --------------------------------------------------------------------------------------------------
# run config and processes
# --------------------------------------------------------------------------------------------------
def drill_config(out_dir: Path, spec: DrillSpec, data_cache: Path) -> Config:
    """A tiny run with dropout on, gradient accumulation, periodic eval and frequent checkpoints.

    bf16/fp16 run emulated where the CPU lacks them (``hardware.allow_emulated``): the drill checks
    that nothing is lost or changed by a kill, not speed.
    """
    overrides = [
        f"data.cache_dir={data_cache}",
        "data.source=builtin",
        "data.max_documents=400",
        "data.vocab_size=512",
        "data.max_seq_length=32",
        "data.max_predictions_per_seq=5",
        "model.preset=tiny",
        "model.hidden_size=32",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        f"train.precision={spec.precision}",
        "hardware.allow_emulated=true",
        f"train.output_dir={out_dir}",
        f"train.max_steps={spec.max_steps}",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.learning_rate=3e-3",
        "train.warmup_steps=2",
        f"train.save_every={spec.save_every}",
        "train.save_total_limit=2",
        f"train.eval_every={max(spec.max_steps // 3, 1)}",
        "train.eval_max_batches=2",
        "train.progress_bar=false",
        "train.log_every=1",
        "train.export=true",
    ]
    return load_config(None, overrides)


def child_env() -> dict[str, str]:
    return {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        # one thread: the reference and every resumed process reduce in the same order
        "OMP_NUM_THREADS": "1",
    }


class Runner:
    """Starts training processes for a config file: the real CLI, or ``--child`` on a prepared folder."""

    def __init__(self, prepared: Path | None):
        self.prepared = prepared

    def command(self, cfg_path: Path) -> list[str]:
        if self.prepared is None:
            return [sys.executable, "-m", "bert_mp", "train", str(cfg_path)]
        return [sys.executable, str(Path(__file__).resolve()), "--child", str(cfg_path), str(self.prepared)]

    def start(self, cfg_path: Path, log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(log, "ab") as f:
            return subprocess.Popen(
                self.command(cfg_path),
                env={**child_env(), **(extra_env or {})},
                stdout=f,
                stderr=subprocess.STDOUT,
            )

    def run(self, cfg_path: Path, log: Path) -> None:
        proc = self.start(cfg_path, log)
        if proc.wait(timeout=CHILD_TIMEOUT_S) != 0:
            raise RuntimeError(f"training process failed (exit {proc.returncode}); see {log}")


def prepare_builtin(cfg: Config, log: Path) -> None:
    """Build the drill's data with the real ``bert-mp prepare`` CLI (once; later calls hit its cache)."""
    cfg_path = log.with_suffix(".yaml")
    save_config(cfg, cfg_path)
    with open(log, "ab") as f:
        rc = subprocess.call(
            [sys.executable, "-m", "bert_mp", "prepare", str(cfg_path)], env=child_env(), stdout=f, stderr=f
        )
    if rc != 0:
        raise RuntimeError(f"bert-mp prepare failed (exit {rc}); see {log}, or pass --prepared DIR")


def write_run_config(cfg: Config, resume: bool) -> Path:
    """The config file for one launch; ``resume`` sets ``train.resume=latest``."""
    cfg.train.resume = "latest" if resume else None
    path = Path(cfg.train.output_dir).with_name(
        Path(cfg.train.output_dir).name + ("-resume.yaml" if resume else ".yaml")
    )
    save_config(cfg, path)
    return path


# --------------------------------------------------------------------------------------------------
# observing a run from outside
# --------------------------------------------------------------------------------------------------
def last_logged_step(out_dir: Path) -> int:
    """Last optimizer step in metrics.jsonl (0 when there is none yet)."""
    path = out_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [r["step"] for r in read_jsonl(path) if r.get("kind") == "train"]
    return steps[-1] if steps else 0


def newest_complete_step(ckpt_dir: Path) -> int:
    """Step of the checkpoint ``train.resume=latest`` would load (0: none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # skipped (incomplete) checkpoints are expected here
        latest = ckpt.find_latest(ckpt_dir)
    return int(latest.name.removeprefix("step_")) if latest else 0


def _tmp_folders(ckpt_dir: Path) -> list[Path]:
    if not ckpt_dir.is_dir():
        return []
    return [p for p in ckpt_dir.iterdir() if p.name.startswith(".tmp-step_")]


def wait_held(proc: subprocess.Popen, ready: Path) -> bool:
    """Until the process holds at its point (True: ``ready`` exists) or exits (False). Waiting on the
    process is the poll interval: no sleep, and its exit is seen at once."""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while not ready.exists():
        try:
            proc.wait(timeout=0.01)
            return ready.exists()
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise TimeoutError("the training process neither reached its hold point nor exited") from None
    return True


def hold_point(rec: KillRecord) -> str:
    """Where the process holds for ``rec``'s signal (:mod:`bert_mp.core.process.hold`): inside the write of
    checkpoint ``target`` at ``stage``, or after step ``target``."""
    if rec.aim == "write":
        return f"checkpoint:{rec.target}:{rec.stage}"
    return f"step:{rec.target}"


def interrupt(runner: Runner, cfg_path: Path, out_dir: Path, rec: KillRecord, log: Path) -> None:
    """Start a run, kill it as ``rec`` says, and fill in what was left on disk.

    The process holds at the kill point (``BERT_MP_HOLD``) until the signal lands: deterministic,
    whatever the machine's speed or load; the signal itself is a real SIGKILL or SIGTERM."""
    ckpt_dir = out_dir / "checkpoints"
    ready = out_dir.with_name(f"{out_dir.name}.held")
    ready.unlink(missing_ok=True)
    proc = runner.start(cfg_path, log, {hold.HOLD_ENV: hold_point(rec), hold.READY_ENV: str(ready)})
    hit = wait_held(proc, ready)
    if hit:
        proc.send_signal(signal.SIGKILL if rec.signal == "SIGKILL" else signal.SIGTERM)
    rec.returncode = proc.wait(timeout=CHILD_TIMEOUT_S)
    ready.unlink(missing_ok=True)
    rec.completed_before_kill = not hit or (rec.returncode == 0 and (out_dir / "final").is_dir())
    rec.logged_step = last_logged_step(out_dir)
    rec.resume_step = newest_complete_step(ckpt_dir)
    rec.steps_lost = max(rec.logged_step - rec.resume_step, 0)
    tmps = _tmp_folders(ckpt_dir)
    rec.during_write = bool(tmps)
    rec.partial_files = sorted(str(p.relative_to(t)) for t in tmps for p in t.rglob("*") if p.is_file())
    if rec.signal == "SIGTERM" and not rec.completed_before_kill:
        summary = (
            json.loads((out_dir / "summary.json").read_text()) if (out_dir / "summary.json").is_file() else {}
        )
        rec.clean_exit = (
            rec.returncode == train_mod.STOP_EXIT_CODES["signal SIGTERM"]
            and summary.get("status") == "stopped"
            and summary.get("steps") == rec.logged_step == rec.resume_step
        )


# --------------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------------
def loss_log(out_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields: what must be identical between runs."""
    return [
        {k: v for k, v in r.items() if not k.startswith(_VOLATILE_PREFIXES)}
        for r in read_jsonl(out_dir / "metrics.jsonl")
    ]


def compare(reference: Path, run: Path) -> list[str]:
    """Differences between two finished runs (empty when bit-identical)."""
    problems = []
    a, b = loss_log(reference), loss_log(run)
    if a != b:
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        problems.append(f"metrics differ from row {first} ({len(a)} vs {len(b)} rows)")
    wa = load_file(str(reference / "final" / "model.safetensors"))
    wb = load_file(str(run / "final" / "model.safetensors"))
    if wa.keys() != wb.keys():
        problems.append("final weights have different keys")
    else:
        differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
        if differ:
            problems.append(f"{len(differ)} final weight tensors differ (first: {differ[0]})")
    return problems


# --------------------------------------------------------------------------------------------------
# the drill
# --------------------------------------------------------------------------------------------------
def _plan_kill(
    trial: int, resume_from: int, spec: DrillSpec, rng: random.Random, sigterm: bool
) -> KillRecord:
    """Pick the next interruption of a run that resumes from step ``resume_from``."""
    if sigterm:
        return KillRecord(trial, "SIGTERM", "term", rng.randint(resume_from + 1, spec.max_steps - 2))
    saves = [s for s in range(spec.save_every, spec.max_steps, spec.save_every) if s > resume_from]
    if saves and rng.random() < spec.write_share:
        return KillRecord(trial, "SIGKILL", "write", rng.choice(saves), rng.choice(ckpt.WRITE_STAGES))
    return KillRecord(trial, "SIGKILL", "step", rng.randint(resume_from + 1, spec.max_steps - 1))


def run_drill(workdir: Path, spec: DrillSpec, prepared: Path | None = None) -> dict:
    """Run the reference and every trial in ``workdir``; return the report (see ``summarize``)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    runner = Runner(prepared)
    data_cache = workdir / "data"
    log = workdir / "drill.log"
    if prepared is None:
        prepare_builtin(drill_config(workdir / "prepare", spec, data_cache), workdir / "prepare.log")
    rng = random.Random(spec.seed)

    reference = workdir / "reference"
    started = time.perf_counter()
    runner.run(write_run_config(drill_config(reference, spec, data_cache), resume=False), log)
    reference_s = time.perf_counter() - started

    kills: list[KillRecord] = []
    trials = []
    for trial in range(spec.trials + spec.sigterm_trials):
        sigterm = trial >= spec.trials
        out = workdir / f"trial_{trial:02d}"
        cfg = drill_config(out, spec, data_cache)
        fresh, resume = write_run_config(cfg, resume=False), write_run_config(cfg, resume=True)
        launches, resume_from = 0, 0
        for _ in range(1 if sigterm else spec.kills):
            rec = _plan_kill(trial, resume_from, spec, rng, sigterm)
            interrupt(runner, resume if launches else fresh, out, rec, log)
            launches += 1
            kills.append(rec)
            if rec.completed_before_kill:
                break
            resume_from = rec.resume_step
            if resume_from >= spec.max_steps - 1:
                break
        problems = []
        if not (out / "final").is_dir():
            expected = newest_complete_step(out / "checkpoints")
            runner.run(resume, log)
            launches += 1
            got = json.loads((out / "summary.json").read_text())["resumed_from"] or "fresh start"
            if expected and not got.endswith(ckpt.checkpoint_name(expected)):
                problems.append(f"resumed from {got}, not the newest complete step {expected}")
        problems += compare(reference, out)
        trials.append({"trial": trial, "launches": launches, "problems": problems})
    return summarize(spec, kills, trials, reference_s)


def summarize(spec: DrillSpec, kills: list[KillRecord], trials: list[dict], reference_s: float) -> dict:
    landed = [k for k in kills if not k.completed_before_kill]
    sigkills = [k for k in landed if k.signal == "SIGKILL"]
    sigterms = [k for k in landed if k.signal == "SIGTERM"]
    return {
        "spec": asdict(spec),
        "reference_seconds": round(reference_s, 2),
        "trials": len(trials),
        "kills_landed": len(landed),
        "kills_missed": len(kills) - len(landed),
        "sigkill": {
            "kills": len(sigkills),
            "during_checkpoint_write": sum(k.during_write for k in sigkills),
            "steps_lost_max": max((k.steps_lost for k in sigkills), default=0),
            "steps_lost_mean": round(sum(k.steps_lost for k in sigkills) / max(len(sigkills), 1), 2),
            "steps_lost_bound_violations": sum(k.steps_lost > spec.save_every for k in sigkills),
        },
        "sigterm": {
            "kills": len(sigterms),
            "clean_exits": sum(bool(k.clean_exit) for k in sigterms),
            "steps_lost_max": max((k.steps_lost for k in sigterms), default=0),
        },
        "mismatches": sum(bool(t["problems"]) for t in trials),
        "trial_results": trials,
        "kill_records": [asdict(k) for k in kills],
    }


def print_report(report: dict) -> None:
    print(
        f"{'trial':>5} {'signal':>7} {'aim':>5} {'target':>6} {'died at':>7} {'resume':>6} {'lost':>4}  in write"
    )
    for k in report["kill_records"]:
        where = "-" if k["completed_before_kill"] else f"{k['logged_step']:>7}"
        write = ("yes: " + (", ".join(k["partial_files"]) or "empty folder")) if k["during_write"] else "no"
        print(
            f"{k['trial']:>5} {k['signal']:>7} {k['aim']:>5} {k['target']:>6} {where:>7} "
            f"{k['resume_step']:>6} {k['steps_lost']:>4}  {write}"
        )
    sk, st = report["sigkill"], report["sigterm"]
    print(
        f"\ntrials {report['trials']}, kills landed {report['kills_landed']} (missed {report['kills_missed']}); "
        f"SIGKILL {sk['kills']} ({sk['during_checkpoint_write']} during a checkpoint write), steps lost max "
        f"{sk['steps_lost_max']} mean {sk['steps_lost_mean']} (bound: save_every={report['spec']['save_every']}, "
        f"violations {sk['steps_lost_bound_violations']}); SIGTERM {st['kills']} ({st['clean_exits']} clean, "
        f"steps lost max {st['steps_lost_max']}); mismatches {report['mismatches']}"
    )
    for t in report["trial_results"]:
        for p in t["problems"]:
            print(f"trial {t['trial']}: {p}")


def _child(cfg_path: str, prepared: str) -> None:
    """Train ``cfg_path`` on an already prepared folder (docs/architecture.md layout)."""
    from types import SimpleNamespace

    from datasets import load_from_disk
    from transformers import AutoTokenizer

    root = Path(prepared)
    data = SimpleNamespace(
        dataset=load_from_disk(str(root / "dataset")),
        tokenizer=AutoTokenizer.from_pretrained(str(root / "tokenizer")),
        stats=json.loads((root / "stats.json").read_text(encoding="utf-8")),
        path=root,
    )
    raise SystemExit(train_mod.exit_code(train_mod.train(load_config(cfg_path), data)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("runs/fault_drill"))
    p.add_argument(
        "--prepared", type=Path, help="prepared-data folder (default: bert-mp prepare, built-in corpus)"
    )
    p.add_argument("--trials", type=int, default=DrillSpec.trials, help="SIGKILL trials")
    p.add_argument("--kills", type=int, default=DrillSpec.kills, help="SIGKILLs per trial")
    p.add_argument("--sigterm-trials", type=int, default=DrillSpec.sigterm_trials)
    p.add_argument("--steps", type=int, default=DrillSpec.max_steps)
    p.add_argument("--save-every", type=int, default=DrillSpec.save_every)
    p.add_argument("--write-share", type=float, default=DrillSpec.write_share)
    p.add_argument("--seed", type=int, default=DrillSpec.seed)
    p.add_argument("--precision", default=DrillSpec.precision, choices=("fp32", "tf32", "bf16", "fp16"))
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    p.add_argument("--child", nargs=2, metavar=("CONFIG", "PREPARED"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    spec = DrillSpec(
        max_steps=args.steps,
        save_every=args.save_every,
        trials=args.trials,
        kills=args.kills,
        write_share=args.write_share,
        sigterm_trials=args.sigterm_trials,
        seed=args.seed,
        precision=args.precision,
    )
    report = run_drill(args.workdir, spec, args.prepared)
    print_report(report)
    if args.out:
        write_report(report, args.out)
    ok = report["mismatches"] == 0 and report["sigkill"]["steps_lost_bound_violations"] == 0
    return 0 if ok and report["sigterm"]["clean_exits"] == report["sigterm"]["kills"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
