"""``bert-mp predict``'s arguments, apart from the command so that building the CLI's parser (every
command, ``--help`` included) imports neither the task code nor ``datasets``."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments (the CLI's subparser gets them from here)."""
    p.add_argument(
        "model", help="a fine-tuned folder (bert-mp finetune's final/, or its run folder) or Hub name"
    )
    p.add_argument("file", help="CSV / TSV / JSON Lines / Parquet file")
    p.add_argument("--out", default=None, help="output folder (default: <file>.predictions/)")
    own = " (default: the one the model was fine-tuned with, else %s)"
    p.add_argument("--text-column", default=None, help="text column" + own % "text")
    p.add_argument("--text-pair-column", default=None, help="second text of a pair task" + own % "none")
    p.add_argument(
        "--label-column", default=None, help="gold labels: metrics are computed" + own % "label, if present"
    )
    p.add_argument(
        "--max-seq-length",
        type=int,
        default=None,
        help="tokens per input, longer ones cut (default: the fine-tuning length, else the tokenizer's limit)",
    )
    p.add_argument("--batch-size", type=int, default=64)
