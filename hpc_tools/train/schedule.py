"""The learning-rate schedule of ``training:`` for every trainer: linear warm-up, then cosine/linear/constant decay to
min_lr. A pure function of the step, so the step number is the whole scheduler state a checkpoint needs."""

from __future__ import annotations

import math

from hpc_tools.recipe.training import TrainingConfig


def lr_at(training: TrainingConfig, step: int) -> float:
    """Learning rate used by optimizer step ``step`` (1-based).

    Warm-up rises linearly to ``lr`` at step ``lr_warmup_iters`` (step 1 already trains, at lr/warmup); the decay then
    runs from ``lr`` to ``min_lr`` over the steps up to ``lr_decay_iters`` (default ``train_iters``) and stays there.
    """
    peak, floor, warmup = training.lr, training.min_lr, training.lr_warmup_iters
    if warmup and step <= warmup:
        return peak * step / warmup
    if training.lr_decay_style == "constant":
        return peak
    decay_end = training.lr_decay_iters or training.train_iters
    span = max(decay_end - warmup, 1)
    progress = min(max((step - warmup) / span, 0.0), 1.0)
    if training.lr_decay_style == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
