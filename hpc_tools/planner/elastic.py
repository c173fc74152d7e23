"""Elastic layouts (``cluster.min_nodes``): the layout a run continues in on fewer nodes than ``cluster.nodes``.

For every node count from ``nodes - 1`` down to ``min_nodes`` (at most ``MAX_COUNTS`` of them: the counts nearest
``nodes``, then ``min_nodes`` itself), the layout search (``hpc_tools.planner.search``) ranks the configurations of
the recipe on that many nodes, and the fastest one whose checkpoint the run can resume into is kept (``carries``):
the global batch, the model and the data order stay (the search holds them fixed); the optimizer state must come
along, so a candidate keeps what the backend's checkpoint cannot reshard:

- Megatron: what ``hpc_tools.checkpoints.reshard`` lets its loader carry (the same optimizer kind; expert
  parallelism on or off as before; with the distributed optimizer, the model-parallel sizes).
- FSDP and Horovod: the FSDP strategy (DCP reshards parameters and optimizer state across any world size).
- DeepSpeed: refused before this (``hpc_tools.recipe.rules``): its ZeRO checkpoints hold each data-parallel rank's
  optimizer partition.

The result (``ElasticPlan``) is written into the run folder as ``elastic.json`` by ``python -m
hpc_tools.planner.elastic --run-dir RUN`` (the batch script runs it before its first rank step; ``submit`` writes it
for submitit): the restart controller (standard library only) reads the node counts from it, and each rank of a
step on fewer nodes applies that count's ``--set`` overrides to the run's recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_tools import backends
from hpc_tools.errors import UserError, Violation
from hpc_tools.planner.knobs import Knobs
from hpc_tools.runtime.elastic import ELASTIC_FILE

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

MAX_COUNTS = 8  # node counts planned below cluster.nodes (the nearest ones, and min_nodes)
SEARCH_TOP = 200  # candidates ranked per node count before the first one the checkpoint can carry
# CPU ranks have no peak in the hardware table; the search ranks their layouts against this nominal peak (only the
# order of the candidates matters here, not their predicted seconds).
CPU_NOMINAL_TFLOPS = 1.0
CANNOT_CARRY = "keeps what the checkpoint cannot reshard"  # the end of an unplanned count's reason


@dataclass
class ElasticPlan:
    """Node count -> the ``--set`` overrides of the layout on that many nodes, with its label."""

    nodes: int  # cluster.nodes: the recipe's own layout
    min_nodes: int
    layouts: dict[int, list[str]] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)
    unplanned: dict[int, str] = field(default_factory=dict)  # node count -> why no layout

    def to_json(self) -> dict:
        return {"nodes": self.nodes, "min_nodes": self.min_nodes,
                "layouts": {str(k): v for k, v in sorted(self.layouts.items(), reverse=True)},
                "labels": {str(k): v for k, v in sorted(self.labels.items(), reverse=True)},
                "unplanned": {str(k): v for k, v in sorted(self.unplanned.items(), reverse=True)}}


def counts(nodes: int, min_nodes: int) -> list[int]:
    """The node counts planned below ``nodes``: the ``MAX_COUNTS - 1`` nearest it, and ``min_nodes``."""
    near = list(range(nodes - 1, max(min_nodes, nodes - MAX_COUNTS) - 1, -1))
    return near if min_nodes in near else [*near, min_nodes]


def carries(recipe: "Recipe", base: Knobs, cand: Knobs) -> bool:
    """Whether a checkpoint saved under the recipe's configuration ``base`` resumes with its optimizer state into
    candidate ``cand``: its sharding scheme's rule (``Scheme.carries``: for Megatron ``hpc_tools.checkpoints.reshard``,
    the loader's own rule; for FSDP and Horovod the same FSDP strategy)."""
    return base.scheme.carries(base, cand)


def on_nodes(recipe: "Recipe", k: int) -> "Recipe":
    """The recipe on ``k`` nodes, no spares (what a step on the nodes that remain runs); CPU ranks ranked against
    ``CPU_NOMINAL_TFLOPS`` unless the recipe gives their peak."""
    from hpc_tools.recipe.schema import Recipe

    update = {"nodes": k, "spare_nodes": 0, "min_nodes": None}
    if not recipe.cluster.uses_gpus and recipe.cluster.gpu_peak_tflops is None:
        update["gpu_peak_tflops"] = CPU_NOMINAL_TFLOPS
    cluster = recipe.cluster.model_copy(update=update)
    return Recipe.model_validate(recipe.model_copy(update={"cluster": cluster}).model_dump())


def plan_elastic(recipe: "Recipe") -> ElasticPlan:
    """The layouts of an elastic recipe on each node count it may continue on (``counts``)."""
    from hpc_tools.planner.search import search

    c = recipe.cluster
    out = ElasticPlan(nodes=c.nodes, min_nodes=c.fewest_nodes)
    base = Knobs.from_recipe(recipe)
    for k in (counts(c.nodes, c.fewest_nodes) if c.elastic else []):
        try:
            result = search(on_nodes(recipe, k), top=SEARCH_TOP, losers=0)
        except UserError as exc:
            out.unplanned[k] = str(exc)
            continue
        best = next((cand for cand in result.ranked if carries(recipe, base, cand.knobs)), None)
        if best is None:
            out.unplanned[k] = (f"none of the {len(result.ranked)} layouts that fit {k} node(s) {CANNOT_CARRY}"
                                if result.ranked else
                                f"no layout fits {k} node(s) ({result.enumerated} tried, {result.too_big} too big)")
            continue
        out.layouts[k] = [*best.knobs.overrides(), f"cluster.nodes={k}", "cluster.spare_nodes=0"]
        out.labels[k] = best.knobs.describe()
    return out


def elastic_violations(recipe: "Recipe") -> list[Violation]:
    """[] unless the recipe is elastic (with restarts, on a backend that can be: the rules say the rest) and its
    ``min_nodes`` has no layout the run can resume into: then one violation, naming why and the fewest node count
    that has one."""
    c = recipe.cluster
    if not (c.elastic and backends.of(recipe).elastic):
        return []
    plan = plan_elastic(recipe)
    if c.fewest_nodes in plan.layouts:
        return []
    why = plan.unplanned.get(c.fewest_nodes, "not planned")
    fewest = min(plan.layouts) if plan.layouts else c.nodes
    base = Knobs.from_recipe(recipe)
    fix = base.scheme.carry_fix(base) if why.endswith(CANNOT_CARRY) else ""
    return [Violation("cluster.min_nodes", c.min_nodes, f"has no layout the run can continue in: on "
                      f"{c.fewest_nodes} node(s), {why}", f"set cluster.min_nodes: {fewest}{fix}")]


def write(run_dir: Path, plan: ElasticPlan) -> Path:
    from hpc_tools.registry import atomic_write

    path = Path(run_dir) / ELASTIC_FILE
    atomic_write(path, json.dumps(plan.to_json(), indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.planner.elastic", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    from hpc_tools.recipe.load import load_resolved
    from hpc_tools.registry import RunFolder

    run = RunFolder(args.run_dir)
    recipe = load_resolved(run.recipe_path)
    try:
        plan = plan_elastic(recipe)
    except UserError as exc:
        print(f"hpc_tools elastic: {exc}", file=sys.stderr)
        return 1
    write(run.path, plan)
    for k in sorted(plan.layouts, reverse=True):
        print(f"hpc_tools: elastic: on {k} node(s): {plan.labels[k]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
