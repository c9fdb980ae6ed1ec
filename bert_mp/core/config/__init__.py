"""One typed config tree for every bert_mp command.

Defaults live in the section dataclasses; a YAML recipe from ``configs/`` is merged on top, and dotted
CLI overrides (``train.micro_batch_size=64``) on top of that (OmegaConf structured configs do the
merging and type checking). Unknown keys and bad values fail before any work starts, with a message
naming the key. Each section owns a ``validate()`` that checks ranges and choices.

The modules, by concern: :mod:`.checks` (the checks ``validate()`` uses), :mod:`.data`
(``DataConfig``), :mod:`.glue` (``GlueConfig``), :mod:`.model` (``ModelConfig``), :mod:`.loops` (``LoopConfig`` and the ``train`` and
``finetune`` sections that extend it), :mod:`.sweep` (``SweepConfig``), :mod:`.tree` (``Config``, the
whole tree, and ``HardwareConfig``) and :mod:`.load` (YAML and overrides in, YAML out). Import the
names from here.
"""

from __future__ import annotations

from bert_mp.core.config.data import DOCUMENT_MODES, OBJECTIVES, DataConfig
from bert_mp.core.config.glue import GLUE_SUITE, GLUE_TASK_NAMES, GlueConfig
from bert_mp.core.config.load import config_from_layers, config_to_dict, load_config, load_yaml, save_config
from bert_mp.core.config.loops import OPTIMIZERS, FinetuneConfig, LoopConfig, TrainConfig
from bert_mp.core.config.model import MODEL_PRESETS, ModelConfig
from bert_mp.core.config.sweep import RECIPES, DownstreamConfig, SweepConfig
from bert_mp.core.config.tree import Config, HardwareConfig

__all__ = [
    "DOCUMENT_MODES",
    "GLUE_SUITE",
    "GLUE_TASK_NAMES",
    "MODEL_PRESETS",
    "OBJECTIVES",
    "OPTIMIZERS",
    "RECIPES",
    "Config",
    "DataConfig",
    "DownstreamConfig",
    "FinetuneConfig",
    "GlueConfig",
    "HardwareConfig",
    "LoopConfig",
    "ModelConfig",
    "SweepConfig",
    "TrainConfig",
    "config_from_layers",
    "config_to_dict",
    "load_config",
    "load_yaml",
    "save_config",
]
