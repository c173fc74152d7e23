"""Applying the shared learning-rate schedule (hpc_tools.train.schedule) to Megatron's optimizer param groups."""

from __future__ import annotations


def apply_lr(optimizer, lr: float, weight_decay: float) -> None:
    """Set lr and weight decay on every param group, honouring Megatron's per-group lr_mult / wd_mult
    (biases and norms get wd_mult 0)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
