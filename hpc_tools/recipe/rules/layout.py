"""Rules of the parallel layout: it fills the world, divides the heads, layers and batch, and what pipeline
stages, sequence parallelism and recomputation need of it."""

from __future__ import annotations

from typing import Iterator

from hpc_tools import backends
from hpc_tools.errors import Violation
from hpc_tools.layout import ParallelLayout, middle_stage_layers, pipeline_chunks, uneven_splits
from hpc_tools.recipe.rules.registry import _fix, _try, divisors, rule
from hpc_tools.recipe.schema import Recipe

# --- layout -----------------------------------------------------------------------------------------------------------

@rule
def layout_fills_world(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """tensor_size x pipeline_size x context_size x data_size equals nodes x gpus_per_node."""
    world, rep = lay.world_size, lay.replica_size
    cp = f" x parallel.context_size={lay.context_size}" if lay.context_size > 1 else ""
    if r.parallel.data_size == -1:
        if world % rep:
            # The factor named is the one that does not divide the world alone (else tensor_size); its fix lists
            # the values of it that fill the world with the others as they are.
            factors = {"tensor_size": lay.tensor_size, "pipeline_size": lay.pipeline_size,
                       "context_size": lay.context_size}
            name = next((k for k, v in factors.items() if world % v), "tensor_size")
            others = rep // factors[name]
            shown = [f"parallel.{k}={v}" for k, v in factors.items() if k != name and (v > 1 or k != "context_size")]
            yield Violation(f"parallel.{name}", factors[name], f"x {' x '.join(shown)} must divide the world size "
                            f"cluster.nodes x cluster.gpus_per_node = {world}",
                            _fix(f"make tensor_size x pipeline_size{' x context_size' if cp else ''} one of "
                                 f"{', '.join(map(str, divisors(world)))}",
                                 [d for d in divisors(world) if world % (d * others) == 0]))
    elif lay.layout_size != world:
        yield Violation("parallel.data_size", r.parallel.data_size,
                        f"gives tensor x pipeline{' x context' if cp else ''} x data = {lay.layout_size}, not the "
                        f"world size cluster.nodes x cluster.gpus_per_node = {world}",
                        "set data_size: -1 to infer it, or "
                        f"{world // rep if world % rep == 0 else 'change the cluster'}")


@rule
def heads_divisible_by_tensor(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """model.num_attention_heads and model.num_query_groups are divisible by tensor_size."""
    m = r.model
    for field, value in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.num_query_groups)):
        if value % lay.tensor_size:
            yield Violation("parallel.tensor_size", lay.tensor_size, f"must divide model.{field}={value}",
                            _try(divisors(value)))
            return


@rule
def heads_shape(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """hidden_size is divisible by num_attention_heads, which is divisible by num_query_groups."""
    m = r.model
    if m.hidden_size % m.num_attention_heads:
        yield Violation("model.num_attention_heads", m.num_attention_heads,
                        f"must divide model.hidden_size={m.hidden_size}", _try(divisors(m.hidden_size)))
    if m.num_attention_heads % m.num_query_groups:
        yield Violation("model.num_query_groups", m.num_query_groups,
                        f"must divide model.num_attention_heads={m.num_attention_heads}",
                        _try(divisors(m.num_attention_heads)))
    if m.position_embedding == "rope" and m.hidden_size % m.num_attention_heads == 0 and m.head_dim % 2:
        yield Violation("model.num_attention_heads", m.num_attention_heads,
                        f"gives an odd head dimension {m.head_dim}, which RoPE cannot rotate",
                        "choose heads so that hidden_size / heads is even")


@rule
def layers_divisible_by_stages(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """model.num_layers is divisible by pipeline_size x virtual_pipeline_size (unless the first or last stage has a
    layer count of its own: uneven_pipeline_stages checks those)."""
    p = r.parallel
    if p.num_layers_in_first_pipeline_stage is not None or p.num_layers_in_last_pipeline_stage is not None:
        return
    chunks = lay.pipeline_size * (p.virtual_pipeline_size or 1)
    if r.model.num_layers % chunks:
        what = "pipeline_size" if not p.virtual_pipeline_size else "pipeline_size x virtual_pipeline_size"
        splits = (uneven_splits(r.model.num_layers, lay.pipeline_size, p.virtual_pipeline_size or 1)
                  if backends.of(r).uneven_pipeline else [])
        uneven = f", or uneven stages: {_split(splits[0])}" if splits else ""
        yield Violation("model.num_layers", r.model.num_layers, f"must be divisible by parallel.{what}={chunks}",
                        f"use a multiple of {chunks} layers, or {_try(divisors(r.model.num_layers))} for that "
                        f"product{uneven}")


def _split(split: tuple[int | None, int | None]) -> str:
    """``parallel.num_layers_in_first_pipeline_stage=2 and ...last...=3``: one uneven split, as recipe settings."""
    return " and ".join(f"parallel.num_layers_in_{end}_pipeline_stage={n}"
                        for end, n in zip(("first", "last"), split) if n is not None)


@rule
def uneven_pipeline_stages(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """num_layers_in_first/last_pipeline_stage (Megatron-core's uneven stages) need pipeline_size > 1, are multiples
    of virtual_pipeline_size, and leave layers that split equally over the middle stages (each share a multiple of
    virtual_pipeline_size), none of them empty."""
    p, m = r.parallel, r.model
    first, last = p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage
    if (first is None and last is None) or not backends.of(r).uneven_pipeline:
        return  # even stages: layers_divisible_by_stages; a backend without them: backend_features
    path, value = ((f"parallel.num_layers_in_{'first' if first is not None else 'last'}_pipeline_stage",
                    first if first is not None else last))
    v, pp = p.virtual_pipeline_size or 1, lay.pipeline_size
    if pp == 1:
        yield Violation(path, value, "needs parallel.pipeline_size > 1 (it sets one pipeline stage's layers)",
                        "set pipeline_size >= 2, or leave it null")
        return
    for end, n in (("first", first), ("last", last)):
        if n is not None and n % v:
            yield Violation(f"parallel.num_layers_in_{end}_pipeline_stage", n,
                            f"must be a multiple of parallel.virtual_pipeline_size={v} (the stage's {v} model "
                            "chunks hold equal shares)", f"use {max(n - n % v, v)} or {n - n % v + v}")
            return
    if pipeline_chunks(m.num_layers, pp, v, first, last) is not None:
        return
    middle, stages = middle_stage_layers(m.num_layers, pp, first, last)
    if stages == 0 and v > 1 and middle == 0:
        yield Violation(path, value, f"and num_layers_in_last_pipeline_stage={last} leave no middle stage, which "
                        f"Megatron-core 0.16 cannot interleave (parallel.virtual_pipeline_size={v})",
                        "leave num_layers_in_last_pipeline_stage null (the last stage takes the rest)")
        return
    given = " + ".join(f"{n} ({end})" for end, n in (("first", first), ("last", last)) if n is not None)
    if middle < 0 or (stages == 0 and middle > 0):
        what = (f"gives {given} = {m.num_layers - middle} layers, {'more than' if middle < 0 else 'not'} "
                f"model.num_layers={m.num_layers}")
    elif middle == 0:
        what = f"leaves no layer of model.num_layers={m.num_layers} for the {stages} middle stage(s)"
    elif middle % stages:
        what = (f"leaves {middle} of model.num_layers={m.num_layers} layers, not divisible by the {stages} middle "
                f"stages of parallel.pipeline_size={pp}")
    else:
        what = (f"leaves {middle // stages} layers per middle stage, not a multiple of "
                f"parallel.virtual_pipeline_size={v}")
    splits = uneven_splits(m.num_layers, pp, v)
    fix = ("leave both null: the stages divide evenly" if m.num_layers % (pp * v) == 0 else
           f"try {_split(splits[0])}" if splits else
           f"no uneven split of {m.num_layers} layers fits pipeline_size={pp}"
           f"{f' x virtual_pipeline_size={v}' if v > 1 else ''}: change pipeline_size")
    yield Violation(path, value, what + " (Megatron-core's uneven stages)", fix)


@rule
def interleaving_needs_pipeline(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """virtual_pipeline_size needs pipeline_size > 1, and microbatches divisible by pipeline_size."""
    v = r.parallel.virtual_pipeline_size
    if v is None or v == 1:
        return
    if lay.pipeline_size == 1:
        yield Violation("parallel.virtual_pipeline_size", v, "needs parallel.pipeline_size > 1",
                        "set pipeline_size >= 2 or virtual_pipeline_size: null")
    elif lay.data_size > 0 and lay.num_microbatches % lay.pipeline_size:
        yield Violation("parallel.virtual_pipeline_size", v,
                        f"needs the microbatch count ({lay.num_microbatches}: global batch / micro batch / "
                        f"data_size) divisible by pipeline_size={lay.pipeline_size} for the interleaved schedule",
                        "raise training.global_batch_size to a multiple of "
                        f"{lay.micro_batch_size * lay.data_size * lay.pipeline_size}")


@rule
def global_batch_divisible(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """global_batch_size is divisible by micro_batch_size x data_size."""
    step = lay.micro_batch_size * lay.data_size
    if step > 0 and lay.global_batch_size % step:
        lower = lay.global_batch_size // step * step
        options = [x for x in (lower, lower + step) if x > 0]
        yield Violation("training.global_batch_size", lay.global_batch_size,
                        f"must be divisible by micro_batch_size x data_size = {lay.micro_batch_size} x "
                        f"{lay.data_size} = {step}", f"try {' or '.join(map(str, options))}")


@rule
def sequence_parallel_needs_tensor(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """sequence_parallel needs tensor_size > 1 and seq_length divisible by tensor_size."""
    if not r.parallel.sequence_parallel:
        return
    if lay.tensor_size == 1:
        yield Violation("parallel.sequence_parallel", True, "needs parallel.tensor_size > 1",
                        "set tensor_size >= 2 or sequence_parallel: false")
    elif r.model.seq_length % lay.tensor_size:
        yield Violation("model.seq_length", r.model.seq_length,
                        f"must be divisible by parallel.tensor_size={lay.tensor_size} under sequence parallelism",
                        f"use a multiple of {lay.tensor_size}")


@rule
def recompute_layers_fit(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """With full recomputation, recompute_num_layers is at most the layers of one pipeline chunk (the longest, with
    uneven stages)."""
    t, p = r.training, r.parallel
    split = pipeline_chunks(r.model.num_layers, lay.pipeline_size, p.virtual_pipeline_size or 1,
                            p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage)
    per_chunk = max(len(c) for stage in split for c in stage) if split else None
    if t.recompute_granularity == "full" and per_chunk and t.recompute_num_layers > per_chunk:
        yield Violation("training.recompute_num_layers", t.recompute_num_layers,
                        f"exceeds the {per_chunk} layers of one pipeline chunk", f"use 1..{per_chunk}")


@rule
def recompute_modules_apply(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """recompute_modules needs selective recomputation and names parts this model has, once each (Megatron-core's
    checks, and the modules it would silently skip)."""
    t, m = r.training, r.model
    mods = t.recompute_modules
    if mods is None or not backends.of(r).recompute_modules:  # backend_features refuses the field there
        return
    field = "training.recompute_modules"
    if t.recompute_granularity != "selective":
        yield Violation(field, mods, f"is read only with training.recompute_granularity=selective, not "
                        f"{t.recompute_granularity}", "set recompute_granularity: selective or recompute_modules: null")
        return
    seen = [x for i, x in enumerate(mods) if x in mods[:i]]
    missing = {"moe": m.num_experts is None, "moe_act": m.num_experts is None,
               "shared_experts": m.moe_shared_expert_intermediate_size is None,
               "mla_up_proj": not m.multi_latent_attention, "mlp": all(m.moe_layers())}
    why = {"moe": "model.num_experts is null", "moe_act": "model.num_experts is null",
           "shared_experts": "model.moe_shared_expert_intermediate_size is null",
           "mla_up_proj": "model.multi_latent_attention is false", "mlp": "every layer is an MoE layer"}
    absent = next((x for x in mods if missing.get(x)), None)
    grouped_off = (m.moe_grouped_gemm is False or not r.cluster.uses_gpus
                   or r.backend.megatron.transformer_impl == "local")
    if not mods:
        yield Violation(field, mods, "is empty: selective recomputation would recompute nothing",
                        "list modules (e.g. [core_attn]), set it null for [core_attn], or recompute_granularity: none")
    elif seen:
        yield Violation(field, mods, f"names {seen[0]} twice", "list each module once")
    elif absent:
        yield Violation(field, mods, f"names {absent}, which this model does not have ({why[absent]})",
                        f"remove {absent}")
    elif "moe_act" in mods and grouped_off:
        yield Violation(field, mods, "names moe_act, which Megatron-core recomputes only in grouped-GEMM experts "
                        "(Transformer Engine on GPUs, model.moe_grouped_gemm not false)", "remove moe_act")
    elif "layernorm" in mods and (not r.cluster.uses_gpus or r.backend.megatron.transformer_impl == "local"):
        yield Violation(field, mods, "names layernorm, which Megatron-core 0.16 recomputes through Transformer "
                        "Engine (CheckpointWithoutOutput), absent on CPU ranks and with transformer_impl: local",
                        "remove layernorm")
    elif "shared_experts" in mods and r.parallel.moe_shared_expert_overlap:
        yield Violation(field, mods, "names shared_experts, which cannot be combined with "
                        "parallel.moe_shared_expert_overlap (Megatron-core refuses it)",
                        "remove shared_experts or set moe_shared_expert_overlap: false")
    elif t.fp8 is not None and t.fp8_recipe == "delayed" and {"moe_act", "layernorm"} & set(mods):
        yield Violation(field, mods, "names moe_act or layernorm, which FP8's delayed scaling cannot recompute "
                        "(Megatron-core refuses it)", "remove them, or training.fp8_recipe: tensorwise (or blockwise, "
                        "with a torch built for CUDA >= 12.9)")
