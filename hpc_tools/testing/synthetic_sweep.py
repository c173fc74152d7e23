"""Synthetic sweep folders for the report's tests and for looking at its plots: a ``sweep.json`` laid out as
``hpc_tools.sweep`` writes it, over run folders from ``synthetic.synthetic_run`` whose records carry plausible
training curves (loss, validation loss at evaluation steps, MFU, memory).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hpc_tools.testing.synthetic import synthetic_run

Times = Callable[[dict, np.random.Generator], np.ndarray]  # cell params, rng -> ranks x steps step times


def curves(ranks: int, steps: int, rng: np.random.Generator, level: float = 1.0, eval_interval: int | None = 10,
           peak_gb: float = 20.0) -> dict[str, np.ndarray]:
    """Per-record columns shaped (ranks, steps): a decaying loss (the same on every rank), validation loss at every
    ``eval_interval``-th step (None: version-1 records, no validation loss), MFU and GPU memory per rank."""
    s = np.arange(1, steps + 1)
    loss = level * (2.0 + 6.0 * np.exp(-s / (steps / 4))) + 0.05 * rng.standard_normal(steps)
    out = {"loss": np.tile(loss, (ranks, 1))}
    if eval_interval:
        val = np.full(steps, np.nan)
        at = s % eval_interval == 0
        val[at] = level * (2.1 + 6.0 * np.exp(-s[at] / (steps / 4))) + 0.02 * rng.standard_normal(at.sum())
        out["val_loss"] = np.tile(val, (ranks, 1))
    out["mfu"] = np.clip(0.38 + 0.02 * rng.standard_normal((ranks, steps)), 0, 1)
    out["tflops_per_gpu"] = out["mfu"] * 989.0
    base = peak_gb * 1e9 * (1 - 0.1 * np.arange(ranks) / max(ranks, 1))[:, None]
    ramp = np.minimum(1.0, 0.6 + s / 10)[None, :]  # allocations grow over the first steps, then hold
    out["mem_allocated_max_bytes"] = np.round(base * ramp).astype(np.int64)  # int64 fields in the schema
    out["mem_reserved_max_bytes"] = np.round(base * ramp * 1.15).astype(np.int64)
    out["rss_bytes"] = (np.full((ranks, steps), 6e9) + 1e7 * s[None, :]).astype(np.int64)
    return out


def synthetic_sweep(root: Path, grid: dict[str, list], times: Times, repeats: int = 1,
                    base_overrides: tuple[str, ...] = (), eval_interval: int | None = 10, seed: int = 0,
                    name: str = "synthetic-sweep") -> Path:
    """A sweep folder under ``root``: one run per grid cell x repeat (cell params as ``--set`` overrides)."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / name
    folder.mkdir(parents=True)
    keys = list(grid)
    cells = []
    for index, values in enumerate(itertools.product(*(grid[k] for k in keys))):
        params = dict(zip(keys, values))
        overrides = [*base_overrides, *(f"{k}={v}" for k, v in params.items())]
        label = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in params.items())
        for repeat in range(repeats):
            st = times(params, rng)
            ranks, steps = st.shape
            run = synthetic_run(folder, overrides, st, **curves(ranks, steps, rng, eval_interval=eval_interval,
                                                                  level=1.0 + 0.03 * index))
            cells.append({"id": f"c{index:03d}-r{repeat}", "cell": index, "repeat": repeat, "label": label,
                          "params": params, "overrides": overrides, "run_dir": run.run_id, "run_id": run.run_id,
                          "job_id": None, "status": "completed", "attempts": []})
    (folder / "sweep.json").write_text(json.dumps({"sweep_id": name, "name": name, "grid": grid, "repeats": repeats,
                                                   "scaling": "auto", "cells": cells}, indent=2))
    return folder
