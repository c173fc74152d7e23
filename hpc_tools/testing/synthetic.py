"""Synthetic run folders with known step times, written with the real schema (tests and the benchmark).

The folders are real run folders (RunFolder.create, resolved recipe, manifest) whose ``records/rank<R>.parquet``
follow ``profiling.schema`` exactly, so the analysis reads them the way it reads a real run.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpc_tools.recipe.load import dump_resolved, resolve
from hpc_tools.registry import RunFolder, new_run_id

BASE_RECIPE = {
    "name": "synthetic",
    "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64, "vocab_size": 512},
    "training": {"micro_batch_size": 1, "train_iters": 100, "precision": "fp32"},
    "backend": {"kind": "comm_check"},
    "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_type": "cpu", "cpus_per_task": 1, "time_limit": "00:10:00",
                "signal_delay_s": 30},
}


def synthetic_recipe(overrides: list[str] = ()):
    return resolve(BASE_RECIPE, list(overrides), source="synthetic")


def write_rank_parquet(records_dir: Path, rank: int, run_id: str, steps: np.ndarray, step_time_s: np.ndarray,
                       tokens: int, world_size: int, **columns: np.ndarray) -> Path:
    """One rank's records as parquet with every schema field (unmeasured optional fields null)."""
    import pyarrow as pa

    from profiling.records import parquet_path, write_parquet
    from profiling.schema import SCHEMA_VERSION, arrow_schema

    schema = arrow_schema()
    n = steps.size
    known = {
        "schema_version": np.full(n, SCHEMA_VERSION), "run_id": pa.array([run_id] * n),
        "restart": np.zeros(n, np.int64),
        "rank": np.full(n, rank), "node": pa.array([f"node{rank // 8:03d}"] * n), "tp_rank": np.zeros(n, np.int64),
        "pp_rank": np.zeros(n, np.int64), "dp_rank": np.full(n, rank), "step": steps.astype(np.int64),
        "time": 1.7e9 + np.cumsum(step_time_s), "step_time_s": step_time_s, "tokens": np.full(n, tokens, np.int64),
        "tokens_per_s": tokens / step_time_s, "tokens_per_s_per_gpu": tokens / step_time_s / world_size, **columns,
    }
    arrays = [pa.array(known[f.name], type=f.type) if f.name in known else pa.nulls(n, type=f.type) for f in schema]
    path = parquet_path(records_dir, rank)
    write_parquet(pa.Table.from_arrays(arrays, schema=schema), path)
    return path


def synthetic_run(root: Path, overrides: list[str], step_time_s: np.ndarray, state: str = "COMPLETED",
                  **columns: np.ndarray) -> RunFolder:
    """A run folder whose rank r, step s (1-based) took ``step_time_s[r, s-1]`` seconds.

    ``columns`` are extra per-record fields shaped like ``step_time_s`` (e.g. loss, comm_time_s, rss_bytes).
    """
    recipe = synthetic_recipe(overrides)
    ranks, steps = step_time_s.shape
    text = dump_resolved(recipe)
    run = RunFolder.create(Path(root), new_run_id(recipe.name), text, "", {"state": state, "world_size": ranks,
                                                                              "executor": "synthetic"})
    tokens = (recipe.training.global_batch_size or recipe.training.micro_batch_size * ranks) * recipe.model.seq_length
    step_numbers = np.arange(1, steps + 1)
    for r in range(ranks):
        write_rank_parquet(run.records_dir, r, run.run_id, step_numbers, step_time_s[r], tokens, ranks,
                           **{k: v[r] for k, v in columns.items()})
    return run


def amdahl_times(gpus: int, serial: float, t1_s: float, steps: int, noise: float, rng: np.random.Generator,
                 ranks: int | None = None, rank_jitter: float = 0.0) -> np.ndarray:
    """ranks x steps step times following T(n) = t1 (serial + (1-serial)/n).

    ``noise`` is multiplicative and shared by all ranks of a step (a synchronous step ends together on every rank);
    ``rank_jitter`` adds independent per-rank noise on top.
    """
    base = t1_s * (serial + (1 - serial) / gpus)
    shared = 1 + noise * rng.standard_normal(steps)
    own = 1 + rank_jitter * rng.standard_normal((ranks or gpus, steps))
    return base * shared[None, :] * own
