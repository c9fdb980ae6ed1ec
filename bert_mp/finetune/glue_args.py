"""``bert-mp glue``'s arguments and its config, read without torch (the CLI's parser imports this, not
the command): a mistake in them is one line before any library loads."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass
class GlueRequest:
    """The suite's resolved config, and what each task's config is built from again: the recipe file
    and every override (the command line's, then CHECKPOINT, ``--data`` and ``--tasks``)."""

    cfg: Any
    config: str | None
    overrides: list[str]


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "checkpoint",
        help="the pretrained BERT to fine-tune: a folder (a train run means its final/) or a Hub name",
    )
    sp.add_argument(
        "args",
        nargs="*",
        metavar="[CONFIG.yaml] [key=value ...]",
        help="an optional recipe (e.g. configs/glue_bert.yaml) followed by dotted overrides",
    )
    sp.add_argument(
        "--data",
        metavar="DIR",
        help="a local copy of nyu-mll/glue in the Hub's layout (DIR/<task>/<split>-00000-of-00001.parquet); "
        "default: read those files from the Hub",
    )
    sp.add_argument(
        "--tasks", metavar="cola,rte,...", help="the tasks to run, comma-separated (default: glue.tasks)"
    )


def load_request(
    checkpoint: str, config: str | None, overrides: list[str], data: str | None, tasks: str | None
) -> GlueRequest:
    """The config of ``bert-mp glue CHECKPOINT [CONFIG] [--data DIR] [--tasks ...] [key=value ...]``,
    validated (an unknown task name is refused here, naming ``glue.tasks``)."""
    from bert_mp.core.config import load_config

    extra = [f"finetune.checkpoint={checkpoint}"]
    if data:
        extra.append(f"finetune.glue_data={data}")
    if tasks is not None:
        names = [t.strip().lower() for t in tasks.split(",") if t.strip()]
        extra.append(f"glue.tasks=[{','.join(names)}]")
    ovs = [*overrides, *extra]
    return GlueRequest(load_config(config, ovs), config, ovs)
