"""Auto-configuration: enumerate layouts and memory knobs for the recipe's nodes x GPUs, keep what fits and keeps the
recipe rules, rank by predicted step time.

Held fixed: the model, the cluster, the backend kind and the global batch (tokens per step; changing it would change
the training, not just its speed). Turned: TP (inside a node, dividing heads and query groups), PP (dividing the
layers), VPP, CP (sequences of 16k tokens or more, backends with context parallelism, GPUs), EP (dividing the
experts) and ETP (1 or TP) for models with experts, DP (what is left), micro batch, recomputation, and the
distributed optimizer (Megatron), ZeRO
stage and offload (DeepSpeed) or the FSDP strategy (full_shard, hybrid_shard with node-sized shard groups, ddp) and
reshard_after_forward; sequence parallelism is on whenever TP > 1 allows it (it dominates: same time in the
model, less memory). A candidate fits when its peak stays under the GPU memory less the headroom
(``hpc_tools.planner.hardware.headroom_bytes``, the same margin ``validate`` and ``submit`` keep). Candidates are scored
with the same memory and step-time model as ``plan``; the recipe rules (``hpc_tools.recipe.rules.check_recipe``)
are run on candidates in rank order, lazily, because every enumerated layout already satisfies the divisibility rules
by construction. What candidates share is computed once per search (``planner.memo``: a stage's activations, a
layer's terms), and a candidate next to one too big is ruled out by its model states alone when they already exceed
the memory (``memo.states_floor``): the counts and the ranking are those of the plain model, bit for bit.

Across backend kinds (``search_across``, ``plan --search --backends``): the same search once per trains-model row of
the backend table that is asked for, each on the recipe with that ``backend.kind`` (the Knobs carry the kind;
``apply_knobs`` writes that row's options section; its candidates are checked with the recipe rules as above), ranked
together. A kind whose every fitting configuration breaks a rule, or none of whose configurations fits, is dropped
with its reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterator

from hpc_tools import backends
from hpc_tools.errors import UserError, Violation
from hpc_tools.layout import ParallelLayout, uneven_splits
from hpc_tools.planner.arch import arch_for
from hpc_tools.planner.efficiency import resolve_efficiency
from hpc_tools.planner.hardware import GB, Hardware, hardware_for, headroom_bytes, headroom_note
from hpc_tools.planner.knobs import Knobs, apply_knobs
from hpc_tools.planner.memo import SearchMemo, states_floor
from hpc_tools.planner.memory import estimate_memory
from hpc_tools.planner.steptime import DEFAULT_EFFICIENCY, StepTime, estimate_step_time, step_flops

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

MAX_RULE_CHECKS = 5000  # candidates checked against the recipe rules before giving up
# Context parallelism is tried from 16k tokens per sequence (or when the recipe asks for it): below that the attention
# core is a small share of the step and the ring's transfers are small enough to be latency-bound.
CP_MIN_SEQ = 16384


@dataclass(frozen=True, slots=True)
class Candidate:
    knobs: Knobs
    memory_bytes: float
    peak_stage: int
    time: StepTime | None  # None for candidates that do not fit (not scored)

    @property
    def step_s(self) -> float:
        return self.time.total_s if self.time else float("inf")


@dataclass
class SearchResult:
    ranked: list[Candidate]  # fit, keep the rules, fastest first (top + the losers shown)
    top: int
    enumerated: int = 0
    too_big: int = 0
    smallest_too_big: Candidate | None = None
    broke_rules: list[tuple[Candidate, Violation]] = field(default_factory=list)
    fitting: int = 0
    elapsed_s: float = 0.0
    mem_bytes: float | None = None
    headroom_bytes: float = 0.0  # kept free of the GPU memory (hardware.headroom_bytes)
    headroom_note: str = ""
    kinds: list["KindOutcome"] = field(default_factory=list)  # per backend kind, across kinds only; [] otherwise
    # when nothing is ranked: which constraint emptied the search, what would admit a layout (planner/empty.WhyNone,
    # set by planner.empty.explain_search)
    why_none: Any = None

    def label(self, c: Candidate) -> str:
        """A candidate's configuration, led by its backend kind when the search ranked several kinds."""
        return f"{c.knobs.backend} {c.knobs.describe()}" if self.kinds else c.knobs.describe()

    def overrides(self, c: Candidate) -> list[str]:
        """``--set`` strings for a candidate (``backend.kind=...`` first when the search ranked several kinds)."""
        return [f"backend.kind={c.knobs.backend}", *c.knobs.overrides()] if self.kinds else c.knobs.overrides()

    @property
    def usable_bytes(self) -> float | None:
        """GPU memory a candidate may plan to use: the GPU memory less the headroom."""
        return None if self.mem_bytes is None else self.mem_bytes - self.headroom_bytes

    @property
    def best(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None


@dataclass(frozen=True, slots=True)
class KindOutcome:
    """One backend kind's share of a search across kinds: its fastest candidate, or why it has none."""
    kind: str
    best: Candidate | None
    reason: str = ""  # why the kind was dropped ("" when it has a candidate)
    enumerated: int = 0


@lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending, from its prime factors: O(sqrt n) at worst (a prime), not O(n): a global
    batch of 2^40 sequences or a world of 2^32 ranks must not hang the search."""
    primes: dict[int, int] = {}
    rest, f = n, 2
    while f * f <= rest:
        while rest % f == 0:
            primes[f] = primes.get(f, 0) + 1
            rest //= f
        f += 1 if f == 2 else 2
    if rest > 1:
        primes[rest] = primes.get(rest, 0) + 1
    out = [1]
    for prime, power in primes.items():
        out = [d * prime ** e for d in out for e in range(power + 1)]
    return tuple(sorted(out))


def _context_sizes(recipe: "Recipe", base: Knobs) -> list[int]:
    """CP degrees to try: with a backend that has context parallelism, on GPUs, for sequences of 16k tokens or more
    (or when the recipe already asks for CP): 1, 2, 4, ... 32 (each rank keeps at least 1k tokens)."""
    m = recipe.model
    if not base.row.context_parallel or not recipe.cluster.uses_gpus:
        return [1]
    if m.seq_length < CP_MIN_SEQ and base.layout.context_size == 1:
        return [1]
    return [cp for cp in (1, 2, 4, 8, 16, 32) if m.seq_length % (2 * cp) == 0 and m.seq_length // cp >= 1024]


def _expert_sizes(recipe: "Recipe", base: Knobs, t: int, p: int) -> list[tuple[int, int]]:
    """(EP, ETP) pairs to try for a model with experts: EP dividing num_experts, ETP 1 or TP, EP x ETP dividing the
    ranks of a pipeline stage; [(1, t)] for a dense model (Megatron's default ETP = TP, unused)."""
    m, world = recipe.model, base.layout.world_size
    if m.num_experts is None or not base.row.expert_parallel:
        return [(1, 1 if m.num_experts is not None else t)]
    stage = world // p
    return [(ep, etp) for etp in sorted({1, t}) for ep in _divisors(m.num_experts) if stage % (ep * etp) == 0]


def enumerate_knobs(recipe: "Recipe", base: Knobs) -> Iterator[Knobs]:
    """Every configuration the search scores (layout divisibility holds by construction)."""
    m, c = recipe.model, recipe.cluster
    world, batch = base.layout.world_size, base.layout.global_batch_size
    row = base.row
    # DeepSpeed's overlap_comm where the recipe's zero_optimization sets it (else DeepSpeed's default, on for ZeRO-3):
    # the value the re-plan of a candidate's overrides reads.
    overlap = row.zero_config(recipe).get("overlap_comm")
    if row.tensor_parallel:
        tensors = [t for t in _divisors(c.gpus_per_node)
                   if m.num_attention_heads % t == 0 and m.num_query_groups % t == 0]
    else:
        tensors = [1]
    recomputes = ("none", "selective", "full") if row.selective_recompute else ("none", "full")
    contexts = _context_sizes(recipe, base)
    for t in tensors:
        # Sequence parallelism is on whenever it can be: same TP traffic, smaller activations and p2p messages, so
        # the model never ranks "off" ahead of "on" (Korthikanti et al.).
        sps = (True,) if t > 1 and row.sequence_parallel and m.seq_length % t == 0 else (False,)
        for p, splits in _pipelines(m.num_layers, world // t, row):
            experts = _expert_sizes(recipe, base, t, p)
            for cp in contexts:
                if world % (t * p * cp) or m.seq_length % (2 * cp * t) and cp > 1:
                    continue
                d = world // (t * p * cp)
                if batch % d:
                    continue
                per_replica = batch // d
                opts = list(base.scheme.options(base, t, p, d, overlap))  # its scheme's knobs (planner/sharding/)
                for b in _divisors(per_replica):
                    micro = per_replica // b
                    vs = [1]
                    if row.interleaved_pipeline and p > 1 and micro % p == 0:
                        vs += [v for v in _divisors(-(-m.num_layers // p)) if v > 1 and splits[v]]
                    for v in vs:
                        for (first, last), sp, (ep, etp) in ((s, sp, e) for s in splits[v] for sp in sps
                                                             for e in experts):
                            layout = ParallelLayout(nodes=c.nodes, ranks_per_node=c.gpus_per_node,
                                                    tensor_size=t, pipeline_size=p, data_size=d,
                                                    virtual_pipeline_size=v if v > 1 else None,
                                                    sequence_parallel=sp, micro_batch_size=b,
                                                    global_batch_size=batch, context_size=cp, expert_size=ep,
                                                    expert_tensor_size=etp, first_stage_layers=first,
                                                    last_stage_layers=last)
                            for rc in recomputes:
                                for opt in opts:
                                    yield _knobs(base, layout, rc, opt)


class _Splits(dict):
    """VPP size -> the (first, last) stage layer counts to try with it (uneven: one split, the first stage the
    shorter end, since it holds the most microbatches in flight); computed when first asked for."""

    def __init__(self, layers: int, pipeline: int):
        super().__init__()
        self.layers, self.pipeline = layers, pipeline

    def __missing__(self, v: int) -> list[tuple[int | None, int | None]]:
        even = self.layers % (self.pipeline * v) == 0
        self[v] = [(None, None)] if even else uneven_splits(self.layers, self.pipeline, v)[:1]
        return self[v]


def _pipelines(layers: int, ranks: int, row) -> list[tuple[int, _Splits]]:
    """The pipeline sizes to try with their stage splits: those dividing the layers (even stages), and where the
    backend has uneven stages, the other divisors of the ranks a tensor-parallel group leaves that Megatron-core
    can split the layers over with a shorter first and last stage (``layout.uneven_splits``: DeepSeek-V3's 61 layers
    on PP16, Llama-3 405B's 126)."""
    if not row.pipeline_parallel:
        return [(1, _Splits(layers, 1))]
    sizes = set(_divisors(layers))
    if row.uneven_pipeline:
        sizes |= {p for p in _divisors(ranks) if 1 < p <= layers and uneven_splits(layers, p)}
    return [(p, _Splits(layers, p)) for p in sorted(sizes)]


def _knobs(base: Knobs, layout: ParallelLayout, recompute: str, opt) -> Knobs:
    """``replace(base, ...)`` spelled out: dataclasses.replace costs more than the scoring itself (``opt``: the
    scheme's knobs, ``Scheme.options``)."""
    return Knobs(backend=base.backend, layout=layout, precision=base.precision, recompute=recompute, sharding=opt,
                 recompute_method="uniform", recompute_num_layers=1, flash=base.flash, attention=base.attention,
                 on_gpu=base.on_gpu,
                 fp8=base.fp8, dispatcher=base.dispatcher, moe=base.moe, recompute_modules=base.recompute_modules,
                 ep_overlap=base.ep_overlap, shared_expert_overlap=base.shared_expert_overlap)


def search(recipe: "Recipe", top: int = 5, losers: int = 5, efficiency: float | None = None,
           hardware: Hardware | None = None, use_calibration: bool = True) -> SearchResult:
    """Rank the configurations of ``recipe`` that fit and keep the rules; ``ranked`` holds top + losers of them.

    ``efficiency`` None: the calibrated factor for the recipe's cluster when stored, else the default."""
    from hpc_tools.recipe.rules import check_recipe

    started = time.perf_counter()
    if not backends.of(recipe).trains_model:
        raise UserError(f"backend.kind={recipe.backend.kind} has no model to plan (use a recipe of backend.kind "
                        f"{' or '.join(backends.with_feature('trains_model'))})")
    hw = hardware or hardware_for(recipe.cluster, recipe.training.precision, strict=True,
                                  fp8=recipe.training.fp8 is not None)
    if not hw.peak_flops:
        raise UserError(f"cluster.gpu_type={recipe.cluster.gpu_type} has no peak FLOP/s to rank configurations by "
                        "(use a GPU type from the hardware table, or set cluster.gpu_peak_tflops)")
    eff = resolve_efficiency(recipe, efficiency, use_calibration=use_calibration)[0] or DEFAULT_EFFICIENCY
    arch, base = arch_for(recipe), Knobs.from_recipe(recipe)
    result = SearchResult(ranked=[], top=top, mem_bytes=hw.mem_bytes,
                          headroom_bytes=headroom_bytes(recipe.cluster, hw.mem_bytes),
                          headroom_note=headroom_note(recipe.cluster, hw.mem_bytes))
    usable = result.usable_bytes
    flops_cache: dict[tuple[str, int], tuple[float, float]] = {}
    memo = SearchMemo()  # what the candidates share (stage activations), computed once
    scored: list[Candidate] = []
    too_big = False
    for k in enumerate_knobs(recipe, base):
        result.enumerated += 1
        # Next to a candidate too big the knobs change a little, so this one often is too: a floor of its peak (its
        # first stage's model states) shows it before the rest when it is over the memory and not under the leanest
        # too big so far (its peak is then neither: exactly what the full estimate would conclude).
        if too_big and (floor := states_floor(arch, k)) > usable and floor >= result.smallest_too_big.memory_bytes:
            result.too_big += 1
            continue
        mem = estimate_memory(arch, k, hw.is_gpu, memo)
        too_big = usable is not None and mem.total > usable
        if too_big:
            result.too_big += 1
            if result.smallest_too_big is None or mem.total < result.smallest_too_big.memory_bytes:
                result.smallest_too_big = Candidate(k, mem.total, mem.peak.stage, None)
            continue
        key = (k.recompute, k.layout.tensor_size)
        if key not in flops_cache:
            flops_cache[key] = step_flops(recipe.model, k, recipe.profiling.flops_convention)
        scored.append(Candidate(k, mem.total, mem.peak.stage, estimate_step_time(arch, k, hw, flops_cache[key], eff)))
    result.fitting = len(scored)
    scored.sort(key=lambda c: (c.step_s, c.memory_bytes))
    for cand in scored[:MAX_RULE_CHECKS]:
        violations = check_recipe(apply_knobs(recipe, cand.knobs))
        if violations:
            result.broke_rules.append((cand, violations[0]))
            continue
        result.ranked.append(cand)
        if len(result.ranked) >= top + losers:
            break
    result.elapsed_s = time.perf_counter() - started
    return result


def parse_kinds(text: str) -> list[str]:
    """``--backends``: a comma list of kinds that train a model, or ``all`` (every such row of the backend table)."""
    able = backends.with_feature("trains_model")
    kinds = able if text.strip() == "all" else [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in able]
    if bad or not kinds:
        raise UserError(f"--backends {text}: {', '.join(bad) or 'no kind'} is not a backend kind that trains a model "
                        f"(give a comma list of {', '.join(able)}, or all)")
    return list(dict.fromkeys(kinds))


def with_kind(recipe: "Recipe", kind: str) -> "Recipe":
    """The recipe with ``backend.kind`` replaced (its options sections are all there, with their defaults)."""
    return recipe.model_copy(update={"backend": recipe.backend.model_copy(update={"kind": kind})})


def search_across(recipe: "Recipe", kinds: list[str], top: int = 5, losers: int = 5, efficiency: float | None = None,
                  hardware: Hardware | None = None, use_calibration: bool = True) -> SearchResult:
    """``search`` for each of ``kinds`` on the recipe with that ``backend.kind``, ranked together (``ranked``: the
    top + losers of all kinds); ``kinds`` of the result: each kind's best (the best a search of that kind alone
    returns) or why it was dropped."""
    started = time.perf_counter()
    parts = [(kind, search(with_kind(recipe, kind), top=top, losers=losers, efficiency=efficiency, hardware=hardware,
                           use_calibration=use_calibration)) for kind in kinds]
    first = parts[0][1]
    result = SearchResult(ranked=[], top=top, mem_bytes=first.mem_bytes, headroom_bytes=first.headroom_bytes,
                          headroom_note=first.headroom_note)
    for kind, part in parts:
        result.enumerated += part.enumerated
        result.too_big += part.too_big
        result.fitting += part.fitting
        result.broke_rules += part.broke_rules
        result.ranked += part.ranked
        small = part.smallest_too_big
        if small and (result.smallest_too_big is None or small.memory_bytes < result.smallest_too_big.memory_bytes):
            result.smallest_too_big = small
        result.kinds.append(KindOutcome(kind, part.best, "" if part.best else _dropped(part), part.enumerated))
    result.ranked.sort(key=lambda c: (c.step_s, c.memory_bytes))
    del result.ranked[top + losers:]
    result.elapsed_s = time.perf_counter() - started
    return result


def _dropped(part: SearchResult) -> str:
    """Why a kind's search has no candidate: the rule its fastest fitting configuration broke, or memory."""
    if part.broke_rules:
        return f"its fitting configurations break a rule, the fastest: {part.broke_rules[0][1]}"
    leanest = part.smallest_too_big
    hint = f" (the leanest, {leanest.knobs.describe()}, needs {leanest.memory_bytes / GB:.1f} GB)" if leanest else ""
    return (f"none of its {part.enumerated} configurations fits in {(part.usable_bytes or 0) / GB:.1f} GB per "
            f"GPU{hint}")


def why_slower(cand: Candidate, best: Candidate) -> str:
    """One line: how much slower than the best and which term costs the most."""
    deltas = {name: cand.time.terms[name] - best.time.terms.get(name, 0.0) for name in cand.time.terms}
    name, delta = max(deltas.items(), key=lambda kv: kv[1])
    pct = (cand.step_s / best.step_s - 1) * 100
    if pct < 0.05:
        more = cand.memory_bytes - best.memory_bytes
        return f"same step time, {more / GB:+.1f} GB memory"
    return f"{pct:.1f}% slower: {name} {delta:+.3f} s"


def auto_configure(recipe: "Recipe", efficiency: float | None = None) -> tuple["Recipe", list[str], Candidate]:
    """The recipe with the fastest configuration that fits and keeps the rules, the ``--set`` overrides that produce
    it, and its candidate. Raises UserError when nothing fits (for ``submit --auto``)."""
    from hpc_tools.recipe.rules import check_recipe
    from hpc_tools.recipe.schema import Recipe

    result = search(recipe, top=1, losers=0, efficiency=efficiency)
    if result.best is None:
        smallest = result.smallest_too_big
        hint = (f"; the smallest needs {smallest.memory_bytes / GB:.1f} GB ({smallest.knobs.describe()})"
                if smallest else "")
        raise UserError(f"cluster.gpu_type={recipe.cluster.gpu_type}: none of the {result.enumerated} configurations "
                        f"for {recipe.cluster.nodes}x{recipe.cluster.gpus_per_node} GPUs fits in "
                        f"{(result.usable_bytes or 0) / GB:.1f} GB ({(result.mem_bytes or 0) / GB:.1f} GB less "
                        f"{result.headroom_bytes / GB:.1f} GB headroom, cluster.memory_headroom_gb){hint} "
                        "(add nodes, or a GPU with more memory)")
    best = result.best
    chosen = Recipe.model_validate(apply_knobs(recipe, best.knobs).model_dump())
    violations = check_recipe(chosen)
    if violations:  # cannot happen unless a rule depends on something apply_knobs changed without validation
        raise UserError(f"the planner's choice {best.knobs.describe()} breaks a rule: {violations[0]}")
    return chosen, best.knobs.overrides(), best
