"""A run's straggler verdict and goodput as they stand now, for ``status`` (also while the job runs): the records so
far reduced by ``profiling.figures`` (the same figures ``analyze`` gives) and ``profiling.goodput`` up to now, without
pandas, so that ``status`` stays quick."""

from __future__ import annotations

from typing import Any

from hpc_tools.analysis.inputs import run_input
from profiling import goodput, post_save
from profiling.figures import reduce_records

# The run's figures status shows (``profiling.figures.JOB_FIGURES``, as summary.json and analyze define them).
RUN_FIGURES = ("steps_measured", "warmup_steps", "step_time_median_s", "tokens_per_s", "tokens_per_s_per_gpu",
               "tflops_per_gpu", "mfu", "peak_mem_gb", "peak_mem_kind", "last_loss")


def stragglers_and_goodput(run) -> dict[str, Any]:
    """{figures: the run's ``RUN_FIGURES`` so far, stragglers, straggler_nodes, straggler_verdict, straggler_causes:
    {rank: cause}, goodput: ``Goodput.summary()``, post_save: ``profiling.post_save`` (the steps after each save
    against the steady median)} of a run folder."""
    inp = run_input(run)
    lay, recipe = inp.layout, inp.recipe
    world = lay.world_size if lay else int(inp.manifest.get("world_size") or 1)
    reducer = reduce_records(run.records_dir, recipe.profiling.warmup_steps if recipe is not None else 0,
                             recipe.training.train_iters if recipe is not None else None)
    figures = reducer.figures(world, lay.bubble_fraction if lay and lay.pipeline_size > 1 else None)
    g = goodput.measure(run.records_dir, inp.manifest, world, bool(recipe.cluster.uses_gpus) if recipe else False)
    return {"figures": {k: figures[k] for k in RUN_FIGURES}, "stragglers": figures["stragglers"],
            "straggler_nodes": figures["straggler_nodes"], "straggler_verdict": figures["straggler_verdict"],
            "straggler_causes": {str(r.rank): r.straggler_cause for r in reducer.ranks if r.straggler},
            "goodput": g.summary(),
            "post_save": post_save.measure(run.records_dir, recipe.profiling.warmup_steps if recipe else 0).as_dict()}


def checkpoint_saves(run) -> list[dict[str, Any]]:
    """Every save the run made, oldest first, from the lowest rank's ``checkpoint_save`` events: {iteration, tier,
    async, blocked_s (training stood still), write_s (to the end of the write), verified (committed with its file
    records; false: the save failed or its writer was killed, never `latest`), path, complete (still on disk and
    complete: keep_last prunes older ones)}. Saves recorded before these fields existed read as synchronous saves to
    the shared tier."""
    from pathlib import Path

    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from profiling.records import read_events

    events = read_events(run.records_dir)
    if not events:
        return []
    out = []
    for e in events[min(events)]:
        if e.get("event") != "checkpoint_save":
            continue
        seconds = float(e.get("seconds") or 0.0)
        path = e.get("path")
        out.append({"iteration": e.get("step"), "tier": e.get("tier", "shared"), "async": bool(e.get("async", False)),
                    "blocked_s": float(e.get("blocked_s", seconds)), "write_s": float(e.get("write_s", seconds)),
                    "verified": e.get("verified"), "path": path,
                    "complete": bool(path) and CheckpointDirs.incomplete_reason(Path(path)) is None})
    return out
