"""A recipe's parallel groups on a cluster's topology, in the plan's terms: which group kinds must cross nodes or leaf
switches even in the best placement (``hpc_tools.topology.placement``), what the plan says that group's traffic
costs, and how many leaf switches (``cluster.switches``) keep the rest together. ``validate`` prints the warnings
(exit 0: a layout that crosses switches runs, slower); docs/topology.md explains them.

The plan prices a group that crosses nodes at the inter-node busbw (``Hardware.link_bw``); it has no figure of its
own for switch uplinks, so a group crossing leaf switches is priced the same, and the warning says that an
oversubscribed uplink (more node links below a leaf than uplinks above it) can only make it slower.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_tools.layout import ParallelLayout
from hpc_tools.planner.steptime import CP_COMM, EP_COMM, TP_COMM
from hpc_tools.topology import Placement, Topology, placement

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

# The step-time term and the collective of each checked group kind.
TERMS = {"TP": (TP_COMM, "all-reduce"), "CP": (CP_COMM, "K/V exchange"), "EP": (EP_COMM, "all-to-all")}
# The field that sizes each kind's block of consecutive ranks, and the fields inside it (Megatron-core's rank order).
FIELDS = {"TP": ("parallel.tensor_size", ""), "CP": ("parallel.context_size", " x parallel.tensor_size"),
          "EP": ("parallel.expert_size", " x parallel.expert_tensor_size")}


def recipe_placement(recipe: "Recipe", topology: Topology) -> Placement:
    """The best placement of the recipe's layout on the topology's leaves (all of them: a partition's are not
    known here)."""
    return placement(ParallelLayout.from_recipe(recipe), [len(n) for n in topology.leaves().values()])


def placement_warnings(recipe: "Recipe", topology: Topology, where: str) -> list[str]:
    """One ``warning:`` line per group kind (TP, CP, EP) that must cross leaf switches, with its cost in the plan;
    one when ``cluster.switches`` is fewer than the placement needs, or the topology has too few nodes."""
    lay, c = ParallelLayout.from_recipe(recipe), recipe.cluster
    best = recipe_placement(recipe, topology)
    out: list[str] = []
    if best.short:
        out.append(f"warning: {where}: the topology lists {lay.nodes - best.short} nodes under its "
                   f"{topology.units}, the job needs {lay.nodes}: {best.short} would sit outside it")
    terms, step, bw = _plan_terms(recipe)
    leaf = f"{topology.units} of at most {best.leaf_nodes} nodes ({best.leaf_nodes * lay.ranks_per_node} ranks)"
    for span in best.must_cross():
        name = f"{span.kind.name}{span.kind.size}"
        term, collective = TERMS[span.kind.name]
        cost = ""
        if terms is not None and term in terms:
            cost = (f"; the plan prices its {collective} at the inter-node busbw {bw:.0f} GB/s per GPU: "
                    f"{terms[term]:.3g} s of a {step:.3g} s step, more where the switch uplinks are oversubscribed")
        field, inner = FIELDS[span.kind.name]
        out.append(f"warning: {where}: {name} groups must span {span.leaves} {topology.units} "
                   f"({span.kind.block} consecutive ranks; {leaf}){cost} -- {field}{inner} of at most "
                   f"{best.leaf_nodes * lay.ranks_per_node} keeps each inside one {topology.unit}")
    if c.switches is not None and c.switches < best.switches and topology.kind == "tree":
        out.append(f"warning: {where}: cluster.switches={c.switches} is fewer leaf switches than the job fills in "
                   f"whole groups ({best.switches}): Slurm waits up to the site's max_switch_wait for it, then "
                   f"starts the job anyway -- set cluster.switches={best.switches}")
    return out


def placement_summary(recipe: "Recipe", topology: Topology) -> str:
    """One line for ``validate --verbose``: where each group kind falls at best, and the switch count."""
    best = recipe_placement(recipe, topology)
    kinds = ", ".join(f"{s.kind.name}{s.kind.size} {s.nodes} node{'s' * (s.nodes > 1)} / {s.leaves} "
                      f"{topology.unit if s.leaves == 1 else topology.units}" for s in best.spans) or "one rank"
    ask = f"; cluster.switches={best.switches} keeps them so" if topology.kind == "tree" else ""
    return f"topology ({topology.kind}, {len(topology.leaves())} {topology.units}): at best {kinds}{ask}"


def _plan_terms(recipe: "Recipe") -> tuple[dict[str, float] | None, float, float]:
    """(step-time terms, step seconds, inter-node busbw GB/s) of the recipe's plan; terms None when it has none."""
    from hpc_tools.planner import plan_recipe
    from hpc_tools.planner.hardware import GB, hardware_for

    bw = hardware_for(recipe.cluster, need_peak=False).inter_node_bw / GB
    try:
        time = plan_recipe(recipe).time
    except Exception:  # a cost figure is a courtesy: the warning stands without it
        return None, 0.0, bw
    if time is None:
        return None, 0.0, bw
    return time.terms, time.total_s, bw
