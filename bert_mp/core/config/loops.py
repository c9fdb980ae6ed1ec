"""The training loops' sections: :class:`LoopConfig` (what pretraining and fine-tuning share) and the
``train`` and ``finetune`` sections that extend it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from bert_mp.core.config.checks import _check, _check_tracker, _choice, _range
from bert_mp.core.config.precision_modes import BF16_UPDATES, FP8_RECIPES, PRECISIONS

OPTIMIZERS = ("adamw", "lamb", "sophia", "stable_adamw", "lion")
COMPILE_MODES = (
    "default",
    "reduce-overhead",
    "coordinate-descent",
    "max-autotune",
    "max-autotune-no-cudagraphs",
)
"""``train.compile_mode``: torch.compile's modes, and ``coordinate-descent`` (reduce-overhead plus inductor's
coordinate-descent tuning; ``bert_mp.model.bert.INDUCTOR_MODES``)."""
STRATEGIES = ("auto", "single", "ddp", "fsdp", "deepspeed")


# --------------------------------------------------------------------------------------------------
# what pretraining and fine-tuning share
# --------------------------------------------------------------------------------------------------
@dataclass
class LoopConfig:
    """Precision, optimizer, fp16 guards and checkpoints: the fields of every training loop.

    ``train`` and ``finetune`` both extend it, so ``train.precision`` and ``finetune.precision`` are one
    definition with one validation; a section changes a default by redeclaring the field's value.
    """

    SECTION: ClassVar[str] = "loop"

    output_dir: str = "runs/train"
    """Run folder: config.yaml, metrics.jsonl, summary.json, checkpoints/, final/."""
    precision: str = "fp32"
    """fp32 (strict, TF32 off) | tf32 | bf16 | fp16 (with dynamic loss scaling) | bf16_pure (bf16
    weights, gradients and optimizer states, compensated updates) | fp8 (torchao float8 Linears)."""
    bf16_update: str = "kahan"
    """bf16_pure: how updates reach the bf16 weights: kahan (compensated summation) | stochastic
    (stochastic rounding) | none (round to nearest: small updates vanish; shows the stall)."""
    fp8_recipe: str = "tensorwise"
    """fp8: torchao float8 scaling recipe: tensorwise | rowwise."""
    fp8_convert_heads: bool = False
    """fp8: also convert the MLM decoder and NSP head (off: they stay at the master precision)."""
    layernorm_precision: str = "auto"
    """bf16 / fp16: fp32 (autocast's own LayerNorm: fp32 outputs, so the residual stream between layers
    is fp32) | autocast (the same fp32 math, each output rounded to the autocast dtype: a 16-bit
    residual stream, fewer casts and bytes) | auto (the measured choice per device, docs/gpu.md).
    State-dict keys and the export are the same either way."""
    export_dtype: str = "fp32"
    """Dtype of the exported weights: fp32 (loads anywhere; bf16_pure's bf16 weights are widened) | bf16."""
    optimizer: str = "adamw"
    """adamw (torch) | lamb (pytorch-optimizer Lamb, layer-wise trust ratio) | sophia (pytorch-optimizer
    SophiaH, Hutchinson Hessian estimates) | stable_adamw (torch-optimi) | lion (torch-optimi). Betas are
    adam_beta1/adam_beta2 for every optimizer; biases and LayerNorm weights get no weight decay."""
    sophia_rho: float = 1.0
    """sophia: clip of the preconditioned update m / h (SophiaH's ``p``): no weight moves more than
    learning_rate x sophia_rho in a step."""
    sophia_update_period: int = 10
    """sophia: optimizer steps between Hessian estimates (one extra forward + double backward each)."""
    sophia_hessian_beta: float = 0.99
    """sophia: decay of the Hessian-diagonal moving average."""
    seed: int = 42
    """Seed for weight init, data order and dropout."""
    learning_rate: float = 1e-3
    """Peak learning rate (reached after warmup)."""
    weight_decay: float = 0.01
    """AdamW weight decay; biases and LayerNorm weights get none."""
    adam_beta1: float = 0.9
    """AdamW first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW second-moment decay."""
    adam_epsilon: float = 1e-6
    """AdamW epsilon."""
    fused_adamw: bool = True
    """Use fused AdamW where torch supports it on the device."""
    max_grad_norm: float = 1.0
    """Gradient clipping (0 disables); applied to unscaled gradients."""
    fp16_init_scale: float = 65536.0
    """fp16: initial dynamic loss scale."""
    fp16_growth_interval: int = 2000
    """fp16: overflow-free steps before the loss scale doubles."""
    max_consecutive_skipped_steps: int = 20
    """fp16: stop (after saving) when this many optimizer steps in a row overflow."""
    save_every: int = 0
    """Checkpoint every N optimizer steps (0: only when the run stops)."""
    save_total_limit: int = 2
    """Keep this many most recent checkpoints."""
    resume: Optional[str] = None
    """``latest`` or a checkpoint folder to resume from."""
    overwrite_output_dir: bool = False
    """Start over in an output_dir that already holds a run (its metrics, checkpoints and final/ are
    removed first). Off: such a folder is an error unless the run resumes."""
    progress_bar: bool = True
    """Show a tqdm progress bar on the main process."""
    strategy: str = "auto"
    """The distributed strategy the run must get: auto (whatever the launch gives: one process, DDP,
    FSDP or DeepSpeed from the accelerate config) | single | ddp | fsdp | deepspeed. Anything but auto
    stops the run before any work, naming this key, when the launch gives another. The strategy in
    force is always said in the start-up line and recorded in summary.json (``strategy``)."""

    def validate(self) -> None:
        k = f"{self.SECTION}."
        _choice(self.strategy, k + "strategy", STRATEGIES)
        _choice(self.precision, k + "precision", PRECISIONS)
        _choice(self.bf16_update, k + "bf16_update", BF16_UPDATES)
        _choice(self.fp8_recipe, k + "fp8_recipe", FP8_RECIPES)
        _choice(self.optimizer, k + "optimizer", OPTIMIZERS)
        _choice(self.export_dtype, k + "export_dtype", ("fp32", "bf16"))
        _choice(self.layernorm_precision, k + "layernorm_precision", ("auto", "fp32", "autocast"))
        _check(
            self.layernorm_precision != "autocast" or self.precision in ("bf16", "fp16"),
            k + "layernorm_precision",
            f"autocast rounds LayerNorm outputs to autocast's dtype; {k}precision={self.precision} has no "
            "autocast (use bf16 or fp16, or layernorm_precision=auto)",
            self.layernorm_precision,
        )
        _check(self.sophia_rho > 0, k + "sophia_rho", "must be > 0", self.sophia_rho)
        _range(self.sophia_update_period, k + "sophia_update_period", 1)
        _range(self.sophia_hessian_beta, k + "sophia_hessian_beta", 0.0, 1.0)
        _range(self.seed, k + "seed", 0)
        _check(self.learning_rate > 0, k + "learning_rate", "must be > 0", self.learning_rate)
        _range(self.weight_decay, k + "weight_decay", 0.0)
        _range(self.adam_beta1, k + "adam_beta1", 0.0, 1.0)
        _range(self.adam_beta2, k + "adam_beta2", 0.0, 1.0)
        _check(self.adam_epsilon > 0, k + "adam_epsilon", "must be > 0", self.adam_epsilon)
        _range(self.max_grad_norm, k + "max_grad_norm", 0.0)
        _check(self.fp16_init_scale > 0, k + "fp16_init_scale", "must be > 0", self.fp16_init_scale)
        _range(self.fp16_growth_interval, k + "fp16_growth_interval", 1)
        _range(self.max_consecutive_skipped_steps, k + "max_consecutive_skipped_steps", 1)
        _range(self.save_every, k + "save_every", 0)
        _range(self.save_total_limit, k + "save_total_limit", 1)


# --------------------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------------------
@dataclass
class TrainConfig(LoopConfig):
    """The pretraining loop: batches, schedule, evaluation, logging, callbacks (plus :class:`LoopConfig`)."""

    SECTION: ClassVar[str] = "train"

    seed: int = 42
    """Seed for weight init, data order, dropout and dynamic masking."""
    adam_epsilon: float = 1e-6
    """AdamW epsilon (BERT's pretraining value)."""
    save_every: int = 0
    """Checkpoint every N optimizer steps (0: only at the end of pretraining, on a signal or a numerics
    stop). Each checkpoint is resumable with train.resume and exportable with bert-mp export."""
    max_steps: int = 200
    """Optimizer steps to run."""
    global_batch_size: int = 32
    """Sequences per optimizer step across all ranks and accumulation steps."""
    micro_batch_size: int = 32
    """Sequences per forward pass per rank; accumulation = global / (micro * ranks)."""
    warmup_steps: int = 0
    """Linear warmup from 1/warmup_steps of the peak learning rate."""
    lr_schedule: str = "linear"
    """linear | polynomial | constant (after warmup)."""
    lr_power: float = 1.0
    """Power of the polynomial decay."""
    log_every: int = 10
    """Progress-bar / tracker refresh interval in steps (metrics.jsonl gets every step)."""
    metrics_sync: str = "auto"
    """When the step's loss, counts and gradient norm are read back to the host: step (every step:
    a non-finite loss stops before its optimizer step, state saved) | log (every log_every steps and
    before each evaluation and checkpoint: no device sync inside the step; a non-finite loss stops at
    the next read, the last checkpoint being the last good state) | auto (log on CUDA, step elsewhere)."""
    eval_every: int = 0
    """Evaluate on the validation split every N steps (0: only at the end)."""
    eval_max_batches: Optional[int] = None
    """Cap on validation batches per evaluation (None: the whole split)."""
    callbacks: list[str] = field(default_factory=lambda: ["throughput", "loss", "memory", "loss_scale"])
    """Callbacks by name."""
    log_with: list[str] = field(default_factory=list)
    """Experiment trackers through Accelerate (e.g. tensorboard, wandb)."""
    num_workers: int = -1
    """DataLoader worker processes; -1 (auto): 4 on CUDA (bounded by the CPU count), 0 on CPU."""
    pin_memory: Optional[bool] = None
    """Page-locked host batches for asynchronous copies; None (auto): on CUDA only."""
    compile: str = "none"
    """torch.compile: none | model (the whole forward + loss, in place) | layers (each BertLayer, in
    place); static shapes. Checkpoint keys and the export are the same in every mode."""
    compile_mode: str = "default"
    """With train.compile: torch.compile's mode: default | reduce-overhead (CUDA graphs over the static
    batch shapes) | coordinate-descent (reduce-overhead plus inductor's coordinate-descent search of each
    Triton kernel's launch configuration; a longer compile) | max-autotune (that, plus GEMMs benchmarked
    against Triton templates, with bias / GELU epilogues fused where a template wins; the longest
    compile) | max-autotune-no-cudagraphs. On a CPU the CUDA-graph and Triton parts have no effect.
    Inductor's caches (TORCHINDUCTOR_CACHE_DIR) keep the tuning for the next run. docs/gpu.md has the
    measured ladder."""
    export: bool = True
    """Write final/ with save_pretrained + tokenizer at the end."""
    parity_reference: Optional[str] = None
    """Reference metrics.jsonl for the live parity callback."""
    parity_tolerance: float = 0.1
    """Relative MLM-loss deviation (smoothed) beyond which the parity callback reacts."""
    parity_action: str = "warn"
    """warn | stop when the run leaves the parity band."""
    prepared: list[str] = field(default_factory=list)
    """Prepared data folders (or glob patterns) to train on instead of preparing the data section, e.g.
    the N shares of a split prepare (``data.shard=I/N``): read in share order, their train and
    validation splits concatenated. They must share a tokenizer and every data setting with this
    run's data section (data.shard aside); [] (default): prepare (or reuse) the data section's folder."""
    allow_data_change: bool = False
    """Resume although the prepared data's fingerprint differs from the checkpoint's (e.g. after
    ``bert-mp prepare --force`` retrained the tokenizer). Off: such a resume is refused."""

    def validate(self) -> None:
        super().validate()
        _choice(self.lr_schedule, "train.lr_schedule", ("linear", "polynomial", "constant"))
        _choice(self.parity_action, "train.parity_action", ("warn", "stop"))
        _range(self.max_steps, "train.max_steps", 1)
        _check(self.lr_power > 0, "train.lr_power", "must be > 0", self.lr_power)
        _range(self.micro_batch_size, "train.micro_batch_size", 1)
        _range(self.global_batch_size, "train.global_batch_size", 1)
        _check(
            self.global_batch_size % self.micro_batch_size == 0,
            "train.global_batch_size",
            f"must be a multiple of train.micro_batch_size={self.micro_batch_size}",
            self.global_batch_size,
        )
        _range(self.warmup_steps, "train.warmup_steps", 0)
        _range(self.log_every, "train.log_every", 1)
        _choice(self.metrics_sync, "train.metrics_sync", ("auto", "step", "log"))
        _range(self.eval_every, "train.eval_every", 0)
        _range(self.num_workers, "train.num_workers", -1)
        _choice(self.compile, "train.compile", ("none", "model", "layers"))
        _choice(self.compile_mode, "train.compile_mode", COMPILE_MODES)
        _check(
            self.compile != "none" or self.compile_mode == "default",
            "train.compile_mode",
            "is torch.compile's mode; it needs train.compile=model or layers",
            self.compile_mode,
        )
        _check(
            self.optimizer != "sophia" or self.compile == "none",
            "train.compile",
            "train.optimizer=sophia needs compile=none (its Hessian estimate is a double backward, "
            "which compiled graphs do not support)",
            self.compile,
        )
        _check(self.parity_tolerance > 0, "train.parity_tolerance", "must be > 0", self.parity_tolerance)
        if self.eval_max_batches is not None:
            _range(self.eval_max_batches, "train.eval_max_batches", 1)
        for i, name in enumerate(self.log_with):
            _check_tracker(name, f"train.log_with[{i}]")


# --------------------------------------------------------------------------------------------------
# finetune
# --------------------------------------------------------------------------------------------------
@dataclass
class FinetuneConfig(LoopConfig):
    """Sequence-classification fine-tuning of an exported checkpoint (plus :class:`LoopConfig`)."""

    SECTION: ClassVar[str] = "finetune"

    output_dir: str = "runs/finetune"
    """Run folder: config.yaml, metrics.jsonl, summary.json, checkpoints/ (when saved), final/ (the
    fine-tuned classifier)."""
    seed: int = 42
    """Seed for the classifier head's init (every weight's with init=random), data order and dropout."""
    learning_rate: float = 5e-5
    """Peak learning rate (reached after finetune.warmup_ratio of the steps)."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon (the usual fine-tuning value)."""
    save_every: int = 0
    """Checkpoint every N fine-tuning steps (0: only on a signal or a numerics stop; a completed run
    writes final/ rather than a checkpoint). A checkpoint is resumable with finetune.resume."""
    checkpoint: Optional[str] = None
    """Exported bert_mp folder (a train run folder means its final/), any BERT checkpoint path, or Hub name."""
    init: str = "pretrained"
    """pretrained (load the checkpoint's weights) | random (same architecture, fresh weights: the baseline)."""
    tokenizer: Optional[str] = None
    """Tokenizer path or Hub name (None: the one saved with the checkpoint)."""
    task: str = "builtin-package"
    """builtin-package | builtin-kind (offline, from stdlib docstrings) | local (files) | hub | glue/<name>
    (cola, sst2, mrpc, qqp, stsb - a regression -, mnli, qnli, rte, wnli)."""
    train_file: Optional[str] = None
    """task=local: CSV / JSON Lines / Parquet file with the training examples."""
    validation_file: Optional[str] = None
    """task=local: validation file (None: hold out finetune.validation_fraction of train)."""
    test_file: Optional[str] = None
    """task=local: test file (None: no test metrics)."""
    hub_name: Optional[str] = None
    """task=hub: dataset name for ``datasets.load_dataset``."""
    hub_config: Optional[str] = None
    """task=hub: dataset configuration name."""
    glue_data: Optional[str] = None
    """task=glue/<name>: a local copy of nyu-mll/glue in the Hub's layout
    (<dir>/<task>/<split>-00000-of-00001.parquet); None: read those files from the Hub."""
    train_split: str = "train"
    """task=hub: split used for training."""
    validation_split: Optional[str] = "validation"
    """task=hub: split used for validation (None: hold out finetune.validation_fraction of train)."""
    test_split: Optional[str] = None
    """task=hub: split used for test (None: no test metrics; GLUE test labels are hidden)."""
    text_column: str = "text"
    """Column with the text (set automatically for builtin and glue tasks)."""
    text_pair_column: Optional[str] = None
    """Column with the second text of a pair task (None: single-text task)."""
    label_column: str = "label"
    """Column with the label: strings or integers."""
    validation_fraction: float = 0.1
    """Share of train held out as validation when no validation data is given."""
    unseen_labels: str = "count"
    """Evaluation labels absent from train: count (kept, always wrong, reported) | error (stop)."""
    builtin_min_modules: int = 4
    """builtin-package: a package becomes a class only with at least this many modules (split by module)."""
    builtin_min_examples: int = 100
    """builtin-package: ... and at least this many docstrings."""
    builtin_min_words: int = 3
    """builtin tasks: drop docstrings shorter than this many words (no signal in them)."""
    max_seq_length: int = 128
    """Tokens per example; longer texts are truncated (and counted). At most the model's positions."""
    epochs: int = 3
    """Passes over the training data (unless finetune.max_steps is set)."""
    max_steps: int = 0
    """Optimizer steps to run (0: finetune.epochs decides)."""
    batch_size: int = 32
    """Examples per optimizer step."""
    eval_batch_size: int = 64
    """Examples per evaluation forward pass."""
    warmup_ratio: float = 0.1
    """Linear warm-up over this share of the steps, then linear decay to zero."""
    eval_every: int = 0
    """Evaluate on validation every N steps (0: at the end of every epoch)."""
    select_best: bool = True
    """Test and save the weights of the best validation macro-F1 (False: the last weights)."""
    save_model: bool = True
    """Write final/ (save_pretrained + tokenizer) at the end."""

    def validate(self) -> None:
        super().validate()
        _choice(self.init, "finetune.init", ("pretrained", "random"))
        task_ok = self.task in ("builtin-package", "builtin-kind", "local", "hub") or (
            self.task.startswith("glue/") and len(self.task) > len("glue/")
        )
        _check(
            task_ok,
            "finetune.task",
            "must be builtin-package, builtin-kind, local, hub or glue/<name>",
            self.task,
        )
        if self.task == "local":
            _check(
                bool(self.train_file),
                "finetune.train_file",
                "task=local needs a training file",
                self.train_file,
            )
        if self.task == "hub":
            _check(bool(self.hub_name), "finetune.hub_name", "task=hub needs a dataset name", self.hub_name)
        _choice(self.unseen_labels, "finetune.unseen_labels", ("count", "error"))
        _range(self.validation_fraction, "finetune.validation_fraction", 0.01, 0.5)
        _range(self.builtin_min_modules, "finetune.builtin_min_modules", 3)
        _range(self.builtin_min_examples, "finetune.builtin_min_examples", 1)
        _range(self.builtin_min_words, "finetune.builtin_min_words", 1)
        _range(self.max_seq_length, "finetune.max_seq_length", 8, 8192)
        _range(self.epochs, "finetune.epochs", 1)
        _range(self.max_steps, "finetune.max_steps", 0)
        _range(self.batch_size, "finetune.batch_size", 1)
        _range(self.eval_batch_size, "finetune.eval_batch_size", 1)
        _range(self.warmup_ratio, "finetune.warmup_ratio", 0.0, 1.0)
        _range(self.eval_every, "finetune.eval_every", 0)
