"""The rank side of elastic training (``cluster.min_nodes``): train in the layout planned for the step's node count,
and record each layout the run trains in.

A step the restart controller started on fewer nodes than ``cluster.nodes`` (``hpc_tools.job.restarts``) has fewer
ranks than the recipe's layout. ``for_world`` then reads the run folder's ``elastic.json`` (``hpc_tools.planner
.elastic``: node count -> ``--set`` overrides of the layout the planner chose for it) and returns the run's recipe
with that count's overrides applied: every rank applies the same overrides to the same recipe, so all agree on the
layout; the checkpoint loader reshards the newest checkpoint into it. ``note`` (rank 0, once the start has resumed)
appends the layout to the manifest's ``layouts`` when it differs from the last one recorded:
``{from_iteration, nodes, layout, cause}`` (cause ``fewer nodes`` below the recipe's node count, else ``recipe`` for
the first one recorded and ``regrown`` after fewer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_tools.registry import RunFolder, now_iso

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.schema import Recipe

ELASTIC_FILE = "elastic.json"


def planned(run_dir: str | Path) -> dict[int, list[str]]:
    """Node count -> the overrides of its layout, from the run folder's ``elastic.json`` ({} without one)."""
    try:
        layouts = json.loads((Path(run_dir) / ELASTIC_FILE).read_text()).get("layouts") or {}
    except (OSError, ValueError):
        return {}
    return {int(k): list(v) for k, v in layouts.items()}


def for_world(run: RunFolder, recipe: "Recipe", world_size: int) -> "Recipe | None":
    """The recipe of a step with ``world_size`` ranks on fewer nodes of an elastic run (None: no layout planned for
    that many ranks)."""
    from hpc_tools.recipe.load import load_resolved

    c = recipe.cluster
    if not c.elastic or world_size % c.gpus_per_node:
        return None
    overrides = planned(run.path).get(world_size // c.gpus_per_node)
    if overrides is None:
        return None
    return load_resolved(run.recipe_path, overrides)


def note(run: RunFolder, recipe: "Recipe", layout: "ParallelLayout", from_iteration: int, full_nodes: int) -> None:
    """Append this start's layout to the manifest's ``layouts`` when it differs from the last one (rank 0)."""
    entries = list(run.manifest().get("layouts") or [])
    label = layout.describe()
    nodes = recipe.cluster.nodes
    if entries and entries[-1].get("nodes") == nodes and entries[-1].get("layout") == label:
        return
    cause = "fewer nodes" if nodes < full_nodes else "regrown" if entries else "recipe"
    entries.append({"from_iteration": from_iteration, "nodes": nodes, "layout": label, "cause": cause,
                    "at": now_iso()})
    run.update(layouts=entries)
