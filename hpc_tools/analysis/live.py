"""A run's straggler verdict and goodput as they stand now, for ``status`` (also while the job runs): the records so
far reduced by ``profiling.figures`` (the same figures ``analyze`` gives) and ``profiling.goodput`` up to now, without
pandas, so that ``status`` stays quick."""

from __future__ import annotations

from typing import Any

from hpc_tools.analysis.inputs import run_input
from profiling import goodput
from profiling.figures import reduce_records


def stragglers_and_goodput(run) -> dict[str, Any]:
    """{stragglers, straggler_nodes, straggler_verdict, goodput: ``Goodput.summary()``} of a run folder."""
    inp = run_input(run)
    lay, recipe = inp.layout, inp.recipe
    world = lay.world_size if lay else int(inp.manifest.get("world_size") or 1)
    reducer = reduce_records(run.records_dir, recipe.profiling.warmup_steps if recipe is not None else 0,
                             recipe.training.train_iters if recipe is not None else None)
    figures = reducer.figures(world, lay.bubble_fraction if lay and lay.pipeline_size > 1 else None)
    g = goodput.measure(run.records_dir, inp.manifest, world, bool(recipe.cluster.uses_gpus) if recipe else False)
    return {"stragglers": figures["stragglers"], "straggler_nodes": figures["straggler_nodes"],
            "straggler_verdict": figures["straggler_verdict"], "goodput": g.summary()}
