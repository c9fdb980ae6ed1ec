"""Keep the libraries' own chatter off the console, so a command shows only what bert_mp has to say.

Without ``--debug``: no ``datasets`` / ``huggingface_hub`` / ``transformers`` progress bars (bert_mp
draws its own where a step takes long), no transformers LOAD REPORT or other info and warning
lines (what matters is in ``summary.json``: fine-tuning records the newly initialised weights), and
no profiler start / stop lines from the kineto library (the sweep's kernel check). The settings
are environment variables, so the processes a command starts (sweep runs, ``accelerate launch``
ranks) stay quiet too; a variable the user has set is left as it is.
"""

from __future__ import annotations

import logging
import os
import sys

QUIET_ENV = {
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    # kineto (torch.profiler) prints `USDT: ... profiler_start` at its highest log level, 5
    "KINETO_LOG_LEVEL": "6",
}

# Loggers that speak at import: transformers imports torchao (when installed) for its quantizers,
# and torchao then logs each CUDA-only kernel library it cannot load on this machine and torch
# warns about torchao's Enum registrations. Nothing of it concerns a bert_mp command.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_libraries(debug: bool = False) -> None:
    """Silence the libraries' progress bars and log lines (all of it stays under ``debug``)."""
    if debug:
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # Already imported (a Python caller, or a second command in one process): the settings the
    # libraries read at import time are applied through their own switches.
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
