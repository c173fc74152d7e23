"""Per-run, per-rank and per-step tables from reduced records.

Every figure is defined once, in ``profiling.figures`` (its ``DEFINITIONS`` are the report's method section): this
module only lays the reducer's figures out as tables next to what the run folder says about the run (layout, sweep
cell, status).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from hpc_tools.analysis.inputs import RunInput
from hpc_tools.analysis.records import TIMELINES, RunRecords
from profiling import goodput as goodput_mod


def rank_table(rec: RunRecords, run_id: str) -> pd.DataFrame:
    """One row per rank: step-time quantiles, shares, peak memory, slowdown and whether it is a straggler (set by
    ``run_metrics``, which reduces the job's figures: call it first)."""
    df = pd.DataFrame([r.as_dict() for r in rec.ranks])
    if df.empty:
        return df
    df.insert(0, "run_id", run_id)
    return df


def step_table(rec: RunRecords, run_id: str, tokens_per_step: float | None = None) -> pd.DataFrame:
    """One row per recorded step: the slowest rank's step time, the mean training and validation loss over the ranks
    that report them (validation: evaluation steps only, NaN elsewhere and in version-1 records), warm-up, the tokens
    consumed up to the step (``tokens_per_step``: the run's figure) and the timelines over the ranks
    (``records.TIMELINES``: MFU, memory max/min)."""
    red = rec.reducer
    st = red.step_time_max_s
    steps = np.nonzero(~np.isnan(st))[0]
    df = pd.DataFrame({"run_id": run_id, "step": steps, "step_time_s": st[steps], "loss": red.step_losses(steps),
                       "val_loss": red.step_losses(steps, validation=True), "warmup": red.step_warmup[steps],
                       "tokens": steps * tokens_per_step if tokens_per_step else np.nan})
    for name in TIMELINES:
        for col, values in rec.timeline(name, steps).items():
            df[col] = values
    return df


def _health_checks(manifest: dict) -> str:
    """The checks while training in one line (``hpc_tools.runtime.health_verdict.summary_line``), else empty."""
    from hpc_tools.runtime.health_verdict import summary_line

    return summary_line(manifest.get("health")) or ""


def run_metrics(inp: RunInput, rec: RunRecords) -> dict[str, Any]:
    """The one-row summary of a run: what it was, then ``profiling.figures.JOB_FIGURES``."""
    lay, recipe = inp.layout, inp.recipe
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
        "ranks_reporting": rec.source_files,
        "health_checks": _health_checks(inp.manifest),
    }
    row.update({f"param:{k}": v for k, v in inp.params.items()})
    bubble = lay.bubble_fraction if lay and lay.pipeline_size > 1 else None
    figures = rec.reducer.figures(world, bubble)
    # A dict column does not fit a table: the per-stage bubble becomes text ("0: 0.31, 1: 0.21").
    per_stage = figures.pop("bubble_share_per_stage")
    row.update(figures)
    row["bubble_share_per_stage"] = ", ".join(f"{k}: {v:.4g}" for k, v in per_stage.items()) if per_stage else ""
    row["all_to_all_share"] = None
    if figures.get("moe_load_imbalance_median") is not None:  # a mixture-of-experts run: its dispatcher's all-to-all
        from profiling.figures import all_to_all_share, comm_table

        row["all_to_all_share"] = all_to_all_share(comm_table(inp.run.records_dir, rec.warmup_steps),
                                                   figures.get("step_time_median_s"))
    evaluated = np.nonzero(rec.reducer.val_loss_count > 0)[0]  # the last evaluation, by the figures' own mean
    row["last_val_loss"] = float(rec.reducer.step_losses(evaluated[-1:], validation=True)[0]) if evaluated.size \
        else None
    return row


def run_goodput(inp: RunInput) -> goodput_mod.Goodput:
    """The run's goodput and badput buckets (``profiling.goodput``): GPU-hours, or rank-hours for CPU ranks."""
    lay = inp.layout
    world = lay.world_size if lay else int(inp.manifest.get("world_size") or 1)
    gpu = bool(inp.recipe.cluster.uses_gpus) if inp.recipe is not None else False
    return goodput_mod.measure(inp.run.records_dir, inp.manifest, world, gpu)


def goodput_table(inputs: list[RunInput], goodputs: list[goodput_mod.Goodput]) -> pd.DataFrame:
    """One row per run: allocation, goodput, and each bucket's unit-hours and seconds."""
    rows = [{"run_id": inp.run_id, "label": inp.label, **g.summary(), **post_save_columns(inp)}
            for inp, g in zip(inputs, goodputs)]
    return pd.DataFrame(rows)


POST_SAVE_COLUMNS = ("post_save_saves", "post_save_inflated", "post_save_steps", "post_save_max_steps",
                     "post_save_max_ratio", "post_save_extra_s", "post_save_extra_share")


def post_save_columns(inp: RunInput) -> dict[str, Any]:
    """The run's post-save step inflation (``profiling.post_save``) as goodput-table columns: saves, saves followed
    by inflated steps, inflated steps per save (mean, max), the largest step over the steady median, the time beyond
    it (seconds, share of the step time)."""
    from profiling import post_save

    p = post_save.measure(inp.run.records_dir, inp.recipe.profiling.warmup_steps if inp.recipe else 0).as_dict()
    return dict(zip(POST_SAVE_COLUMNS, (p["saves"], p["saves_inflated"], p["mean_steps"], p["max_steps"],
                                        p["max_ratio"], p["extra_s"], p["extra_share"])))


def straggler_table(ranks: pd.DataFrame) -> pd.DataFrame:
    """The named stragglers of every run: rank, node, cause, excess busy time and how sure (see
    ``profiling.stragglers``)."""
    if ranks.empty or "straggler" not in ranks:
        return pd.DataFrame()
    cols = [c for c in STRAGGLER_COLUMNS if c in ranks]
    return ranks.loc[ranks["straggler"].astype(bool), cols].reset_index(drop=True)


STRAGGLER_COLUMNS = ("run_id", "rank", "node", "pp_rank", "straggler_cause", "excess_s", "excess_share",
                     "steps_slower", "steps_compared", "straggler_p", "straggler_z", "step_time_median_s", "late_s",
                     "late_share", "late_unexplained_s", "cpu_excess_s", "switches_excess", "stall_excess_s")
GOODPUT_COLUMNS = ("run_id", "unit", "lives", "allocation_hours", "goodput", "productive_hours", "degraded_hours",
                   "degraded_ratio", "startup_hours",
                   "preflight_hours", "checkpoint_load_hours", "checkpoint_blocked_hours", "recovery_hours",
                   "lost_work_hours", "recomputed_steps", "evaluation_hours", "other_hours", "requeue_wait_s")
