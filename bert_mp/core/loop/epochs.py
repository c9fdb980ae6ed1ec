"""The order of a split's examples in each epoch, shared by pretraining and fine-tuning."""

from __future__ import annotations

import numpy as np


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of a split's indices for one epoch, a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n)
