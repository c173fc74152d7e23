"""Seconds of one collective over a bus bandwidth, with the nccl-tests bus factors: all-reduce 2(n-1)/n,
all-gather / reduce-scatter (n-1)/n of the full buffer. Shared by the step-time model (``steptime``) and the sharding
schemes' data-parallel traffic (``sharding``)."""

from __future__ import annotations


def allreduce_s(nbytes: float, n: int, bw: float) -> float:
    """All-reduce of a ``nbytes`` buffer over ``n`` ranks at bus bandwidth ``bw`` (bytes/s)."""
    return nbytes * 2 * (n - 1) / n / bw if n > 1 else 0.0


def gather_s(nbytes: float, n: int, bw: float) -> float:
    """All-gather or reduce-scatter of a ``nbytes`` buffer (the full, unsharded size)."""
    return nbytes * (n - 1) / n / bw if n > 1 else 0.0
