"""Does the recipe fit in GPU memory? The check ``validate`` and ``submit`` run before anything is queued.

"Fits" means the planned peak stays under the GPU memory less a stated headroom (``cluster.memory_headroom_gb``,
default 5 % of the GPU memory + 1 GB): the plan counts every tensor it models, but the caching allocator's
fragmentation and the NCCL buffers of every communicator come on top (docs/formulas.md, "Headroom").
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Iterator

from hpc_tools import backends
from hpc_tools.errors import UserError, Violation
from hpc_tools.planner.arch import Arch, arch_for
from hpc_tools.planner.hardware import GB, hardware_for, headroom_bytes, headroom_note
from hpc_tools.planner.knobs import Knobs, apply_knobs
from hpc_tools.planner.memory import estimate_memory
from hpc_tools.planner.search import CP_MIN_SEQ

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe


def fit_violations(recipe: "Recipe") -> list[Violation]:
    """[] when the predicted peak memory per GPU fits (or there is no GPU memory to check: CPU ranks, comm_check)
    and an elastic recipe (``cluster.min_nodes``) has a layout on its fewest nodes that its checkpoints resume into;
    else one violation (``memory_violations``, then ``hpc_tools.planner.elastic.elastic_violations``)."""
    from hpc_tools.planner.elastic import elastic_violations

    return memory_violations(recipe) or elastic_violations(recipe)


def memory_violations(recipe: "Recipe") -> list[Violation]:
    """[] when the predicted peak memory per GPU fits (or there is no GPU memory to check: CPU ranks, comm_check);
    else one violation naming the total, the GPU memory, the biggest terms and changes that would fit."""
    if not recipe.cluster.uses_gpus or not backends.of(recipe).trains_model:
        return []
    try:
        hw = hardware_for(recipe.cluster, recipe.training.precision, strict=True, need_peak=False)
    except UserError as exc:
        known = str(exc).split("(", 1)[1].rstrip(")")
        return [Violation("cluster.gpu_type", recipe.cluster.gpu_type,
                          "is not in the planner's hardware table, so its memory is unknown", known)]
    arch, knobs = arch_for(recipe), Knobs.from_recipe(recipe)
    if knobs.layout.data_size < 1 or knobs.layout.layout_size != knobs.layout.world_size:
        return []  # the layout rules already report this; the memory model needs a valid layout
    plan = estimate_memory(arch, knobs)
    headroom = headroom_bytes(recipe.cluster, hw.mem_bytes)
    usable = hw.mem_bytes - headroom
    if plan.total <= usable:
        return []
    peak = plan.peak
    biggest = sorted(peak.terms.items(), key=lambda kv: -kv[1])[:3]
    terms = ", ".join(f"{name} {value / GB:.1f} GB" for name, value in biggest)
    where = f" on pipeline stage {peak.stage}" if knobs.layout.pipeline_size > 1 else ""
    path = "cluster.gpu_mem_gb" if recipe.cluster.gpu_mem_gb is not None else "cluster.gpu_type"
    value = recipe.cluster.gpu_mem_gb if recipe.cluster.gpu_mem_gb is not None else recipe.cluster.gpu_type
    rule = (f"gives {hw.mem_bytes / GB:.1f} GB per GPU, {usable / GB:.1f} GB after the {headroom / GB:.1f} GB "
            f"headroom ({headroom_note(recipe.cluster, hw.mem_bytes)}), but the plan needs "
            f"{plan.total / GB:.1f} GB{where} ({terms})")
    fixes = [f"{' and '.join(change)} ({total / GB:.1f} GB)"
             for change, total in fitting_changes(recipe, arch, knobs, usable)]
    search = "`python -m hpc_tools plan RECIPE --search` finds the fastest layout that fits"
    fix = (f"try {' or '.join(fixes[:3])}; {search}" if fixes else
           f"no single change fits: combine tensor/pipeline parallelism and recomputation, or add nodes; {search}")
    return [Violation(path, value, rule, fix)]


def fitting_changes(recipe: "Recipe", arch: Arch, k: Knobs, mem_bytes: float) -> list[tuple[list[str], float]]:
    """Single changes (``--set`` strings, one to three) that bring the peak under ``mem_bytes`` and keep the recipe
    rules, roughly cheapest first: attention recompute and optimizer sharding, then wider TP / deeper PP, then full
    recomputation and smaller microbatches."""
    from hpc_tools.recipe.rules import check_recipe

    out = []
    for change, alt in _single_changes(recipe, k):
        # The rules first: the memory model needs a layout they accept (a deeper pipeline that leaves a virtual
        # chunk no layer divided by zero layers per recompute group).
        if check_recipe(apply_knobs(recipe, alt)):
            continue
        total = estimate_memory(arch, alt).total
        if total <= mem_bytes:
            out.append((change, total))
    return out


def _single_changes(recipe: "Recipe", k: Knobs) -> Iterator[tuple[list[str], Knobs]]:
    lay = k.layout
    world, m = lay.world_size, recipe.model
    explicit_dp = recipe.parallel.data_size != -1

    def relayout(t: int, p: int, **kw) -> Knobs | None:
        cp = kw.get("context_size", lay.context_size)
        if world % (t * p * cp):
            return None
        return replace(k, layout=replace(lay, tensor_size=t, pipeline_size=p, data_size=world // (t * p * cp), **kw))

    def with_dp(sets: list[str], alt: Knobs) -> list[str]:
        return sets + [f"parallel.data_size={alt.layout.data_size}"] if explicit_dp else sets

    row, options, scheme = k.row, f"backend.{k.row.options}", k.scheme
    if row.selective_recompute and k.recompute != "selective" and k.recompute != "full":
        yield ["training.recompute_granularity=selective"], replace(k, recompute="selective")
    yield from scheme.cheap_changes(k, options)  # the distributed optimizer
    if row.tensor_parallel:
        sp = row.sequence_parallel
        if sp and lay.tensor_size > 1 and not lay.sequence_parallel:
            yield ["parallel.sequence_parallel=true"], replace(k, layout=replace(lay, sequence_parallel=True))
        for t in (lay.tensor_size * 2, lay.tensor_size * 4):
            alt = relayout(t, lay.pipeline_size, sequence_parallel=sp)
            if alt and t <= recipe.cluster.gpus_per_node:
                yield with_dp([f"parallel.tensor_size={t}"] + (["parallel.sequence_parallel=true"] if sp else []),
                              alt), alt
    if k.moe and row.expert_parallel:  # more expert parallelism: fewer experts per GPU
        for ep in (lay.expert_size * 2, lay.expert_size * 4):
            if m.num_experts % ep == 0 and (world // lay.pipeline_size) % (ep * lay.expert_tensor_size) == 0:
                yield [f"parallel.expert_size={ep}"], replace(k, layout=replace(lay, expert_size=ep))
    if row.context_parallel and k.on_gpu and (lay.context_size > 1 or m.seq_length >= CP_MIN_SEQ):
        cp = lay.context_size * 2
        alt = relayout(lay.tensor_size, lay.pipeline_size, context_size=cp)
        if alt and m.seq_length % (2 * cp * lay.tensor_size) == 0:
            yield with_dp([f"parallel.context_size={cp}"], alt), alt
    yield from scheme.changes(k, options)  # a higher ZeRO stage, offload; FSDP full_shard, resharding
    for p in (lay.pipeline_size * 2, lay.pipeline_size * 4) if row.pipeline_parallel else ():
        alt = relayout(lay.tensor_size, p)
        if alt and m.num_layers % p == 0:
            yield with_dp([f"parallel.pipeline_size={p}"], alt), alt
    if k.recompute != "full":
        yield ["training.recompute_granularity=full"], replace(k, recompute="full", recompute_method="uniform",
                                                               recompute_num_layers=1)
    if lay.micro_batch_size > 1:
        b = lay.micro_batch_size // 2
        yield [f"training.micro_batch_size={b}"], replace(k, layout=replace(lay, micro_batch_size=b))
