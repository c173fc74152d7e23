"""Per-run and per-rank metrics from reduced records.

Definitions (stated once, used by every table and plot):
- step time of a step = the slowest rank's time for it (synchronous training waits for the slowest rank);
  median / p10 / p90 are over the steps after warm-up.
- tokens/s = tokens per step (global batch x sequence length, from the records) / median step time;
  per GPU = that / world size.
- TFLOP/s per GPU = model FLOPs per step (the records' ``model_flops``, under the recipe's flops_convention) /
  median step time / world size / 1e12; MFU = that / the per-GPU peak (the peak the records' own tflops_per_gpu / mfu
  imply, i.e. the device the job ran on; else profiling.peaks for the recipe). Null when the records carry no FLOPs
  (e.g. comm_check) or the peak is unknown (CPU ranks).
- data / communication / bubble shares = sum(part) / sum(step time) over the steps where the part was measured, per
  rank, then the mean over ranks.
- per-rank skew = (slowest - fastest rank median) / median of rank medians; a straggler is a rank whose median step
  time exceeds the median of rank medians by more than STRAGGLER_THRESHOLD (5 %), in runs of 3+ ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from hpc_tools.analysis.inputs import RunInput
from hpc_tools.analysis.records import RunRecords

STRAGGLER_THRESHOLD = 0.05
GB = 1e9


def rank_table(rec: RunRecords, run_id: str) -> pd.DataFrame:
    """One row per rank: quantiles, shares, peak memory, and whether it is a straggler."""
    df = pd.DataFrame([vars(r) for r in rec.ranks])
    if df.empty:
        return df
    df.insert(0, "run_id", run_id)
    med = float(df["step_time_median_s"].median())
    df["slowdown_vs_median"] = df["step_time_median_s"] / med - 1.0 if med > 0 else np.nan
    # With one or two ranks there is no majority to be slower than.
    df["straggler"] = (df["slowdown_vs_median"] > STRAGGLER_THRESHOLD) & (len(df) >= 3)
    df["peak_mem_gb"] = df["peak_mem_bytes"] / GB
    return df


def step_table(rec: RunRecords, run_id: str) -> pd.DataFrame:
    """One row per recorded step: the slowest rank's step time and the mean loss over ranks that report it."""
    st = rec.step_time_max_s
    steps = np.nonzero(~np.isnan(st))[0]
    loss = np.full(steps.size, np.nan)
    if rec.loss_count.size:
        idx = steps[steps < rec.loss_count.size]
        with np.errstate(invalid="ignore", divide="ignore"):
            loss[: idx.size] = np.where(rec.loss_count[idx] > 0, rec.loss_sum[idx] / rec.loss_count[idx], np.nan)
    return pd.DataFrame({"run_id": run_id, "step": steps, "step_time_s": st[steps], "loss": loss,
                         "warmup": steps <= rec.warmup_steps})


def _recipe_peak(recipe) -> float | None:
    """profiling.peaks' dense peak for the recipe's GPU and precision (None on CPU ranks or an unknown GPU)."""
    if recipe is None:
        return None
    import warnings

    from profiling.peaks import peak_for_recipe

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unknown GPU already leaves MFU empty; the table says so
        return peak_for_recipe(recipe)


def _mean_of(df: pd.DataFrame, col: str) -> float | None:
    if df.empty or col not in df or df[col].isna().all():
        return None
    return float(df[col].mean())


def run_metrics(inp: RunInput, rec: RunRecords, ranks: pd.DataFrame) -> dict[str, Any]:
    """The one-row summary of a run (see the module docstring for every definition)."""
    lay, recipe = inp.layout, inp.recipe
    st = rec.step_time_max_s
    after = st[rec.warmup_steps + 1:] if st.size > rec.warmup_steps + 1 else np.empty(0)
    after = after[~np.isnan(after)]
    world = lay.world_size if lay else int(inp.manifest.get("world_size") or max(len(rec.ranks), 1))
    row: dict[str, Any] = {
        "run_id": inp.run_id, "sweep": inp.sweep, "cell": inp.cell, "repeat": inp.repeat, "label": inp.label,
        "status": inp.status or str(inp.manifest.get("state", "")).lower(), "hang": bool(inp.hang_markers),
        "backend": recipe.backend.kind if recipe else inp.manifest.get("backend"),
        "layout": lay.describe() if lay else inp.manifest.get("layout"), "nodes": lay.nodes if lay else None,
        "ranks_per_node": lay.ranks_per_node if lay else None, "world_size": world,
        "tensor_size": lay.tensor_size if lay else None, "pipeline_size": lay.pipeline_size if lay else None,
        "data_size": lay.data_size if lay else None,
        "virtual_pipeline_size": lay.virtual_pipeline_size if lay and lay.interleaved else None,
        "micro_batch_size": lay.micro_batch_size if lay else None,
        "global_batch_size": lay.global_batch_size if lay else None,
        "seq_length": recipe.model.seq_length if recipe else None,
        "ranks_reporting": len(rec.ranks), "steps_measured": int(after.size), "warmup_steps": rec.warmup_steps,
    }
    row.update({f"param:{k}": v for k, v in inp.params.items()})
    if after.size:
        p10, p50, p90 = np.percentile(after, (10, 50, 90))
        row.update(step_time_median_s=float(p50), step_time_p10_s=float(p10), step_time_p90_s=float(p90),
                   step_time_mean_s=float(after.mean()))
    else:
        row.update(step_time_median_s=None, step_time_p10_s=None, step_time_p90_s=None, step_time_mean_s=None)
    med = row["step_time_median_s"]
    tokens = rec.tokens_per_step
    row["tokens_per_step"] = tokens
    row["tokens_per_s"] = tokens / med if tokens and med else None
    row["tokens_per_s_per_gpu"] = row["tokens_per_s"] / world if row["tokens_per_s"] else None
    flops = rec.model_flops_per_step
    row["tflops_per_gpu"] = flops / med / world / 1e12 if flops and med else None
    peak = rec.peak_tflops or _recipe_peak(recipe)
    row["peak_tflops_per_gpu"] = peak
    row["mfu"] = row["tflops_per_gpu"] / peak if row["tflops_per_gpu"] and peak else None
    mem = ranks["peak_mem_bytes"].max() if not ranks.empty and ranks["peak_mem_bytes"].notna().any() else None
    row["peak_mem_gb"] = float(mem) / GB if mem is not None else None
    row["peak_mem_kind"] = next((r.mem_kind for r in rec.ranks if r.mem_kind), None)
    row["bubble_measured"] = _mean_of(ranks, "bubble_share")
    row["bubble_theory"] = lay.bubble_fraction if lay else None
    row["comm_share"] = _mean_of(ranks, "comm_share")
    row["data_share"] = _mean_of(ranks, "data_share")
    if not ranks.empty:
        meds = ranks["step_time_median_s"]
        centre = float(meds.median())
        row["rank_skew"] = float((meds.max() - meds.min()) / centre) if centre > 0 else None
        row["slowest_rank"] = int(ranks.loc[meds.idxmax(), "rank"])
        row["stragglers"] = ",".join(str(int(r)) for r in ranks.loc[ranks["straggler"], "rank"]) or ""
    else:
        row.update(rank_skew=None, slowest_rank=None, stragglers="")
    return row
