"""Learning rate of a (1-based) step: linear warm-up from 0, then cosine / linear / constant decay to min_lr.

A pure function of the step, so the step number is the whole scheduler state a checkpoint needs.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tools.recipe.training import TrainingConfig


def lr_at(step: int, t: "TrainingConfig") -> float:
    """lr for optimizer step ``step`` (1-based): step 1 of a warm-up of W steps uses lr/W, step W uses lr."""
    if t.lr_warmup_iters > 0 and step <= t.lr_warmup_iters:
        return t.lr * step / t.lr_warmup_iters
    decay_iters = t.lr_decay_iters or t.train_iters
    if t.lr_decay_style == "constant" or step >= decay_iters:
        return t.lr if t.lr_decay_style == "constant" else t.min_lr
    span = max(decay_iters - t.lr_warmup_iters, 1)
    progress = (step - t.lr_warmup_iters) / span
    if t.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr + (t.lr - t.min_lr) * factor


def apply_lr(optimizer, lr: float, weight_decay: float) -> None:
    """Set lr and weight decay on every param group, honouring Megatron's per-group lr_mult / wd_mult
    (biases and norms get wd_mult 0)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
