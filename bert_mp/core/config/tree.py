"""The whole tree: every section under one :class:`Config`, and the checks that span sections."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from bert_mp.core.config.checks import _check
from bert_mp.core.config.data import DataConfig
from bert_mp.core.config.glue import GLUE_TASK_NAMES, GlueConfig
from bert_mp.core.config.loops import FinetuneConfig, TrainConfig
from bert_mp.core.config.model import ModelConfig
from bert_mp.core.config.sweep import SweepConfig


@dataclass
class HardwareConfig:
    """What to do where the hardware lacks a precision, and how the CPU treats subnormal floats; read
    by train, finetune and sweep alike."""

    allow_emulated: bool = False
    """Run bf16 / fp16 on a CPU without native support (no AVX512-BF16/AMX, no AVX512-FP16/AMX-FP16)
    through torch's emulation, with a warning: the numerics of the mode at ~15-70x the fp32 matmul
    cost. Off: such a precision is refused (a sweep skips it). No effect on GPUs or native CPUs."""
    flush_denormal: bool = False
    """Flush subnormal floats (below 1.2e-38 in fp32 and bf16) to zero on the CPU, for every precision
    alike: x86 CPUs compute with them tens of times slower, and optimizer states that decay towards
    zero (LAMB, Sophia) fill with them. Strict fp32 is then no longer IEEE 754 below that bound
    (docs/precision.md). Recorded in summary.json's conditions; no effect on GPU kernels."""

    def validate(self) -> None:
        pass


@dataclass
class Config:
    """The whole tree. Every command reads the sections it needs."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    glue: GlueConfig = field(default_factory=GlueConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)

    def validate(self) -> None:
        for f in fields(self):
            getattr(self, f.name).validate()
        for key, task in [("finetune.task", self.finetune.task)] + [
            (f"sweep.downstream.tasks[{i}]", t) for i, t in enumerate(self.sweep.downstream.tasks)
        ]:
            name = task.removeprefix("glue/")
            _check(
                not task.startswith("glue/") or name in GLUE_TASK_NAMES,
                key,
                f"unknown GLUE task {name!r}; choose from {', '.join(GLUE_TASK_NAMES)}",
                task,
            )
        if self.data.pack_pairs:
            _check(
                self.model.unpad,
                "data.pack_pairs",
                "packed rows need the unpadded encoder to keep examples apart; add model.unpad=true",
                self.data.pack_pairs,
            )
        if self.data.mlm_document_attention == "block":
            _check(
                self.model.unpad,
                "data.mlm_document_attention",
                "blocking attention between documents needs the unpadded encoder; add model.unpad=true",
                self.data.mlm_document_attention,
            )
        if self.data.token_budget:
            self._check_token_budget()
        if self.model.attention_kernel == "flash":
            _check(
                self.model.unpad or self.data.token_budget,
                "model.attention_kernel",
                "flash runs torch's varlen flash kernel on sequences without padding: add model.unpad=true "
                "or data.token_budget=true, or use auto / cudnn / efficient",
                self.model.attention_kernel,
            )
            _check(
                self.train.compile == "none" or not self.model.unpad,
                "model.attention_kernel",
                "flash (the varlen kernel) takes the unpadded stream as it is; a compiled run buckets "
                "the stream, which the block route serves: use auto, cudnn or efficient with train.compile",
                self.model.attention_kernel,
            )
        if self.model.attn_implementation == "flash_attention_2":
            _check(
                self.train.precision in ("bf16", "fp16"),
                "model.attn_implementation",
                "flash_attention_2 has kernels for bf16/fp16 only; use sdpa with train.precision="
                f"{self.train.precision}",
                self.model.attn_implementation,
            )

    def _check_token_budget(self) -> None:
        """``data.token_budget`` runs the encoder on its full rows with a block-diagonal mask."""
        _check(
            not self.model.unpad,
            "data.token_budget",
            "fills full rows of one shape, which the encoder runs as they are; model.unpad would "
            "flatten them again: set model.unpad=false",
            self.data.token_budget,
        )
        _check(
            not self.data.pack_pairs,
            "data.token_budget",
            "packs the rows itself; set data.pack_pairs=false",
            self.data.token_budget,
        )
        _check(
            self.model.attn_implementation in ("sdpa", "eager"),
            "data.token_budget",
            "keeps examples apart with a block-diagonal mask, which sdpa and eager take; set "
            "model.attn_implementation=sdpa",
            self.data.token_budget,
        )
