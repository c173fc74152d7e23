"""Why a layout search found nothing: which constraint emptied it, and what would admit a layout.

The layouts a search could take are the (TP, PP, CP) combinations that fill the world (TP inside a node: a divisor
of cluster.gpus_per_node; TP x PP x CP dividing nodes x GPUs per node, DP the rest). Each is removed by the first
constraint it breaks, in this order: the attention heads and query groups TP must divide, the layers PP must split,
the sequence CP must split, the global batch DP must divide; the combinations left are expanded into configurations
(micro batch, recompute, optimizer sharding, ...), which the GPU memory and then the recipe rules prune. The
constraint after which nothing is left emptied the search. What would admit a layout is then tried, not guessed:
for memory, the same search on 2x, 4x and 8x the nodes, and the GPU memory the leanest configuration needs; for
the global batch, the nearest batch a data-parallel size left divides; for the rules, the rule and its fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpc_tools.planner.hardware import GB, headroom_bytes

if TYPE_CHECKING:
    from hpc_tools.planner.knobs import Knobs
    from hpc_tools.planner.search import SearchResult
    from hpc_tools.recipe.schema import Recipe

HEADS, LAYERS, SEQUENCE, BATCH, MEMORY, RULES = ("attention heads", "layers", "sequence", "global batch", "memory",
                                                  "rules")
NODE_FACTORS = (2, 4, 8)  # more nodes tried when memory emptied the search
MORE_NODES_BUDGET = 100_000  # configurations scored by those searches before the next is left out


@dataclass
class Step:
    constraint: str  # HEADS ... RULES
    removed: int
    left: int
    unit: str  # "layouts" (TP, PP, CP combinations) or "configurations"
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"constraint": self.constraint, "removed": self.removed, "left": self.left, "unit": self.unit,
                "detail": self.detail}


@dataclass
class WhyNone:
    """The funnel of a search that found nothing, the constraint that emptied it and what would admit a layout."""
    steps: list[Step]
    emptied_by: str
    admit: list[str] = field(default_factory=list)
    kind: str = ""  # the backend kind explained, in a search across kinds

    def lines(self) -> list[str]:
        """``why nothing fits: ...`` and one ``would admit a layout: ...`` line per way found."""
        shown = []
        for s in self.steps:
            if s.removed or s.constraint == self.emptied_by:
                shown.append(f"{s.constraint} removed {s.removed:,} {s.unit}, {s.left:,} left"
                             + (f" ({s.detail})" if s.detail else ""))
            if s.constraint == self.emptied_by:
                break
        first = self.steps[0]
        kind = f" ({self.kind})" if self.kind else ""
        out = [f"why nothing fits{kind}: the {self.emptied_by} constraint emptied the search: of "
               f"{first.removed + first.left:,} (TP, PP, CP) layouts that fill the GPUs, " + "; ".join(shown)]
        out += [f"would admit a layout: {a}" for a in self.admit]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind or None, "emptied_by": self.emptied_by, "steps": [s.as_dict() for s in self.steps],
                "would_admit": self.admit,
                "text": self.lines()}


def _values(vals: set[int]) -> str:
    return ", ".join(str(v) for v in sorted(vals)) or "none"


def explain_search(recipe: "Recipe", result: "SearchResult", kinds: list[str] | None = None,
                   efficiency: float | None = None, use_calibration: bool = True) -> WhyNone | None:
    """``result.why_none`` for a search of ``recipe`` (across ``kinds`` when given) that ranked nothing; None (and
    ``result`` unchanged) when it ranked something. Across kinds, the recipe's own kind is explained when it was asked
    for, else the first kind asked (searched again alone: the joint result keeps no kind's counts)."""
    from hpc_tools.planner.knobs import Knobs
    from hpc_tools.planner.search import search, with_kind

    if result.ranked:
        return None
    kind = ""
    if kinds:
        kind = recipe.backend.kind if recipe.backend.kind in kinds else kinds[0]
        recipe = with_kind(recipe, kind)
        result = search(recipe, top=1, losers=0, efficiency=efficiency, use_calibration=use_calibration)
    why = explain(recipe, Knobs.from_recipe(recipe), result)
    why.kind = kind
    return why


def explain(recipe: "Recipe", base: "Knobs", result: "SearchResult", try_more_nodes: bool = True) -> WhyNone:
    """The funnel of ``result`` (a search of ``recipe`` that ranked nothing)."""
    from hpc_tools.planner.search import _context_sizes, _divisors, enumerate_knobs

    m, c, row = recipe.model, recipe.cluster, base.row
    world, batch = base.layout.world_size, base.layout.global_batch_size
    tensors = _divisors(c.gpus_per_node) if row.tensor_parallel else [1]
    contexts = _context_sizes(recipe, base)
    universe = [(t, p, cp) for t in tensors for cp in contexts for p in (_divisors(world // (t * cp))
                if row.pipeline_parallel and world % (t * cp) == 0 else [1]) if world % (t * p * cp) == 0]
    enumerated = {(k.layout.tensor_size, k.layout.pipeline_size, k.layout.context_size)
                  for k in enumerate_knobs(recipe, base)}
    checks = [(HEADS, lambda t, p, cp: m.num_attention_heads % t == 0 and m.num_query_groups % t == 0),
              (LAYERS, lambda t, p, cp: (t, p, cp) in enumerated or m.num_layers % p == 0),
              (SEQUENCE, lambda t, p, cp: cp == 1 or m.seq_length % (2 * cp * t) == 0),
              (BATCH, lambda t, p, cp: batch % (world // (t * p * cp)) == 0)]
    steps, left, before = [], list(universe), {}
    for name, ok in checks:
        before[name] = left
        kept = [x for x in left if ok(*x)]
        gone = [x for x in left if not ok(*x)]
        steps.append(Step(name, len(gone), len(kept), "layouts", _detail(recipe, name, gone, kept, world)))
        left = kept
    if len(enumerated) < len(left):  # the search's own limits (a backend without a dimension, ...)
        steps.append(Step("backend", len(left) - len(enumerated), len(enumerated), "layouts"))
    fitting = result.fitting
    steps.append(Step(MEMORY, result.too_big, fitting, "configurations",
                      f"of {result.enumerated:,} configurations of those layouts, {fitting:,} fit in "
                      f"{(result.usable_bytes or 0) / GB:.1f} GB" if result.usable_bytes is not None else ""))
    steps.append(Step(RULES, len(result.broke_rules), 0, "configurations"))
    emptied = next((s.constraint for s in steps if s.left == 0), RULES)
    why = WhyNone(steps, emptied)
    if emptied == BATCH:
        why.admit = _batch_admits(before[BATCH], world, batch)
    elif emptied == MEMORY:
        why.admit = _memory_admits(recipe, result, steps, world, try_more_nodes)
    elif emptied == RULES and result.broke_rules:
        why.admit = _rules_admit(result)
    return why


def _rules_admit(result: "SearchResult") -> list[str]:
    """The rules the fitting configurations broke, most often first (each with its fix), at most two."""
    by_path: dict[str, list] = {}
    for cand, violation in result.broke_rules:
        by_path.setdefault(violation.path, []).append((cand, violation))
    n = len(result.broke_rules)
    out = []
    for path, hits in sorted(by_path.items(), key=lambda kv: -len(kv[1]))[:2]:
        cand, violation = hits[0]
        share = "every one" if len(hits) == n else f"{len(hits):,}"
        out.append(f"keeping the rule on {path}, the first one {share} of the {n:,} fitting configurations checked "
                   f"broke (the fastest, {cand.knobs.describe()}: {violation})")
    return out


def _detail(recipe: "Recipe", name: str, gone: list, kept: list, world: int) -> str:
    m = recipe.model
    if not gone:
        return ""
    if name == HEADS:
        return (f"TP {_values({t for t, _, _ in gone})} do not divide model.num_attention_heads="
                f"{m.num_attention_heads} and num_query_groups={m.num_query_groups}")
    if name == LAYERS:
        return (f"PP {_values({p for _, p, _ in gone})} do not divide model.num_layers={m.num_layers}; PP left: "
                f"{_values({p for _, p, _ in kept})}")
    if name == SEQUENCE:
        return f"CP {_values({cp for _, _, cp in gone})} do not split model.seq_length={m.seq_length} into 2 x CP x TP"
    if name == BATCH:
        return (f"DP {_values({world // (t * p * cp) for t, p, cp in gone})} do not divide "
                f"training.global_batch_size={recipe.training.global_batch_size}")
    return ""


def _batch_admits(layouts: list, world: int, batch: int) -> list[str]:
    """The nearest global batches (above and below) that a data-parallel size the model's constraints left
    divides."""
    sizes = {world // (t * p * cp) for t, p, cp in layouts}
    near = sorted({-(-batch // d) * d for d in sizes} | {batch // d * d for d in sizes if batch >= d},
                  key=lambda b: (abs(b - batch), b))[:2]
    return [f"training.global_batch_size={b} (a multiple of the data-parallel size{'s' if len(sizes) > 1 else ''} "
            f"{_values(sizes)} the layouts left have on {world:,} GPUs)" for b in sorted(near)]


def _memory_admits(recipe: "Recipe", result: "SearchResult", steps: list[Step], world: int,
                   try_more_nodes: bool) -> list[str]:
    out = []
    leanest = result.smallest_too_big
    if leanest is not None:
        need = gpu_memory_for(recipe, leanest.memory_bytes)
        out.append(f"a GPU with at least {math.ceil(need / GB)} GB (the leanest configuration, "
                   f"{leanest.knobs.describe()}, needs {leanest.memory_bytes / GB:.1f} GB plus "
                   f"{(need - leanest.memory_bytes) / GB:.1f} GB headroom on such a GPU; it already has the smallest "
                   "micro batch and recompute the search tries)")
    layers = next(s for s in steps if s.constraint == LAYERS)
    if layers.removed and leanest is not None:
        out.append(f"more pipeline stages than the layer count allows ({layers.detail}): a deeper pipeline holds "
                   "fewer layers per GPU"
                   + ("; uneven stages (parallel.num_layers_in_first_pipeline_stage / "
                      "num_layers_in_last_pipeline_stage) allow PP values that do not divide the layers"
                      if getattr(leanest.knobs.row, "uneven_pipeline", False) else ""))
    if try_more_nodes:
        out.append(_more_nodes(recipe))
    return out


def gpu_memory_for(recipe: "Recipe", plan_bytes: float) -> float:
    """The smallest GPU memory whose usable part (less ``hardware.headroom_bytes``, which may grow with the memory)
    holds ``plan_bytes``."""
    need = plan_bytes
    for _ in range(50):  # the headroom is affine in the memory: converges in a few steps
        more = plan_bytes + headroom_bytes(recipe.cluster, need)
        if more <= need:
            break
        need = more
    return need


def _more_nodes(recipe: "Recipe") -> str:
    """The smallest of 2x, 4x, 8x the nodes with which the same search ranks a configuration."""
    from hpc_tools.planner.search import search

    nodes, scored, tried = recipe.cluster.nodes, 0, []
    for factor in NODE_FACTORS:
        if scored > MORE_NODES_BUDGET:  # the searches so far were large: the next, larger still, is not tried
            break
        more = recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update={"nodes": nodes * factor})})
        found = search(more, top=1, losers=0, use_calibration=False)
        scored += found.enumerated
        tried.append(str(nodes * factor))
        if found.best is not None:
            return (f"cluster.nodes={nodes * factor} ({factor}x): {found.fitting:,} configurations fit, the fastest "
                    f"{found.best.knobs.describe()}")
    return f"not more nodes alone: {', '.join(tried)} nodes fit nothing either"
