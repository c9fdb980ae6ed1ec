"""``bert-mp sweep``: train one recipe under several precisions and write the parity report.

A sweep file is a recipe whose ``sweep:`` section names a base recipe (``sweep.base``) and the axes;
its other sections override the base, and CLI overrides override both. Every run is its own process
(``python -m bert_mp train`` or ``accelerate launch``) with the same seed, so initial weights, data
order and masking are identical across precisions and the differences are the precision's alone.
fp32 also runs with a second seed to measure the natural seed-to-seed spread the verdict is judged
against. The sweep resumes: completed (or failed) runs are kept, interrupted ones resume from their
latest checkpoint.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from bert_mp.core.config import (
    RECIPES,
    Config,
    config_from_layers,
    config_to_dict,
    load_config,
    load_yaml,
    save_config,
)
from bert_mp.core.process.run_dir import changed_since, describe_changes, hold_folder, read_status
from bert_mp.core.process.spawn import accelerate_launch, launcher_env
from bert_mp.core.storage.files import atomic_write_json
from bert_mp.errors import ConfigError, HardwareError
from bert_mp.sweep.record import (
    BASE_CONFIG,
    FINAL_STATUSES,
    DownstreamEntry,
    GroupEntry,
    HostInfo,
    RunEntry,
    RunSummary,
    SweepRecord,
    record_outcome,
)


# --------------------------------------------------------------------------------------------------
# config: base recipe <- sweep file <- CLI overrides
# --------------------------------------------------------------------------------------------------
def _find_base(base: str, sweep_file: Path | None) -> Path:
    """``sweep.base`` as given (relative to the working directory), else relative to the sweep file."""
    p = Path(base)
    candidates = [p]
    if sweep_file is not None and not p.is_absolute():
        candidates += [sweep_file.parent / p, sweep_file.parent.parent / p]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(
        f"sweep.base: base recipe {base!r} not found (looked at {', '.join(map(str, candidates))})"
    )


def load_sweep_config(
    path: str | Path | None, overrides: list[str] | None = None
) -> tuple[Config, Path | None]:
    """The resolved sweep config and the base recipe path, with load_config's strict validation."""
    overrides = list(overrides or [])
    sweep_file = Path(path) if path is not None else None
    sweep_yaml = load_yaml(sweep_file) if sweep_file is not None else OmegaConf.create({})
    base = next((o.split("=", 1)[1] for o in overrides if o.startswith("sweep.base=")), None)
    if base is None:
        base = OmegaConf.select(sweep_yaml, "sweep.base", default=None)
    base_path = _find_base(str(base), sweep_file) if base not in (None, "", "null") else None
    layers = [load_yaml(base_path)] if base_path is not None else []
    cfg = config_from_layers([*layers, sweep_yaml], overrides)
    if "fp32" not in cfg.sweep.precisions:
        raise ConfigError(
            f"sweep.precisions: must include fp32, the reference every verdict compares to (got {cfg.sweep.precisions})"
        )
    if cfg.sweep.downstream.tasks and not cfg.train.export:
        raise ConfigError(
            "sweep.downstream: fine-tunes each run's final/ checkpoint, which train.export=false does not "
            "write; set train.export=true (or drop sweep.downstream.tasks)"
        )
    return cfg, base_path


# --------------------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------------------
@dataclass
class GroupPlan:
    """One group of the plan: its axes, the overrides that set them, and its runs."""

    name: str
    axes: dict[str, Any]
    overrides: list[str]
    runs: list[RunEntry] = field(default_factory=list)


_AXES = (
    ("presets", "model.preset", "", lambda c: c.model.preset),
    ("seq_lengths", "data.max_seq_length", "seq", lambda c: c.data.max_seq_length),
    ("micro_batch_sizes", "train.micro_batch_size", "mb", lambda c: c.train.micro_batch_size),
    ("seeds", "train.seed", "s", lambda c: c.train.seed),
    # each optimizer is its own group, so its reduced-precision runs are judged against its own fp32
    ("optimizers", "train.optimizer", "", lambda c: c.train.optimizer),
)


def plan_sweep(cfg: Config) -> list[GroupPlan]:
    """Groups (one per combination of the non-precision axes) and their runs, fp32 first."""
    sc = cfg.sweep
    listed = [(name, key, tag, getattr(sc, name) or [get(cfg)]) for name, key, tag, get in _AXES]
    varied = [(name, key, tag, vals) for name, key, tag, vals in listed if getattr(sc, name)]
    groups = []
    for combo in itertools.product(*[vals for *_, vals in varied]):
        axes = {key: v for (_, key, _, _), v in zip(varied, combo)}
        gname = "-".join(f"{tag}{v}" for (_, _, tag, _), v in zip(varied, combo)) or "default"
        seed = int(axes.get("train.seed", cfg.train.seed))
        ref_seed = sc.reference_seed if sc.reference_seed is not None else seed + 1
        if ref_seed == seed:
            raise ConfigError(f"sweep.reference_seed: must differ from train.seed={seed} (got {ref_seed})")
        g = GroupPlan(gname, axes, [f"{k}={v}" for k, v in axes.items()])
        prefix = "" if gname == "default" else f"{gname}/"
        order = ["fp32"] + [p for p in sc.precisions if p != "fp32"]
        for p in order:
            role = "reference" if p == "fp32" else "candidate"
            g.runs.append(RunEntry(p, gname, p, role, seed, [f"train.precision={p}"], f"runs/{prefix}{p}"))
            if p == "fp32":
                name = f"fp32-seed{ref_seed}"
                g.runs.append(
                    RunEntry(
                        name,
                        gname,
                        "fp32",
                        "seed_spread",
                        ref_seed,
                        ["train.precision=fp32", f"train.seed={ref_seed}"],
                        f"runs/{prefix}{name}",
                    )
                )
        for recipe in sc.recipes:  # judged against the fp32 reference of the base recipe
            p, name = sc.recipe_precision, f"{sc.recipe_precision}+{recipe}"
            overrides = [f"train.precision={p}", *RECIPES[recipe]]
            g.runs.append(RunEntry(name, gname, p, "recipe", seed, overrides, f"runs/{prefix}{name}"))
        groups.append(g)
    return groups


def run_config(
    base_file: Path, group: GroupPlan, run: RunEntry, root: Path, extra: list[str] = ()
) -> tuple[Config, list[str]]:
    """The validated config of one run and the overrides that produce it from the base file."""
    ovs = [*group.overrides, *run.overrides, f"train.output_dir={root / run.dir}", *extra]
    return load_config(base_file, ovs), ovs


def launch_command(
    cfg: Config, config_file: Path, overrides: list[str], cuda: bool, command: str = "train"
) -> list[str]:
    """The command line of one run: ``python -m bert_mp train`` or ``accelerate launch -m bert_mp train``
    (``command``: ``finetune`` for a fine-tune of ``sweep.downstream``)."""
    sc = cfg.sweep
    use_accelerate = sc.launcher == "accelerate" or (sc.launcher == "auto" and sc.num_processes > 1)
    train = ["bert_mp", command, str(config_file), *overrides]
    if not use_accelerate:
        return [sys.executable, "-m", *train]
    return [*accelerate_launch(sc.num_processes, cuda=cuda, extra=sc.accelerate_args), "-m", *train]


# --------------------------------------------------------------------------------------------------
# execution
# --------------------------------------------------------------------------------------------------
def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_action(run_dir: Path) -> str:
    """``keep`` a finished run, ``resume`` an interrupted one (from its latest checkpoint, or from
    scratch when it saved none), or start it ``fresh``. A completed run whose newest checkpoint or
    export no longer verifies is resumed too, from its newest checkpoint that does."""
    from bert_mp.core.checkpoint.store import damaged_outputs

    status = read_status(run_dir)
    if status in FINAL_STATUSES:
        return "resume" if status == "completed" and damaged_outputs(run_dir) else "keep"
    return "resume" if run_dir.exists() else "fresh"


def rerun_asked(run: RunEntry, names: list[str]) -> bool:
    """Whether ``sweep.rerun`` names this run (its name, or its folder under runs/)."""
    return run.name in names or Path(run.dir).name in names or run.dir.removeprefix("runs/") in names


def _last_error(log_path: Path) -> str:
    lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines() if log_path.is_file() else []
    errors = [ln for ln in lines if "error:" in ln.lower() or "Error" in ln]
    return (errors[-1] if errors else (lines[-1] if lines else "no output")).strip()[:500]


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's ended, waited-for children (and theirs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


start_run = subprocess.Popen
"""How a run's process starts (the test suite forks runs from a server that imported the libraries
once: tests/forkserver.py, which also counts their CPU seconds in :func:`children_cpu_seconds`)."""
children_cpu_seconds = _children_cpu_seconds


def run_process(cmd: list[str], run_dir: Path) -> tuple[int, float, float]:
    """One run's process, its output appended to ``<run_dir>/launch.log``: its exit code, wall seconds
    and CPU seconds. Interrupted, it passes SIGTERM on so the run saves and stops (a later sweep
    resumes it) before the interruption goes on."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "launch.log"
    env = {
        **launcher_env(os.environ),
        "TOKENIZERS_PARALLELISM": "false",
    }  # ranks get time to save on a signal
    t0 = time.perf_counter()
    cpu0 = children_cpu_seconds()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = start_run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            returncode = proc.wait()
        except BaseException:
            # Interrupted (Ctrl-C, or SIGTERM turned into SystemExit below): let the run save a
            # checkpoint and stop, so the next `bert-mp sweep` resumes it instead of starting over.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    # CPU seconds of the run's processes: on a shared machine a steadier cost figure than wall time
    return returncode, time.perf_counter() - t0, children_cpu_seconds() - cpu0


def _execute(run: RunEntry, cmd: list[str], run_dir: Path) -> None:
    run.returncode, run.wall_s, run.cpu_s = run_process(cmd, run_dir)
    record_outcome(run, RunSummary.load(run_dir), _last_error(run_dir / "launch.log"))


def measurement(run_dir: Path) -> dict[str, Any]:
    """A completed run's speed and conditions, kept when ``sweep.rerun`` trains it again."""
    summary = RunSummary.load(run_dir)
    thr = (summary.throughput if summary else None) or {}
    return {
        "step_ms": thr.get("step_ms"),
        "tokens_per_sec": thr.get("tokens_per_sec"),
        "conditions": summary.conditions if summary else None,
    }


def load_line(run_dir: Path) -> str | None:
    """What other work a finished run met, where it met some (its start-up warning, measured)."""
    from bert_mp.sweep.fairness import is_busy
    from bert_mp.sweep.speed import others

    summary = RunSummary.load(run_dir)
    cond = summary.conditions if summary else None
    if not cond or not is_busy(cond):
        return None
    return f"warning: {others(cond)} while it ran: its timings do not compare with an idle machine's"


class Sweep:
    """A sweep folder being filled: the plan, the manifest, and the run processes."""

    def __init__(self, cfg: Config, base_path: Path | None, sweep_file: Path | None):
        self.cfg = cfg
        self.root = Path(cfg.sweep.output_dir)
        self.base_path = base_path
        self.sweep_file = sweep_file
        self.groups = plan_sweep(cfg)
        self.dimension_flags: dict[str, list[str]] = {}
        self.device: Any = None
        """The device the runs train on (set when the sweep runs)."""
        self.downstream: list[DownstreamEntry] = []
        """The fine-tunes of ``sweep.downstream`` (:mod:`bert_mp.sweep.downstream`), as they went."""

    def record(self) -> SweepRecord:
        """sweep.json as it stands: the plan and how far each run got."""
        sc = self.cfg.sweep
        auto = "accelerate" if sc.num_processes > 1 else "python"
        return SweepRecord(
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            sweep_file=str(self.sweep_file) if self.sweep_file else None,
            base=str(self.base_path) if self.base_path else None,
            launcher=sc.launcher if sc.launcher != "auto" else auto,
            host=HostInfo(
                f"{platform.system()} {platform.machine()}, {os.cpu_count()} logical CPUs", sys.executable
            ),
            config=config_to_dict(self.cfg),
            groups=[GroupEntry(g.name, g.axes) for g in self.groups],
            runs=[r for g in self.groups for r in g.runs],
            dimension_flags=self.dimension_flags,
            downstream=self.downstream,
        )

    def write_manifest(self) -> None:
        self.record().write(self.root)

    def run(self) -> None:
        from bert_mp.core.numerics.precision import resolve_precision

        self.check_rerun()
        self.root.mkdir(parents=True, exist_ok=True)
        base_file = self.root / BASE_CONFIG
        save_config(self.cfg, base_file)
        device = _device()
        # Every run's config is validated before anything trains.
        configs = {
            (g.name, r.name): run_config(base_file, g, r, self.root) for g in self.groups for r in g.runs
        }
        self._prepare_data([c for c, _ in configs.values()])
        available: dict[str, str | None] = {}
        for p in {r.precision for g in self.groups for r in g.runs}:
            try:
                resolve_precision(p, device, allow_emulated=self.cfg.hardware.allow_emulated)
                available[p] = None
            except HardwareError as e:
                available[p] = str(e)
        self._carry_earlier_measurements()
        self.write_manifest()
        total = sum(len(g.runs) for g in self.groups)
        skipped_first: dict[str, str] = {}
        i = 0
        for g in self.groups:
            for r in g.runs:
                i += 1
                label = f"[{i}/{total}] {r.dir}"
                if available[r.precision] is not None:
                    r.status, r.reason = "skipped", available[r.precision]
                    first = skipped_first.setdefault(r.reason, r.dir)  # a reason is said once
                    why = r.reason if first == r.dir else f"as {first}"
                    print(f"bert-mp sweep: {label}: skipped: {why}", flush=True)
                else:
                    run_cfg, ovs = configs[(g.name, r.name)]
                    self._run_one(r, label, run_cfg, [str(base_file), *ovs], device)
                self.write_manifest()
        if self.cfg.sweep.downstream.tasks:  # every run's final checkpoint fine-tuned and judged
            from bert_mp.sweep.downstream import run_downstream

            self.device = device
            run_downstream(self, base_file)
        if self.cfg.sweep.profile_steps > 0:
            self._diagnostics(configs, available, device)
        self.write_manifest()

    def _run_one(self, r: RunEntry, label: str, run_cfg: Config, args: list[str], device: Any) -> None:
        """Keep, resume, or train one run (``args``: its base config file and overrides)."""
        from bert_mp.core.checkpoint.store import damaged_outputs

        run_dir = self.root / r.dir
        action = run_action(run_dir)
        changed = changed_since(run_dir, run_cfg, "train") if action != "fresh" else {}
        if changed:
            # keyed by its resolved config: an earlier run of another config is not this run
            r.earlier = []
            print(
                f"bert-mp sweep: {label}: config changed since the earlier run "
                f"({describe_changes(changed)}); training it again",
                flush=True,
            )
            action = "again"
        if action == "keep" and self.cfg.sweep.rerun and rerun_asked(r, self.cfg.sweep.rerun):
            print(f"bert-mp sweep: {label}: completed earlier, training it again (sweep.rerun)", flush=True)
            action = "again"
            r.earlier.append(measurement(run_dir))  # the report compares the two
        if action == "keep":
            prev = RunSummary.load(run_dir)
            r.status, r.reason = prev.status, prev.error
            print(f"bert-mp sweep: {label}: {r.status} earlier, kept", flush=True)
            return
        r.resumed = action == "resume"
        if r.resumed and read_status(run_dir) == "completed":
            print(
                f"bert-mp sweep: {label}: completed earlier, but {damaged_outputs(run_dir)}; resuming it from "
                "its newest checkpoint that verifies",
                flush=True,
            )
        extra = {"resume": ["train.resume=latest"], "again": ["train.overwrite_output_dir=true"]}
        base_file, *ovs = args
        cmd = launch_command(self.cfg, Path(base_file), [*ovs, *extra.get(action, [])], device.type == "cuda")
        print(f"bert-mp sweep: {label}: {'resuming' if r.resumed else 'training'} ...", flush=True)
        _execute(r, cmd, run_dir)
        tail = f" ({r.reason})" if r.reason else ""
        print(
            f"bert-mp sweep: {label}: {r.status} in {r.wall_s:.0f}s ({r.cpu_s:.0f} CPU s){tail}", flush=True
        )
        loaded = load_line(run_dir)
        if loaded:
            print(f"bert-mp sweep: {label}: {loaded}", flush=True)

    def execute(self, command: str, overrides: list[str], folder: Path) -> tuple[int, float, float, str]:
        """A ``bert-mp <command>`` process of this sweep (its base config and ``overrides``) writing
        ``folder``: exit code, wall and CPU seconds, and the last error line of its launch.log."""
        base_file = self.root / BASE_CONFIG
        cmd = launch_command(self.cfg, base_file, overrides, self.device.type == "cuda", command)
        returncode, wall_s, cpu_s = run_process(cmd, folder)
        return returncode, wall_s, cpu_s, _last_error(folder / "launch.log")

    def _carry_earlier_measurements(self) -> None:
        """The measurements ``sweep.rerun`` replaced in earlier invocations, from the sweep.json there is."""
        try:
            before = {r.dir: r.earlier for r in SweepRecord.load(self.root).runs}
        except (ConfigError, OSError, ValueError):  # none yet, or written by another version
            return
        for g in self.groups:
            for r in g.runs:
                r.earlier = list(before.get(r.dir, []))

    def check_rerun(self) -> None:
        """``sweep.rerun`` names only runs of this sweep (before any work)."""
        runs = [r for g in self.groups for r in g.runs]
        unknown = [n for n in self.cfg.sweep.rerun if not any(rerun_asked(r, [n]) for r in runs)]
        if unknown:
            raise ConfigError(
                f"sweep.rerun: no run named {', '.join(unknown)} in this sweep; its runs are "
                + ", ".join(Path(r.dir).name for r in runs)
            )

    def _prepare_data(self, cfgs: list[Config]) -> None:
        """Prepare each distinct data config once, here, so the runs only read the shared cache."""
        from bert_mp.data.prepare import prepare

        seen = set()
        for c in cfgs:
            key = c.data.cache_key()
            if key not in seen:
                seen.add(key)
                print(f"bert-mp sweep: data {key} (seq {c.data.max_seq_length}) ...", flush=True)
                prepare(c)

    def _diagnostics(self, configs: dict, available: dict[str, str | None], device: Any) -> None:
        """Per group and precision: measured parameter/activation bytes and the kernel check."""
        import torch
        from transformers import BertForPreTraining

        from bert_mp.core.numerics.precision import resolve_precision
        from bert_mp.data.prepare import prepare
        from bert_mp.model.bert import PretrainingModel, bert_config, static_mask_cap
        from bert_mp.sweep.diagnostics import (
            dimension_flags,
            model_dimensions,
            probe_precision,
            synthetic_batch,
        )

        for g in self.groups:
            ref = next(r for r in g.runs if r.role == "reference")
            cfg, _ = configs[(g.name, ref.name)]
            stats = json.loads((Path(prepare(cfg)) / "stats.json").read_text(encoding="utf-8"))
            bcfg = bert_config(cfg.model, int(stats["model_vocab_size"]))
            mb, seq = cfg.train.micro_batch_size, cfg.data.max_seq_length
            self.dimension_flags[g.name] = dimension_flags(model_dimensions(bcfg, mb, seq))
            for r in g.runs:
                out = self.root / "diagnostics" / g.name / f"{r.precision}.json"
                if r.role == "seed_spread" or available[r.precision] is not None or out.is_file():
                    continue
                print(f"bert-mp sweep: profiling {g.name}/{r.precision} ...", flush=True)
                torch.manual_seed(cfg.train.seed)
                model = PretrainingModel(
                    BertForPreTraining(bcfg),
                    cfg.model.sparse_mlm_head,
                    max_predictions_per_seq=static_mask_cap(cfg.data, device),
                ).to(device)
                model.model.set_attn_implementation(cfg.model.attn_implementation)
                batch = synthetic_batch(
                    bcfg.vocab_size,
                    mb,
                    seq,
                    device,
                    seed=cfg.train.seed,
                    max_predictions=cfg.data.max_predictions(),
                )
                run_cfg = configs[(g.name, r.name)][0]
                plan = resolve_precision(
                    r.precision,
                    device,
                    allow_emulated=cfg.hardware.allow_emulated,
                    bf16_update=run_cfg.train.bf16_update,
                    fp8_recipe=run_cfg.train.fp8_recipe,
                    fp8_convert_heads=run_cfg.train.fp8_convert_heads,
                    layernorm=run_cfg.train.layernorm_precision,
                )
                result = probe_precision(
                    model, batch, plan, steps=self.cfg.sweep.profile_steps, loop_cfg=run_cfg.train
                )
                result["batch"] = {"micro_batch_size": mb, "seq_length": seq, "synthetic": True}
                atomic_write_json(out, result)
                del model, batch
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def command(config_path: str | None, overrides: list[str]) -> int:
    """CLI entry: ``bert-mp sweep CONFIG.yaml [key=value ...]``."""
    cfg, base_path = load_sweep_config(config_path, overrides)
    sweep = Sweep(cfg, base_path, Path(config_path) if config_path else None)
    # one sweep per folder (each run's `bert-mp train` holds its own folder under runs/ besides)
    with hold_folder(cfg.sweep.output_dir, "sweep.output_dir", "sweep"):
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            sweep.run()
        finally:
            signal.signal(signal.SIGTERM, previous)
        return _finish(cfg, sweep.root)


def _finish(cfg: Config, root: Path) -> int:
    """The report of a finished sweep (unless ``sweep.report=false``) and its verdict lines."""
    from bert_mp.sweep import report

    if not cfg.sweep.report:
        print(f"bert-mp sweep: done -> {root} (report disabled; `bert-mp report {root}` writes it)")
        return 0
    summary = report.build_report(root)
    print(f"bert-mp sweep: report -> {root / 'report.md'} and {root / 'report.html'}")
    for line in report.verdict_lines(summary, skips_shown=True):
        print(line)
    return 0
