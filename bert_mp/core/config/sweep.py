"""The ``sweep`` section: which axes vary around the base config, and the parity verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from bert_mp.core.config.checks import _check, _choice, _range
from bert_mp.core.config.loops import OPTIMIZERS
from bert_mp.core.config.model import MODEL_PRESETS
from bert_mp.core.config.precision_modes import AMP_PRECISIONS, PRECISIONS

RECIPES: dict[str, tuple[str, ...]] = {
    # MosaicBERT's choice: attention without dropout (torch's varlen flash kernel has none)
    "no_attention_dropout": ("model.attention_probs_dropout_prob=0",),
}
"""``sweep.recipes``: named changes of what is trained, each as the overrides that make it."""


@dataclass
class DownstreamConfig:
    """``sweep.downstream``: every pretraining run's final checkpoint fine-tuned on each task, with
    the sweep's finetune section as the one recipe for every precision."""

    tasks: list[str] = field(default_factory=list)
    """finetune.task values to fine-tune each run's final/ on, after the pretraining runs: builtin-package,
    builtin-kind, glue/<name>, local (the finetune section's files), hub. Empty: no downstream step."""
    seeds: list[int] = field(default_factory=list)
    """finetune.seed values: each task is fine-tuned once per seed from every checkpoint (empty: the
    finetune section's seed)."""

    def validate(self) -> None:
        for i, t in enumerate(self.tasks):
            _check(
                t in ("builtin-package", "builtin-kind", "local", "hub") or t.startswith("glue/"),
                f"sweep.downstream.tasks[{i}]",
                "must be builtin-package, builtin-kind, local, hub or glue/<name> (a finetune.task)",
                t,
            )
        _check(
            len(set(self.tasks)) == len(self.tasks), "sweep.downstream.tasks", "has duplicates", self.tasks
        )
        for i, v in enumerate(self.seeds):
            _range(v, f"sweep.downstream.seeds[{i}]", 0)
        _check(
            len(set(self.seeds)) == len(self.seeds), "sweep.downstream.seeds", "has duplicates", self.seeds
        )


@dataclass
class SweepConfig:
    """Precision sweep: which axes to vary around the base config, and the parity verdict."""

    output_dir: str = "runs/sweep"
    """Sweep folder: sweep.json, base_config.yaml, runs/<name>/, diagnostics/, report.*, plots/."""
    base: Optional[str] = None
    """Base training recipe (e.g. configs/quickstart.yaml); the sweep file's other sections override it."""
    precisions: list[str] = field(default_factory=lambda: list(AMP_PRECISIONS))
    """Precisions to run; fp32 is required (it is the parity reference)."""
    micro_batch_sizes: list[int] = field(default_factory=list)
    """Optional axis: train.micro_batch_size values (empty: the base value)."""
    seq_lengths: list[int] = field(default_factory=list)
    """Optional axis: data.max_seq_length values, each prepared once (empty: the base value)."""
    presets: list[str] = field(default_factory=list)
    """Optional axis: model.preset values (empty: the base value)."""
    optimizers: list[str] = field(default_factory=list)
    """Optional axis: train.optimizer values crossed with the precisions; each optimizer's reduced-precision
    runs are judged against that optimizer's own fp32 runs (empty: the base value)."""
    seeds: list[int] = field(default_factory=list)
    """Optional axis: train.seed values, each with its own fp32 reference (empty: the base value)."""
    recipes: list[str] = field(default_factory=list)
    """Optional runs that change the recipe, not the precision (names from RECIPES, e.g.
    no_attention_dropout): each trains at ``recipe_precision`` and is judged by the verdict against
    the group's fp32 reference, which keeps the base recipe - a recipe change is never silent."""
    recipe_precision: str = "bf16"
    """Precision of the recipe runs; one of ``sweep.precisions``."""
    reference_seed: Optional[int] = None
    """Second seed for the fp32 reference, measuring seed-to-seed spread (None: train.seed + 1)."""
    launcher: str = "auto"
    """How each run is started: python (``python -m bert_mp train``), accelerate (``accelerate launch``), auto."""
    num_processes: int = 1
    """Processes per run for accelerate launch; auto picks accelerate when this is above 1."""
    accelerate_args: list[str] = field(default_factory=list)
    """Extra ``accelerate launch`` arguments, e.g. ["--config_file", "configs/accelerate/x.yaml"]."""
    parity_window: int = 20
    """Steps in the moving average applied to per-step losses before comparing them."""
    warn_multiplier: float = 2.0
    """Deviation above this many times the fp32 seed-to-seed spread turns pass into warn."""
    fail_multiplier: float = 5.0
    """Deviation above this many times the fp32 seed-to-seed spread fails the precision."""
    min_spread: float = 0.005
    """Floor on the relative seed spread, so a nearly deterministic reference cannot fail everything."""
    divergence_rel: float = 0.5
    """Hard fail when the smoothed MLM loss leaves the reference by more than this relative amount."""
    speed_noise: float = 0.15
    """Runs that should be equally fast (a group's two fp32 seeds, a run and its rerun) may differ in
    step time by this relative amount; beyond it no speed-up of the group is quoted."""
    profile_steps: int = 2
    """Profiled forward/backward passes per precision for the kernel check (0: skip diagnostics)."""
    report: bool = True
    """Write the report at the end of the sweep."""
    rerun: list[str] = field(default_factory=list)
    """Runs (by name, e.g. [fp32,bf16]) to train again although they completed earlier, e.g. when
    the report says they were measured under other conditions (threads, machine load)."""
    downstream: DownstreamConfig = field(default_factory=DownstreamConfig)
    """Fine-tune every run's final checkpoint and judge each precision downstream (docs/sweeps.md)."""

    def validate(self) -> None:
        for i, p in enumerate(self.precisions):
            _choice(p, f"sweep.precisions[{i}]", PRECISIONS)
        _check(len(self.precisions) > 0, "sweep.precisions", "needs at least one precision", self.precisions)
        _check(
            len(set(self.precisions)) == len(self.precisions),
            "sweep.precisions",
            "has duplicates",
            self.precisions,
        )
        for i, v in enumerate(self.micro_batch_sizes):
            _range(v, f"sweep.micro_batch_sizes[{i}]", 1)
        for i, v in enumerate(self.seq_lengths):
            _range(v, f"sweep.seq_lengths[{i}]", 8, 512)
        for i, v in enumerate(self.presets):
            _choice(v, f"sweep.presets[{i}]", MODEL_PRESETS)
        for i, v in enumerate(self.optimizers):
            _choice(v, f"sweep.optimizers[{i}]", OPTIMIZERS)
        _check(
            len(set(self.optimizers)) == len(self.optimizers),
            "sweep.optimizers",
            "has duplicates",
            self.optimizers,
        )
        for i, v in enumerate(self.recipes):
            _choice(v, f"sweep.recipes[{i}]", tuple(RECIPES))
        if self.recipes:
            _check(
                self.recipe_precision in self.precisions,
                "sweep.recipe_precision",
                f"must be one of sweep.precisions={self.precisions}",
                self.recipe_precision,
            )
        _choice(self.launcher, "sweep.launcher", ("auto", "python", "accelerate"))
        _range(self.num_processes, "sweep.num_processes", 1)
        _range(self.parity_window, "sweep.parity_window", 1)
        _check(self.warn_multiplier > 0, "sweep.warn_multiplier", "must be > 0", self.warn_multiplier)
        _check(
            self.fail_multiplier >= self.warn_multiplier,
            "sweep.fail_multiplier",
            f"must be >= sweep.warn_multiplier={self.warn_multiplier}",
            self.fail_multiplier,
        )
        _check(self.min_spread > 0, "sweep.min_spread", "must be > 0", self.min_spread)
        _check(self.divergence_rel > 0, "sweep.divergence_rel", "must be > 0", self.divergence_rel)
        _check(self.speed_noise > 0, "sweep.speed_noise", "must be > 0", self.speed_noise)
        _range(self.profile_steps, "sweep.profile_steps", 0)
        if self.reference_seed is not None:
            _range(self.reference_seed, "sweep.reference_seed", 0)
        self.downstream.validate()
