"""Cross-field rules a recipe must satisfy before anything is written or queued.

Each rule is a small function registered with ``@rule``; ``check_recipe`` runs them all and returns every violation,
so ``validate`` reports all problems at once. The layout arithmetic itself lives in ``hpc_tools.layout``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from hpc_tools import backends
from hpc_tools.errors import Violation, show
from hpc_tools.layout import ParallelLayout, middle_stage_layers, pipeline_chunks, uneven_splits
from hpc_tools.recipe import te_support
from hpc_tools.recipe.reads import fields_read
from hpc_tools.recipe.schema import Recipe

RuleFn = Callable[[Recipe, ParallelLayout], Iterator[Violation]]


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    doc: str
    fn: RuleFn

    @property
    def reads(self) -> frozenset[str]:
        """The recipe fields this rule reads, found in its source (``hpc_tools.recipe.reads``)."""
        return fields_read(self.fn)


RULES: list[Rule] = []


def rule(fn: RuleFn) -> RuleFn:
    RULES.append(Rule(fn.__name__, (fn.__doc__ or "").strip(), fn))
    return fn


# A rule refusing the layout's product (layout_fills_world) also makes what the layout derives from it unsound.
DERIVED = {"layout_fills_world": frozenset({"parallel.data_size"})}


def check_recipe(recipe: Recipe) -> list[Violation]:
    """Every violation, one line per root cause: a line computed from a value an earlier rule refused (a sequence
    length checked against a refused context_size, a batch split by a refused layout: the rule reads that field and
    the line names it) is left out, and the lines refusing one value are one line whose fix is what every rule
    admits (``merged``)."""
    layout = ParallelLayout.from_recipe(recipe)
    kept: list[Violation] = []
    refused: set[str] = set()
    for r in RULES:
        for v in r.fn(recipe, layout):
            if v.path not in refused and _reads(r) & refused and _names_any(v, refused):
                continue
            kept.append(v)
            refused |= {v.path} | DERIVED.get(r.name, frozenset())
    return merged(kept)


def _reads(r: Rule) -> frozenset[str]:
    """The fields the rule reads (``Rule.reads``, from its source); none when its source cannot be read."""
    try:
        return r.reads
    except (OSError, TypeError, SyntaxError):
        return frozenset()


def _names_any(v: Violation, fields: set[str]) -> bool:
    """Whether the line's rule or fix names one of ``fields``: by its path, or by its bare key (``tensor_size``,
    ``data_size``); a key inside another path (``tracking.mlflow.enabled`` for ``tracking.wandb.enabled``) is another
    field."""
    text = f"{v.rule} ({v.fix})"
    return any(re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", text) or
               re.search(rf"(?<![\w.]){re.escape(f.rsplit('.', 1)[-1])}(?![\w])", text) for f in fields)


def merged(violations: list[Violation]) -> list[Violation]:
    """The lines refusing the same field and value as one line: the rules joined, the fix what every rule admits
    (the intersection of the values their fixes list, ``_Fix``), or each fix once when they list none."""
    groups: dict[tuple[str, str], list[Violation]] = {}
    for v in violations:
        groups.setdefault((v.path, show(v.value)), []).append(v)
    out = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        listed = [v.fix.values for v in group if isinstance(v.fix, _Fix)]
        fixes = [v.fix for v in group if not isinstance(v.fix, _Fix)]
        if listed:
            common = [x for x in listed[0] if all(x in other for other in listed[1:])]
            fixes.insert(0, _try(common) if common else "no value satisfies all of these: change the fields they "
                         "name")
        out.append(Violation(group[0].path, group[0].value, " and ".join(v.rule for v in group),
                             "; ".join(dict.fromkeys(fixes))))
    return out


NOTES: list[Rule] = []
"""Checks of choices that are valid but unusual: each finding is one line on stderr (``note: ...``), exit 0."""


def note(fn: RuleFn) -> RuleFn:
    NOTES.append(Rule(fn.__name__, (fn.__doc__ or "").strip(), fn))
    return fn


def recipe_notes(recipe: Recipe) -> list[str]:
    """The notes of a recipe that passed its rules, as the lines the commands print (``note: FIELD=VALUE ...``)."""
    layout = ParallelLayout.from_recipe(recipe)
    return [f"note: {v}" for n in NOTES for v in n.fn(recipe, layout)]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, in O(sqrt n) (n can be any bounded recipe value)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class _Fix(str):
    """A fix that lists the values it admits (``values``), so that the fixes of rules refusing the same value can be
    intersected (``merged``)."""

    values: tuple[int, ...] = ()


def _fix(text: str, values: list[int]) -> _Fix:
    fix = _Fix(text)
    fix.values = tuple(values)
    return fix


def _try(values: list[int], limit: int = 8) -> _Fix:
    shown = ", ".join(str(v) for v in values[:limit])
    return _fix(f"try {shown}{', ...' if len(values) > limit else ''}", values)


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


# --- experts, context parallelism, FP8, multi-latent attention --------------------------------------------------------

@rule
def experts_divisible_by_expert_size(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """model.num_experts is divisible by parallel.expert_size (each EP rank holds num_experts / EP experts)."""
    e = r.model.num_experts
    if e is not None and e % lay.expert_size:
        yield Violation("parallel.expert_size", lay.expert_size, f"must divide model.num_experts={e}",
                        _try(divisors(e)))


@rule
def expert_layout_fits(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """expert_size x expert_tensor_size divides tensor x context x data; expert biases need expert_tensor_size 1."""
    if r.model.num_experts is None:
        return
    dense = lay.world_size // lay.pipeline_size if lay.world_size % lay.pipeline_size == 0 else 0
    ep, etp = lay.expert_size, lay.expert_tensor_size
    if dense and dense % (ep * etp):
        fits = [x for x in divisors(dense) if dense % (x * etp) == 0]
        where = f"must divide tensor x context x data = world / pipeline = {dense} (world = PP x ETP x EP x EDP)"
        if fits:
            yield Violation("parallel.expert_size", ep, f"x parallel.expert_tensor_size={etp} {where}",
                            _fix(f"with expert_tensor_size {etp} {_try(fits)} for expert_size", fits))
        else:  # no expert_size fits this expert_tensor_size: the value to change is that one
            yield Violation("parallel.expert_tensor_size", etp, f"x parallel.expert_size={ep} {where}",
                            _fix(f"no expert_size fits it: {_try(divisors(dense))} for expert_tensor_size",
                                 divisors(dense)))
    if r.model.add_bias_linear and r.model.moe_shared_expert_intermediate_size is not None:
        yield Violation("model.moe_shared_expert_intermediate_size", r.model.moe_shared_expert_intermediate_size,
                        "cannot be combined with model.add_bias_linear (Megatron-core's shared experts have no "
                        "biases)", "set add_bias_linear: false or no shared expert")
    if r.model.add_bias_linear and etp > 1:
        yield Violation("parallel.expert_tensor_size", etp, "must be 1 when the experts have biases "
                        "(model.add_bias_linear; Megatron-core has no expert bias under ETP > 1)",
                        _fix("set expert_tensor_size: 1 (or null), or add_bias_linear: false", [1]))


@rule
def expert_parallel_needs_experts(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """expert_size > 1 and expert_tensor_size need model.num_experts; the moe_* options need experts too."""
    m, p = r.model, r.parallel
    if m.num_experts is not None:
        return
    if p.expert_size > 1:
        yield Violation("parallel.expert_size", p.expert_size, "needs a model with experts (model.num_experts is null)",
                        "set model.num_experts (a multiple of it) or expert_size: 1")
    elif p.expert_tensor_size is not None:
        yield Violation("parallel.expert_tensor_size", p.expert_tensor_size,
                        "needs a model with experts (model.num_experts is null)",
                        "set model.num_experts or expert_tensor_size: null")
    elif m.moe_shared_expert_intermediate_size is not None or m.moe_ffn_hidden_size is not None:
        field = ("moe_shared_expert_intermediate_size" if m.moe_shared_expert_intermediate_size is not None
                 else "moe_ffn_hidden_size")
        yield Violation(f"model.{field}", getattr(m, field), "needs model.num_experts (a dense model has no experts)",
                        f"set model.num_experts or {field}: null")


@rule
def moe_routing(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """moe_router_topk <= num_experts, a moe_layer_freq list has num_layers entries, expert bias needs sigmoid."""
    m = r.model
    if m.num_experts is None:
        return
    if m.moe_router_topk > m.num_experts:
        yield Violation("model.moe_router_topk", m.moe_router_topk, f"exceeds model.num_experts={m.num_experts}",
                        f"use 1..{m.num_experts}")
    freq = m.moe_layer_freq
    if isinstance(freq, list) and len(freq) != m.num_layers:
        yield Violation("model.moe_layer_freq", freq,
                        f"has {len(freq)} entries, not one 0/1 per layer (model.num_layers={m.num_layers})",
                        f"give {m.num_layers} entries, or an int N (every N-th layer is MoE)")
    elif isinstance(freq, int) and freq > m.num_layers:
        yield Violation("model.moe_layer_freq", freq, f"exceeds model.num_layers={m.num_layers} (only layer 0 would "
                        "be MoE)", f"use 1..{m.num_layers}")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        yield Violation("model.moe_router_enable_expert_bias", True,
                        f"needs model.moe_router_score_function=sigmoid, not {m.moe_router_score_function}",
                        "set moe_router_score_function: sigmoid or the bias false")


@rule
def moe_sequence_parallel(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A model with experts and tensor_size > 1 needs sequence_parallel (as Megatron-LM requires)."""
    if r.model.num_experts is not None and lay.tensor_size > 1 and not r.parallel.sequence_parallel:
        yield Violation("parallel.sequence_parallel", False,
                        f"must be true for a model with experts and parallel.tensor_size={lay.tensor_size}",
                        "set sequence_parallel: true, or tensor_size: 1")


@rule
def moe_comm_overlap(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """overlap_moe_expert_parallel_comm and moe_shared_expert_overlap keep Megatron-core 0.16's preconditions: experts
    split over EP > 1 (a shared expert), the alltoall dispatcher, bf16/fp16, GPUs (CUDA streams), no full
    recomputation, VPP with PP > 1, not both; overlap_moe_expert_parallel_comm is then refused until the engine
    builds the combined 1F1B schedule plan under a GPU test."""
    m, p, t = r.model, r.parallel, r.training
    if not backends.of(r).moe_comm_overlap:  # backend_features refuses the fields there
        return
    if p.overlap_moe_expert_parallel_comm:
        field, needs = "parallel.overlap_moe_expert_parallel_comm", None
        if m.num_experts is None:
            needs = ("needs a model with experts (model.num_experts is null)", "set it false")
        elif lay.expert_size == 1:
            needs = ("needs parallel.expert_size > 1 (it hides the expert-parallel all-to-all)",
                     "set expert_size > 1 or this false")
        elif m.moe_token_dispatcher_type != "alltoall":
            needs = (f"needs model.moe_token_dispatcher_type=alltoall, not {m.moe_token_dispatcher_type}",
                     "set moe_token_dispatcher_type: alltoall or this false")
        elif t.precision == "fp32":
            needs = ("needs training.precision bf16 or fp16, not fp32", "use precision: bf16 or set this false")
        elif not r.cluster.uses_gpus:
            needs = ("needs GPUs (CUDA streams); CPU ranks (cluster.gpu_type=cpu) have none", "set it false")
        elif t.recompute_granularity == "full":
            needs = ("cannot be combined with training.recompute_granularity=full (Megatron-core refuses it)",
                     "use selective recomputation (recompute_modules) or set this false")
        elif lay.pipeline_size > 1 and not lay.interleaved:
            needs = (f"needs parallel.virtual_pipeline_size > 1 with pipeline_size={lay.pipeline_size} (Megatron-core "
                     "overlaps in the interleaved schedule only)", "set virtual_pipeline_size (e.g. 2) or this false")
        elif p.moe_shared_expert_overlap:
            needs = ("cannot be combined with parallel.moe_shared_expert_overlap (Megatron-core refuses both)",
                     "set moe_shared_expert_overlap: false (this overlap hides the shared expert too)")
        else:  # Megatron-core would accept it; hpc_tools' side is untried (issue 46 item 1)
            needs = ("is not supported yet: Megatron-core's combined 1F1B schedule asks the forward step for a "
                     "schedule plan (return_schedule_plan=True, CUDA streams only), which hpc_tools' Megatron "
                     "engine does not build and no GPU test covers",
                     "set it false (moe_shared_expert_overlap hides the all-to-all behind a shared expert)")
        if needs:
            yield Violation(field, True, *needs)
    if p.moe_shared_expert_overlap and not p.overlap_moe_expert_parallel_comm:
        field, needs = "parallel.moe_shared_expert_overlap", None
        if m.moe_shared_expert_intermediate_size is None:
            needs = ("needs a shared expert (model.moe_shared_expert_intermediate_size is null): Megatron-core "
                     "would ignore it", "set it false")
        elif m.moe_token_dispatcher_type != "alltoall":
            needs = (f"needs model.moe_token_dispatcher_type=alltoall, not {m.moe_token_dispatcher_type}",
                     "set moe_token_dispatcher_type: alltoall or this false")
        elif not r.cluster.uses_gpus:
            needs = ("needs GPUs (a CUDA stream for the shared expert); CPU ranks (cluster.gpu_type=cpu) have none",
                     "set it false")
        if needs:
            yield Violation(field, True, *needs)


@rule
def context_parallel_sequence(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """model.seq_length is divisible by 2 x context_size (x tensor_size with sequence parallelism)."""
    cp = lay.context_size
    if cp == 1:
        return
    step = 2 * cp * (lay.tensor_size if r.parallel.sequence_parallel else 1)
    if r.model.seq_length % step:
        what = "2 x parallel.context_size" + (" x tensor_size (sequence parallel)" if step != 2 * cp else "")
        yield Violation("model.seq_length", r.model.seq_length, f"must be divisible by {what} = {step}",
                        f"use a multiple of {step}, e.g. {-(-r.model.seq_length // step) * step}")


@rule
def context_parallel_needs_te(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """context_size > 1 needs Transformer Engine attention: GPU ranks, transformer_impl not local."""
    if lay.context_size == 1 or not backends.of(r).context_parallel:
        return
    if not r.cluster.uses_gpus:
        yield Violation("parallel.context_size", lay.context_size, "needs Transformer Engine attention (the ring "
                        "exchange of keys and values), which CPU ranks (cluster.gpu_type=cpu) do not have",
                        "set context_size: 1 on CPU ranks")
    elif r.backend.megatron.transformer_impl == "local":
        yield Violation("parallel.context_size", lay.context_size, "needs Transformer Engine attention, not "
                        "backend.megatron.transformer_impl=local", "set transformer_impl: auto or transformer_engine")
    else:  # TE's unfused attention has no context parallelism, and its flash and fused ones take bf16/fp16 only
        if r.training.precision == "fp32":
            yield Violation("parallel.context_size", lay.context_size, "needs Transformer Engine's flash or fused "
                            "attention, which take bf16/fp16 only: with training.precision=fp32 TE has no attention "
                            "backend for context parallelism", "use training.precision: bf16, or context_size: 1")
        if not r.backend.megatron.use_flash_attention:
            yield Violation("parallel.context_size", lay.context_size, "needs Transformer Engine's flash or fused "
                            "attention: backend.megatron.use_flash_attention=false leaves TE's unfused attention, "
                            "which has no context parallelism", "set use_flash_attention: true, or context_size: 1")


@rule
def multi_latent_attention_needs_te(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """multi_latent_attention on GPUs needs Transformer Engine layers (transformer_impl not local): Megatron-core's
    MLA passes k_channels/v_channels to the local DotProductAttention, which takes neither."""
    if not r.model.multi_latent_attention or not backends.of(r).multi_latent_attention or not r.cluster.uses_gpus:
        return
    if r.backend.megatron.transformer_impl == "local":
        yield Violation("model.multi_latent_attention", True, "needs Transformer Engine layers on GPUs (Megatron-"
                        "core's local attention takes no k_channels/v_channels), not "
                        "backend.megatron.transformer_impl=local",
                        "set transformer_impl: auto or transformer_engine, or multi_latent_attention: false")


def megatron_attentions(r: Recipe) -> frozenset[str]:
    """The attention backends (megatron-core's ``AttnBackend`` names) a rank of this Megatron recipe may build:
    ``hpc_tools/train/megatron/layers.py``'s ``layer_plan`` over a node with and one without Transformer Engine."""
    mg = r.backend.megatron
    if not r.cluster.uses_gpus or mg.transformer_impl == "local":
        return frozenset({"local"})
    te = "auto" if mg.use_flash_attention else "unfused"
    return frozenset({te} if mg.transformer_impl == "transformer_engine" else {te, "local"})  # (no TE: local layers)


@rule
def attention_environment(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """cluster.setup.env sets no NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN other than what Megatron-core
    sets from the recipe's attention (it asserts at model build otherwise; te_support.NVTE_BY_ATTENTION)."""
    if backends.of(r).layers != "megatron":
        return
    clash = te_support.nvte_conflict(megatron_attentions(r), r.cluster.setup.env)
    if clash:
        name, value, expected = clash
        yield Violation(f"cluster.setup.env.{name}", value, "makes Megatron-core's attention check assert at model "
                        f"build: it sets {name}={expected} itself from the recipe's attention "
                        "(backend.megatron.use_flash_attention, transformer_impl)",
                        f"remove {name} from cluster.setup.env and the site file; use_flash_attention: false "
                        "chooses Transformer Engine's unfused attention")


# GPUs without FP8 tensor cores (Ampere and older) and GPUs with MXFP8 (Blackwell), matched on the lower-cased
# gpu_type as profiling/peaks.py matches device names (`A100`, `a100-sxm4-80gb`, `V100-PCIe`); the peaks table lists
# an fp8 peak exactly for the GPUs not refused here (a unit test holds the two together).
_NO_FP8 = re.compile(r"(^|[^a-z0-9])(a100|a10g?|a30|a40|a6000|v100|t4|p100)($|[^0-9a-z])")
_MXFP8 = re.compile(r"(^|[^a-z0-9])g?b[23]00($|[^0-9])")
FP8_MULTIPLE = 16


def gpu_has_fp8(gpu_type: str) -> bool:
    """Whether ``gpu_type`` has FP8 tensor cores (Hopper, Ada, Blackwell, MI300): all but Ampere and older."""
    return not _NO_FP8.search(gpu_type.lower().replace("_", "-").replace(" ", "-"))


def gpu_has_mxfp8(gpu_type: str) -> bool:
    """Whether ``gpu_type`` has MXFP8 (block-scaled FP8) tensor cores: Blackwell."""
    return bool(_MXFP8.search(gpu_type.lower().replace("_", "-").replace(" ", "-")))


@rule
def fp8_supported(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """training.fp8 needs FP8 GPUs (mxfp8: Blackwell; blockwise: CUDA >= 12.9), bf16/fp16, GEMM sizes x 16."""
    # blockwise's compute capability >= 9.0 and torch built for CUDA >= 12.9 (Transformer Engine 2.11) are the node's:
    # the rank refuses them at start and doctor on the node (te_support.blockwise_refusal)
    t, c, m = r.training, r.cluster, r.model
    if t.fp8 is None or not backends.of(r).fp8:
        return
    if not c.uses_gpus:
        yield Violation("training.fp8", t.fp8, "needs GPUs with FP8 tensor cores; CPU ranks have none",
                        "set training.fp8: null for cluster.gpu_type=cpu")
        return
    if not gpu_has_fp8(c.gpu_type):
        yield Violation("training.fp8", t.fp8, f"needs FP8 tensor cores, which cluster.gpu_type={c.gpu_type} lacks "
                        "(Ampere and older)", "use H100/H200/B200-class GPUs or set training.fp8: null")
        return
    if t.fp8_recipe == "mxfp8" and not gpu_has_mxfp8(c.gpu_type):
        yield Violation("training.fp8_recipe", "mxfp8", f"needs Blackwell GPUs, not cluster.gpu_type={c.gpu_type}",
                        "use fp8_recipe: delayed or tensorwise (blockwise: with a torch built for CUDA >= 12.9)")
    if t.precision == "fp32":
        yield Violation("training.precision", "fp32", "cannot be combined with training.fp8 (FP8 GEMMs run inside "
                        "bf16/fp16 training)", "use precision: bf16")
    dims = {"model.hidden_size": m.hidden_size, "model.ffn_hidden_size": m.ffn_hidden_size // lay.tensor_size}
    if m.num_experts is not None:
        dims["model.moe_ffn_hidden_size"] = (m.moe_ffn_hidden_size or m.ffn_hidden_size) // lay.expert_tensor_size
    bad = next(((f, v) for f, v in dims.items() if v % FP8_MULTIPLE), None)
    if bad:
        field, per_gpu = bad
        shard = "" if field == "model.hidden_size" else " per GPU"
        yield Violation(field, getattr(m, field.split(".")[1]), f"gives a GEMM dimension{shard} of {per_gpu}, not a "
                        f"multiple of {FP8_MULTIPLE} as FP8 GEMMs need", f"use a multiple of {FP8_MULTIPLE}"
                        f"{' x the tensor-parallel size' if shard else ''}, or training.fp8: null")


@rule
def multi_latent_attention_shape(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """multi_latent_attention needs RoPE and no grouped-query attention; q_lora_rank only with it."""
    m = r.model
    if not m.multi_latent_attention:
        if m.q_lora_rank is not None:
            yield Violation("model.q_lora_rank", m.q_lora_rank, "is read only with model.multi_latent_attention=true",
                            "set multi_latent_attention: true or q_lora_rank: null")
        return
    if m.position_embedding != "rope":
        yield Violation("model.position_embedding", m.position_embedding, "must be rope with "
                        "model.multi_latent_attention (its qk_pos_emb_head_dim part carries RoPE)",
                        "set position_embedding: rope")
    if m.num_query_groups != m.num_attention_heads:
        yield Violation("model.num_query_groups", m.num_query_groups, "has no meaning with "
                        "model.multi_latent_attention (every head has its own keys and values from the latent)",
                        "set num_query_groups: null")


# --- backends ---------------------------------------------------------------------------------------------------------

def _others(feature: str) -> str:
    return " or ".join(backends.with_feature(feature))


@rule
def backend_features(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """The parallel features a recipe asks for are ones its backend has (the backend table)."""
    row, kind = backends.of(r), r.backend.kind
    if not row.tensor_parallel and lay.tensor_size != 1:
        yield Violation("parallel.tensor_size", lay.tensor_size, f"must be 1 with backend.kind={kind}",
                        f"use backend.kind: {_others('tensor_parallel')} for tensor parallelism")
    if not row.sequence_parallel and r.parallel.sequence_parallel:
        yield Violation("parallel.sequence_parallel", True, f"is not available with backend.kind={kind}",
                        f"set it false, or use backend.kind: {_others('sequence_parallel')}")
    if not row.pipeline_parallel and lay.pipeline_size != 1:
        yield Violation("parallel.pipeline_size", lay.pipeline_size, f"must be 1 with backend.kind={kind} (every rank "
                        "holds every layer)", f"use backend.kind: {_others('pipeline_parallel')} for pipelines")
    for end, n in (("first", r.parallel.num_layers_in_first_pipeline_stage),
                   ("last", r.parallel.num_layers_in_last_pipeline_stage)):
        if n is not None and not row.uneven_pipeline:
            yield Violation(f"parallel.num_layers_in_{end}_pipeline_stage", n,
                            f"is not available with backend.kind={kind} (it has no uneven pipeline stages)",
                            f"set it null, or use backend.kind: {_others('uneven_pipeline')} for uneven stages")
            break
    if not row.interleaved_pipeline and r.parallel.virtual_pipeline_size not in (None, 1):
        yield Violation("parallel.virtual_pipeline_size", r.parallel.virtual_pipeline_size,
                        f"is not supported by backend.kind={kind}'s pipeline",
                        f"set it null, or use backend.kind: {_others('interleaved_pipeline')}")
    if not row.selective_recompute and r.training.recompute_granularity == "selective":
        yield Violation("training.recompute_granularity", "selective", f"is not available with backend.kind={kind}",
                        f"use full or none, or backend.kind: {_others('selective_recompute')}")
    if not row.recompute_modules and r.training.recompute_modules is not None:
        yield Violation("training.recompute_modules", r.training.recompute_modules,
                        f"is not available with backend.kind={kind}",
                        f"set it null, or use backend.kind: {_others('recompute_modules')}")
    overlaps = {"parallel.overlap_moe_expert_parallel_comm": r.parallel.overlap_moe_expert_parallel_comm,
                "parallel.moe_shared_expert_overlap": r.parallel.moe_shared_expert_overlap}
    for path in (p for p, on in overlaps.items() if on and not row.moe_comm_overlap):
        yield Violation(path, True, f"is not available with backend.kind={kind}",
                        f"set it false, or use backend.kind: {_others('moe_comm_overlap')}")
    if not row.experts and r.model.num_experts is not None:
        yield Violation("model.num_experts", r.model.num_experts, f"is not available with backend.kind={kind} (it "
                        "would train a dense model)", f"use backend.kind: {_others('experts')} for experts")
    if not row.expert_parallel and lay.expert_size != 1:
        yield Violation("parallel.expert_size", lay.expert_size, f"must be 1 with backend.kind={kind}",
                        f"use backend.kind: {_others('expert_parallel')} for expert parallelism")
    if not row.context_parallel and lay.context_size != 1:
        yield Violation("parallel.context_size", lay.context_size, f"must be 1 with backend.kind={kind}",
                        f"use backend.kind: {_others('context_parallel')} for context parallelism")
    if not row.fp8 and r.training.fp8 is not None:
        yield Violation("training.fp8", r.training.fp8, f"is not available with backend.kind={kind}",
                        f"set it null, or use backend.kind: {_others('fp8')} (FP8 through Transformer Engine)")
    if not row.multi_latent_attention and r.model.multi_latent_attention:
        yield Violation("model.multi_latent_attention", True, f"is not available with backend.kind={kind}",
                        f"set it false, or use backend.kind: {_others('multi_latent_attention')}")
    if r.checkpoint.async_save and not row.async_save:
        why = f" ({row.no_async_save_why})" if row.no_async_save_why else ""
        yield Violation("checkpoint.async_save", True, f"is not available with backend.kind={kind}{why}",
                        f"set it false, or use backend.kind: {_others('async_save')}")
    if r.checkpoint.init_from_hf and not row.reads_init_from_hf:
        yield Violation("checkpoint.init_from_hf", r.checkpoint.init_from_hf,
                        f"is read by backend.kind={_others('reads_init_from_hf')} only, not {kind}",
                        "for deepspeed set backend.deepspeed.pretrained_path to the folder instead")


@rule
def deepspeed_layout(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """DeepSpeed's pipeline only with ZeRO stage 0 or 1, and not from a pretrained folder."""
    if backends.of(r).options != "deepspeed":
        return
    ds = r.backend.deepspeed
    if lay.pipeline_size > 1 and ds.zero_stage >= 2:
        yield Violation("backend.deepspeed.zero_stage", ds.zero_stage,
                        f"cannot be combined with DeepSpeed's pipeline (parallel.pipeline_size={lay.pipeline_size}); "
                        "DeepSpeed refuses ZeRO-2/3 with pipeline parallelism",
                        "use zero_stage 0 or 1, or pipeline_size: 1")
    if lay.pipeline_size > 1 and ds.pretrained_path:
        yield Violation("backend.deepspeed.pretrained_path", ds.pretrained_path,
                        "cannot be split into DeepSpeed pipeline stages", "use pipeline_size: 1")


@rule
def deepspeed_offload(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Optimizer offload needs ZeRO >= 1, parameter offload ZeRO-3, NVMe offload an nvme_path."""
    if backends.of(r).options != "deepspeed":
        return
    ds = r.backend.deepspeed
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        yield Violation("backend.deepspeed.offload_optimizer", ds.offload_optimizer, "needs zero_stage >= 1",
                        "set backend.deepspeed.zero_stage to 1, 2 or 3")
    if ds.offload_param != "none" and ds.zero_stage != 3:
        yield Violation("backend.deepspeed.offload_param", ds.offload_param, "needs zero_stage 3",
                        "set backend.deepspeed.zero_stage: 3 or offload_param: none")
    if "nvme" in (ds.offload_optimizer, ds.offload_param) and not ds.nvme_path:
        yield Violation("backend.deepspeed.nvme_path", None, "is required for nvme offload",
                        "give a local NVMe folder, e.g. /local_nvme")


# The Hugging Face class behind each family fixes these shapes (backends whose row has hf_model_classes).
HF_FAMILY_SHAPE = {
    "gpt": {"normalization": "LayerNorm", "activation": "gelu", "position_embedding": "learned_absolute"},
    "llama": {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding": "rope"},
}


@rule
def deepspeed_model_expressible(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Backends that build Hugging Face GPT-2 / LLaMA classes: the model section must be one they can express."""
    if not backends.of(r).hf_model_classes:
        return
    if backends.of(r).options == "deepspeed" and r.backend.deepspeed.pretrained_path:  # the folder's architecture
        return
    m, kind = r.model, r.backend.kind
    for key, needed in HF_FAMILY_SHAPE[m.family].items():
        if getattr(m, key) != needed:
            yield Violation(f"model.{key}", getattr(m, key),
                            f"is not available for model.family={m.family} with backend.kind={kind}",
                            f"its Hugging Face class uses {needed}; use that, the other family, or "
                            "backend.kind: megatron")
    if m.family == "gpt" and m.num_query_groups != m.num_attention_heads:
        yield Violation("model.num_query_groups", m.num_query_groups,
                        f"needs model.family=llama with backend.kind={kind}",
                        "GPT-2 has plain multi-head attention; set it null")
    if m.family == "gpt" and not m.add_bias_linear:
        yield Violation("model.add_bias_linear", False,
                        f"is not available for model.family=gpt with backend.kind={kind}",
                        "GPT-2 always has biases; use family: llama")
    if m.family == "llama" and m.hidden_dropout > 0:
        yield Violation("model.hidden_dropout", m.hidden_dropout,
                        f"is not available for model.family=llama with backend.kind={kind}",
                        "LlamaForCausalLM has no hidden dropout; set it 0")


@rule
def fsdp_mesh(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """FSDP: hybrid_shard's shard groups divide the world into 2 or more replicas; 16-bit training in bf16."""
    if backends.of(r).options != "fsdp":
        return
    fs, world = r.backend.fsdp, lay.world_size
    if lay.tensor_size > 1:
        node = r.cluster.gpus_per_node
        if node % lay.tensor_size:
            yield Violation("parallel.tensor_size", lay.tensor_size, f"must divide cluster.gpus_per_node={node} "
                            "(tensor parallelism stays inside a node)", _try(divisors(node)))
        if fs.strategy != "full_shard":
            yield Violation("backend.fsdp.strategy", fs.strategy, "cannot be combined with tensor parallelism "
                            f"(parallel.tensor_size={lay.tensor_size})", "use strategy: full_shard, or tensor_size: 1")
        if r.model.family != "llama":
            yield Violation("model.family", r.model.family, "has no tensor-parallel plan with backend.kind=fsdp "
                            "(GPT-2's fused attention projection)", "use family: llama, or tensor_size: 1")
    if fs.strategy == "hybrid_shard":
        shard = fs.shard_size or r.cluster.gpus_per_node
        field = "backend.fsdp.shard_size" if fs.shard_size else "cluster.gpus_per_node (the default shard_size)"
        if world % shard or world // shard < 2:
            fits = [d for d in divisors(world) if d < world]
            yield Violation(field, shard, f"must divide the {world} ranks into 2 or more replica groups for "
                            "backend.fsdp.strategy=hybrid_shard", f"set backend.fsdp.shard_size to one of "
                            f"{', '.join(map(str, fits[-4:])) or 'none (1 rank)'}, use cluster.nodes > 1, or "
                            "strategy: full_shard")
    elif fs.shard_size is not None:
        yield Violation("backend.fsdp.shard_size", fs.shard_size, f"is read by strategy hybrid_shard only, not "
                        f"{fs.strategy}", "set it null, or strategy: hybrid_shard")
    if r.training.precision == "fp16":
        yield Violation("training.precision", "fp16", "is not available with backend.kind=fsdp (no loss scaler)",
                        "use bf16 (FSDP2's MixedPrecisionPolicy) or fp32")


@rule
def horovod_precision(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Horovod: fp32, or bf16 autocast (no loss scaler for fp16)."""
    if backends.of(r).options == "horovod" and r.training.precision == "fp16":
        yield Violation("training.precision", "fp16", "is not available with backend.kind=horovod (no loss scaler)",
                        "use bf16 (autocast, as DDP) or fp32")


@rule
def megatron_overlap(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """overlap_param_gather needs the distributed optimizer and overlap_grad_reduce."""
    mg = r.backend.megatron
    needs_both = not (mg.distributed_optimizer and mg.overlap_grad_reduce)
    if backends.of(r).options == "megatron" and mg.overlap_param_gather and needs_both:
        yield Violation("backend.megatron.overlap_param_gather", True,
                        "needs distributed_optimizer: true and overlap_grad_reduce: true",
                        "enable both or set it false")


@rule
def precision_on_device(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """fp16 needs GPUs (CPUs here have no fp16 kernels for training)."""
    if r.training.precision == "fp16" and not r.cluster.uses_gpus:
        yield Violation("training.precision", "fp16", "is not supported on CPU ranks (cluster.gpu_type=cpu)",
                        "use bf16 or fp32")


# --- training, data, cluster ------------------------------------------------------------------------------------------

@rule
def lr_schedule(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """min_lr <= lr and warm-up no longer than the decay."""
    t = r.training
    if t.min_lr > t.lr:
        yield Violation("training.min_lr", t.min_lr, f"exceeds training.lr={t.lr}", f"use a value <= {t.lr}")
    decay = t.lr_decay_iters or t.train_iters
    if t.lr_warmup_iters > decay:
        yield Violation("training.lr_warmup_iters", t.lr_warmup_iters, f"exceeds the decay length {decay}",
                        f"use at most {decay}")


@rule
def data_sources(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """source: files needs paths, source: indexed a blend; the byte tokenizer needs vocab_size >= 257."""
    if r.data.source == "files" and not r.data.paths:
        yield Violation("data.paths", [], "is empty but data.source=files",
                        "list local files or folders, or use source: synthetic")
    if r.data.source == "indexed" and not r.data.blend:
        yield Violation("data.blend", [], "is empty but data.source=indexed",
                        "list prepared datasets as {path: PREFIX, weight: W} (python -m hpc_tools data prepare)")
    if r.data.tokenizer == "byte" and r.model.vocab_size < 257:
        yield Violation("model.vocab_size", r.model.vocab_size, "is below the byte tokenizer's 257 tokens",
                        "use vocab_size >= 257")


@rule
def checkpoint_local_tier(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """The node-local checkpoint tier has both its folder and its interval, an absolute folder (a relative one would
    be under the folder the job starts in, on the shared file system) and an interval that some save falls on
    (below train_iters, not a multiple of the shared tier's interval, whose saves take the steps due on both)."""
    ck, iters = r.checkpoint, r.training.train_iters
    if ck.local_interval_iters and not ck.local_dir:
        yield Violation("checkpoint.local_interval_iters", ck.local_interval_iters, "needs checkpoint.local_dir",
                        f"set checkpoint.local_dir (e.g. {LOCAL_DIR_EXAMPLE}) or local_interval_iters: 0")
    if ck.local_dir and not ck.local_interval_iters:
        yield Violation("checkpoint.local_dir", ck.local_dir, "is never written: checkpoint.local_interval_iters is 0",
                        "set checkpoint.local_interval_iters (e.g. 10) or remove local_dir")
    if ck.local_dir and not ck.local_dir.startswith(("/", "~", "$")):
        yield Violation("checkpoint.local_dir", ck.local_dir, "is a relative path: it would be under the folder the "
                        "job starts in, on the shared file system, not on a node-local disk",
                        f"give an absolute node-local path, e.g. {LOCAL_DIR_EXAMPLE}")
    if ck.local_dir and ck.local_interval_iters >= iters:
        yield Violation("checkpoint.local_interval_iters", ck.local_interval_iters, f"is never reached: "
                        f"training.train_iters={iters} ends first (the last save goes to checkpoint.dir)",
                        f"use fewer than {iters} steps, or local_interval_iters: 0")
    elif ck.local_dir and ck.local_interval_iters and ck.interval_iters and \
            ck.local_interval_iters % ck.interval_iters == 0:
        yield Violation("checkpoint.local_interval_iters", ck.local_interval_iters, "falls only on steps that "
                        f"checkpoint.interval_iters={ck.interval_iters} saves to checkpoint.dir (a step due on both "
                        "tiers saves there): the local tier is never written",
                        f"use a value below {ck.interval_iters}" if ck.interval_iters > 1 else
                        "raise checkpoint.interval_iters, or remove the local tier")
    if ck.local_replicate_interface is not None and not _IFNAMES.fullmatch(ck.local_replicate_interface):
        yield Violation("checkpoint.local_replicate_interface", ck.local_replicate_interface, "is not a network "
                        "interface name (Linux names: 1-15 letters, digits or ._:-, several comma-separated as "
                        "GLOO_SOCKET_IFNAME takes them)", "give the name `ip -br addr` shows, e.g. ib0, or remove it")


_IFNAMES = re.compile(r"[A-Za-z0-9_.:-]{1,15}(,[A-Za-z0-9_.:-]{1,15})*")
"""GLOO_SOCKET_IFNAME's form: Linux interface names (at most IFNAMSIZ - 1 = 15 bytes), comma-separated."""


# A node-local folder named by a variable Slurm itself sets in every job ($SLURM_TMPDIR is a site convention).
LOCAL_DIR_EXAMPLE = "/tmp/$SLURM_JOB_ID/ckpt"


def _written(section, name: str) -> bool:
    """Whether the recipe (file, site file, profile or --set) wrote the field, rather than leaving its default."""
    return name in section.model_fields_set


@rule
def settings_take_effect(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A value written for a feature the recipe does not turn on does nothing, and is refused: fp8_recipe without
    fp8, the router's moe_* options without num_experts, a moe_layer_freq list with no MoE layer, recompute_method
    or recompute_num_layers without full recomputation, local_replicate without a local tier. A feature turned off
    on purpose (fp8: null, num_experts: null, recompute_granularity, local_dir: null written, as a profile does)
    leaves its options alone."""
    t, m, ck = r.training, r.model, r.checkpoint
    if t.fp8 is None and _written(t, "fp8_recipe") and not _written(t, "fp8"):
        yield Violation("training.fp8_recipe", t.fp8_recipe, "is read only with training.fp8 (null: no FP8; "
                        "fp8_recipe does not turn it on)", "set training.fp8: e4m3 or hybrid, or remove fp8_recipe")
    if t.recompute_granularity != "full" and not _written(t, "recompute_granularity"):
        for name in ("recompute_method", "recompute_num_layers"):
            if _written(t, name):
                yield Violation(f"training.{name}", getattr(t, name), "is read only with "
                                "training.recompute_granularity=full (it does not turn recomputation on)",
                                f"set recompute_granularity: full, or remove {name}")
                break
    if ck.local_dir is None and _written(ck, "local_replicate") and not _written(ck, "local_dir"):
        yield Violation("checkpoint.local_replicate", ck.local_replicate, "is read only with checkpoint.local_dir "
                        "(the node-local tier it copies)", f"set checkpoint.local_dir (e.g. {LOCAL_DIR_EXAMPLE}) and "
                        "local_interval_iters, or remove local_replicate")
    if m.num_experts is None and not _written(m, "num_experts"):
        router = [f for f in ("moe_router_topk", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                              "moe_router_score_function", "moe_router_enable_expert_bias",
                              "moe_token_dispatcher_type", "moe_expert_capacity_factor", "moe_grouped_gemm",
                              "moe_layer_freq") if _written(m, f)]
        if router:
            yield Violation(f"model.{router[0]}", getattr(m, router[0]), "is read only with model.num_experts (a "
                            "dense model has no experts)", f"set model.num_experts, or remove {router[0]}")
    if m.num_experts is not None and isinstance(m.moe_layer_freq, list) and m.moe_layer_freq and \
            not any(m.moe_layer_freq):
        yield Violation("model.moe_layer_freq", m.moe_layer_freq, f"has no 1: no layer is MoE, and the "
                        f"model.num_experts={m.num_experts} experts are never built (a dense model)",
                        "put a 1 at each MoE layer, or set num_experts: null")


# The no-op rules that need to know which layer wrote a value (another kind's options, fp8_recipe beside fp8: null),
# registered here, after settings_take_effect (noops imports nothing of this module: no import cycle)
from hpc_tools.recipe.noops import fp8_recipe_without_fp8, other_backend_options  # noqa: E402

rule(fp8_recipe_without_fp8)
rule(other_backend_options)


@rule
def signal_before_limit(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """The preemption signal comes before the time limit."""
    c = r.cluster
    if c.signal_delay_s >= c.time_limit_min * 60:
        yield Violation("cluster.signal_delay_s", c.signal_delay_s,
                        f"must be shorter than cluster.time_limit={c.time_limit} ({c.time_limit_min * 60:.0f} s)",
                        "lower it or raise the time limit")


@rule
def spares_need_restarts(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Spare nodes are used by in-job restarts only."""
    c = r.cluster
    if c.spare_nodes and not c.restarts:
        yield Violation("cluster.spare_nodes", c.spare_nodes, "are only used by in-job restarts, and "
                        "cluster.restarts is 0", "set cluster.restarts (e.g. 2) or spare_nodes: 0")


@note
def spares_beyond_nodes(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """More spare nodes than nodes: valid, but the job holds more idle nodes than training ones."""
    c = r.cluster
    if c.restarts and c.spare_nodes > c.nodes:
        yield Violation("cluster.spare_nodes", c.spare_nodes, f"exceeds cluster.nodes={c.nodes}: the job holds "
                        f"{c.nodes + c.spare_nodes} nodes, {c.spare_nodes} of them idle until a node fails",
                        f"fine if failures are that likely; else spare_nodes <= {c.nodes}")


@rule
def min_nodes_within_nodes(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Elastic training continues on fewer nodes than the layout's, never more."""
    c = r.cluster
    if c.min_nodes is not None and c.min_nodes > c.nodes:
        yield Violation("cluster.min_nodes", c.min_nodes, f"exceeds cluster.nodes={c.nodes}: it is the fewest nodes "
                        "the run may continue on after losing some", f"set min_nodes <= {c.nodes} (null: off)")


@rule
def elastic_needs_restarts(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Continuing on fewer nodes is a kind of in-job restart."""
    c = r.cluster
    if c.fewest_nodes < c.nodes and not c.restarts:
        yield Violation("cluster.min_nodes", c.min_nodes, f"continues on fewer than cluster.nodes={c.nodes} nodes at "
                        "an in-job restart, and cluster.restarts is 0", "set cluster.restarts (e.g. 2) or "
                        f"min_nodes: {c.nodes}")


@rule
def elastic_backend(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """A backend whose checkpoint cannot be resharded into fewer nodes cannot be elastic."""
    c, row = r.cluster, backends.of(r)
    if c.elastic and not row.elastic:
        yield Violation("cluster.min_nodes", c.min_nodes, f"backend.kind={r.backend.kind} cannot continue on fewer "
                        f"nodes: {row.no_elastic_why}", f"set min_nodes: {c.nodes}, or use backend.kind "
                        f"{' or '.join(backends.with_feature('elastic'))}")


RAY_BACKENDS = ("fsdp",)
"""The backends Ray Train launches (cluster.launcher: ray): the PyTorch-native one, any strategy (its rank program
makes its own process group; docs/ray.md)."""


@rule
def ray_launcher_backend(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Ray Train launches the PyTorch-native backend only (FSDP2, HSDP, DDP)."""
    if r.cluster.launcher == "ray" and r.backend.kind not in RAY_BACKENDS:
        yield Violation("cluster.launcher", "ray", f"launches backend.kind={' or '.join(RAY_BACKENDS)} only "
                        f"(PyTorch-native: FSDP2, HSDP, DDP), not backend.kind={r.backend.kind}",
                        f"use cluster.launcher: srun, or backend.kind: {RAY_BACKENDS[0]}")


@rule
def ray_launcher_container(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """The batch script starts Ray's nodes and driver on the hosts, never inside a container."""
    if r.cluster.launcher == "ray" and r.cluster.setup.container is not None:
        yield Violation("cluster.setup.container.kind", r.cluster.setup.container.kind, "is not started around the "
                        "Ray nodes and driver (cluster.launcher=ray runs them on the hosts)", "install Ray and "
                        "hpc_tools on the nodes (cluster.setup.venv or conda_env) and drop the container, or use "
                        "cluster.launcher: srun")


@note
def ray_no_time_limit_stop(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Ray runs get no stop signal before the time limit: the signal ends Ray's own processes before a checkpoint."""
    c = r.cluster
    if c.launcher == "ray":
        yield Violation("cluster.launcher", "ray", f"gets no stop signal before cluster.time_limit={c.time_limit} "
                        f"(Slurm's signal would end Ray's processes before any worker checkpoints): no stop "
                        f"checkpoint and no requeue at the limit, cluster.signal_delay_s is not used; the run resumes "
                        f"from its newest periodic checkpoint (checkpoint.interval_iters="
                        f"{r.checkpoint.interval_iters}) with `hpc_tools resume`", "use cluster.launcher: srun for a "
                        "checkpoint at the time limit, or a time limit the run fits in")


@rule
def switch_wait_needs_switches(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """cluster.switch_wait_min is the wait for cluster.switches, which must be set."""
    c = r.cluster
    if c.switch_wait_min is not None and c.switches is None:
        yield Violation("cluster.switch_wait_min", c.switch_wait_min, "is the wait for cluster.switches, which is "
                        "not set", "set cluster.switches (the most leaf switches the job may span) or remove "
                        "switch_wait_min")


@rule
def profiler_ranks_exist(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """torch_profiler.ranks are ranks of this job."""
    bad = [x for x in r.profiling.torch_profiler.ranks if not 0 <= x < lay.world_size]
    if r.profiling.torch_profiler.enabled and bad:
        yield Violation("profiling.torch_profiler.ranks", bad, f"are not ranks of a {lay.world_size}-rank job",
                        f"use ranks in 0..{lay.world_size - 1}")


@rule
def trackers_installed(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """An enabled tracking.wandb or tracking.mlflow needs its package installed."""
    from importlib.util import find_spec  # looked up, never imported: validate stays light

    if r.tracking.wandb is not None and r.tracking.wandb.enabled and find_spec("wandb") is None:
        yield Violation("tracking.wandb.enabled", True, "needs the 'wandb' package, which is not installed",
                        "pip install wandb, or set tracking.wandb.enabled=false")
    if r.tracking.mlflow is not None and r.tracking.mlflow.enabled and find_spec("mlflow") is None:
        yield Violation("tracking.mlflow.enabled", True, "needs the 'mlflow' package, which is not installed",
                        "pip install mlflow, or set tracking.mlflow.enabled=false")



@rule
def liger_needs_llama(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Liger Kernel is applied to Llama models only (apply_liger_kernel_to_llama)."""
    b = r.backend
    liger = {"fsdp": b.fsdp.liger, "deepspeed": b.deepspeed.liger, "horovod": b.horovod.liger}.get(b.kind, False)
    if liger and r.model.family != "llama":
        yield Violation(f"backend.{b.kind}.liger", True, f"patches Llama models only, not model.family="
                        f"{r.model.family}", f"use family: llama, or backend.{b.kind}.liger=false")


@note
def liger_on_cpu(r: Recipe, lay: ParallelLayout) -> Iterator[Violation]:
    """Liger Kernel on CPU ranks: its Triton kernels need CUDA, so the run keeps the plain layers."""
    b = r.backend
    liger = {"fsdp": b.fsdp.liger, "deepspeed": b.deepspeed.liger, "horovod": b.horovod.liger}.get(b.kind, False)
    if liger and not r.cluster.uses_gpus:
        yield Violation(f"backend.{b.kind}.liger", True, "does not apply on CPU ranks (Triton kernels need CUDA): "
                        "this run trains the plain PyTorch layers and loss", "fine for a CPU rehearsal")
