"""The pipeline bubble of Megatron-core's 1F1B schedules for stages of unequal length.

The textbook bubble, ``(p-1)/(v m)`` of a stage's compute (Narayanan et al. 2021; ``ParallelLayout.bubble_fraction``),
holds when every stage takes the same time per microbatch. A real split is not equal: the first stage also holds the
embedding, the last the output layer and the loss, uneven stages (``num_layers_in_first/last_pipeline_stage``) and a
layer count that p x v does not divide move layers between stages. Then the pipeline runs at its slowest stage's
pace, and the faster stages wait for it in the steady state as well as in the fill and the drain.

This module plays the schedule itself: each stage runs its forwards and backwards in Megatron-core's order
(``pipeline_parallel/schedules.py`` 0.16: ``get_pp_rank_microbatches`` for the warm-up counts, ``get_schedule_table``
for the interleaved order, ``microbatch_group_size_per_vp_stage`` = p), each as soon as the stage is free and its input
is there (the previous virtual stage's forward; the next one's backward, or the last stage's own forward). Transfers
take no time here (the planner prices them as ``pipeline p2p``). A stage's idle time is then split by where it falls:

* ``bubble``: idle before the stage's first backward starts (the fill) and after its last forward ends (the drain);
* ``steady``: idle between the two, waiting on a send/recv for a slower neighbour in the 1F1B steady state.

With equal stages every stage idles ``(p-1)(f+b)`` in fill and drain and never in the steady state: ``(p-1)/m`` of its
``m (f+b)`` (``(p-1)/(v m)`` interleaved, m a multiple of p), the textbook figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tools.planner.arch import Arch

Op = tuple[str, int, int]  # ("F" | "B", microbatch, model chunk)


@dataclass(frozen=True, slots=True)
class StageTimes:
    """One stage's step under the schedule (seconds, or any unit the durations were in)."""

    busy: float  # its own forwards and backwards
    bubble: float  # idle in the fill (before its first backward) and the drain (after its last forward)
    steady: float  # idle between: waiting for a slower neighbour


@dataclass(frozen=True, slots=True)
class Schedule:
    step: float  # the pipeline's step: the last backward's end
    stages: tuple[StageTimes, ...]

    @property
    def mean_bubble(self) -> float:
        return sum(s.bubble for s in self.stages) / len(self.stages)

    @property
    def mean_steady(self) -> float:
        return sum(s.steady for s in self.stages) / len(self.stages)

    @property
    def slowest_busy(self) -> float:
        return max(s.busy for s in self.stages)


def stage_order(p: int, stage: int, m: int, v: int = 1, group: int | None = None) -> list[Op]:
    """The forwards and backwards of one stage in Megatron-core's order: warm-up forwards, 1F1B pairs (forward, then
    backward), cool-down backwards. Interleaved (v > 1): virtual microbatches in ``get_schedule_table``'s order
    (groups of ``group`` microbatches, default p, through every model chunk), backwards through the chunks in
    reverse."""
    if v == 1:
        table = [(i, 0) for i in range(m)]
        warmup = min(p - stage - 1, m)
    else:
        g = group or p
        table = []
        for lo in range(0, m, g):
            hi = m if lo + g >= m else lo + g
            table += [(i, c) for c in range(v) for i in range(lo, hi)]
        warmup = min((p - stage - 1) * 2 + (v - 1) * g, m * v)
    total = len(table)
    fwd = [("F", i, c) for i, c in table]
    bwd = [("B", i, v - 1 - c) for i, c in table]
    order = fwd[:warmup]
    for k in range(total - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[total - warmup:]


def simulate(fwd: list[list[float]], bwd: list[list[float]], m: int, group: int | None = None) -> Schedule:
    """Play the schedule: ``fwd[s][c]`` / ``bwd[s][c]`` the forward / backward time of one microbatch through model
    chunk ``c`` of stage ``s`` (p stages of v chunks; virtual stage ``c p + s``, as Megatron-core places chunks)."""
    step, spans = _play(fwd, bwd, m, group)
    return Schedule(step, tuple(_split(ops, step) for ops in spans))


def _play(fwd, bwd, m: int, group: int | None = None) -> tuple[float, list[list[tuple[float, float, Op]]]]:
    """The step (the last backward's end) and each stage's ops with their start and end."""
    p, v = len(fwd), len(fwd[0])
    orders = [stage_order(p, s, m, v, group) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, microbatch, virtual stage) -> end
    spans: list[list[tuple[float, float, Op]]] = [[] for _ in range(p)]
    free, ptr = [0.0] * p, [0] * p
    last = p * v - 1
    while any(ptr[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while ptr[s] < len(orders[s]):
                kind, i, c = op = orders[s][ptr[s]]
                j = c * p + s
                dep = (("F", i, j - 1) if j > 0 else None) if kind == "F" else (
                    ("B", i, j + 1) if j < last else ("F", i, j))
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep else 0.0)
                free[s] = start + (fwd if kind == "F" else bwd)[s][c]
                done[(kind, i, j)] = free[s]
                spans[s].append((start, free[s], op))
                ptr[s] += 1
                moved = True
        if not moved:  # Megatron-core's orders never deadlock; a wrong order would
            raise ValueError(f"pipeline schedule stuck at {ptr} (p={p}, v={v}, m={m})")
    return max(free), spans


def _split(ops: list[tuple[float, float, Op]], step: float) -> StageTimes:
    """A stage's idle time, fill and drain vs the steady state between its first backward and its last forward."""
    first_b = next(a for a, _, op in ops if op[0] == "B")
    last_f = max(max(b for _, b, op in ops if op[0] == "F"), first_b)
    busy = sum(b - a for a, b, _ in ops)
    bubble = steady = 0.0
    prev = 0.0
    for a, b, _ in ops + [(step, step, ("", 0, 0))]:
        gap = a - prev
        if gap > 0:
            if a <= first_b or prev >= last_f:
                bubble += gap
            else:
                steady += gap
        prev = b
    return StageTimes(busy, bubble, steady)


def equal_split(per_stage: list[float], v: int = 1, backward_ratio: float = 2.0) -> tuple[list[list[float]], ...]:
    """(fwd, bwd) per stage and chunk from each stage's time per microbatch (forward + backward), its chunks equal
    and a backward ``backward_ratio`` x its forward (2: the weight and the input gradients)."""
    fwd = [[c / v / (1 + backward_ratio)] * v for c in per_stage]
    bwd = [[c / v * backward_ratio / (1 + backward_ratio)] * v for c in per_stage]
    return fwd, bwd


def layer_flops(arch: "Arch", moe: bool) -> float:
    """Forward FLOPs per token of one layer (causal attention core halved, as Megatron counts it)."""
    h, d, a = arch.hidden, arch.head_dim, arch.heads
    attn = 2 * h * (a * d + 2 * arch.groups * d) + 2 * a * d * h + 2 * arch.seq * a * 2 * d * 0.5
    mats = 3 if arch.gated else 2
    if not moe:
        return attn + 2 * h * arch.ffn * mats
    return attn + 2 * h * arch.experts + (arch.topk * arch.moe_ffn + arch.shared_ffn) * 2 * h * mats


def stage_costs(arch: "Arch", p: int, v: int, first: int | None, last: int | None, tensor: int,
                backward_ratio: float = 2.0) -> tuple[list[list[float]], list[list[float]]]:
    """(fwd, bwd) per stage and model chunk in forward FLOPs per token on one GPU: the chunk's layers
    (``layout.pipeline_chunks``, uneven stages included), the output layer's logits on the last virtual stage; the
    embedding's lookup on the first is memory-bound and counted as nothing. Backward ``backward_ratio`` x forward."""
    from hpc_tools.layout import pipeline_chunks

    chunks = pipeline_chunks(arch.layers, p, v, first, last)
    if chunks is None:  # a split the rules refuse: equal chunks
        n = arch.layers // (p * v)
        chunks = tuple(tuple(range((s + p * j) * n, (s + p * j + 1) * n) for j in range(v)) for s in range(p))
    flags = arch.moe_flags or (False,) * arch.layers
    fwd = [[sum(layer_flops(arch, flags[i]) for i in chunk) / tensor for chunk in stage] for stage in chunks]
    fwd[-1][-1] += 2 * arch.hidden * arch.padded_vocab(tensor) / tensor
    return fwd, [[c * backward_ratio for c in stage] for stage in fwd]


# The schedule is played op by op (~1.5 us each): up to PLAYED ops exactly; a longer step (a large m, 2 p v m ops) is
# played at two shorter lengths m1 < m2 = m1 + p in the steady state and extended linearly (the steady state repeats
# every p microbatches); stages so many (2 p v x 3p > FALLBACK ops) that even that is too long take the textbook
# figure. Calls are cached: the search asks the same stages and m for many candidates.
PLAYED = 4000
FALLBACK = 60000


def stage_schedule(arch: "Arch", p: int, v: int, m: int, first: int | None = None, last: int | None = None,
                   tensor: int = 1, backward_ratio: float = 2.0) -> Schedule:
    """Megatron-core's schedule played on the planner's stage costs (``stage_costs``, FLOPs per token)."""
    fwd, bwd = stage_costs(arch, p, v, first, last, tensor, backward_ratio)
    return simulate(fwd, bwd, max(m, 1))


@lru_cache(maxsize=65536)  # Arch hashes by identity: the search's candidates share one
def bubble_fraction(arch: "Arch", p: int, v: int, m: int, first: int | None = None, last: int | None = None,
                    tensor: int = 1, backward_ratio: float = 2.0) -> float:
    """The step's idle time beyond the slowest stage's own work, over that work: (step - m x slowest stage) /
    (m x slowest stage) under Megatron-core's schedule with ``stage_costs``; ``(p-1)/(v m)`` for equal stages."""
    if p <= 1:
        return 0.0
    fwd, bwd = stage_costs(arch, p, v, first, last, tensor, backward_ratio)
    return _bubble(tuple(map(tuple, fwd)), tuple(map(tuple, bwd)), max(m, 1))


@lru_cache(maxsize=4096)
def _bubble(fwd: tuple[tuple[float, ...], ...], bwd: tuple[tuple[float, ...], ...], m: int) -> float:
    p, v = len(fwd), len(fwd[0])
    slowest = max(sum(f) + sum(b) for f, b in zip(fwd, bwd))  # per microbatch
    if not slowest:
        return 0.0
    if 2 * p * v * m <= PLAYED:
        step = _play(fwd, bwd, m)[0]
    elif 2 * p * v * 3 * p > FALLBACK:
        return (p - 1) / (v * m)
    else:
        m1 = max(2, PLAYED // (2 * p * v * p) - 1) * p
        if m <= m1 + p:
            step = _play(fwd, bwd, m)[0]
        else:
            s1, s2 = _play(fwd, bwd, m1)[0], _play(fwd, bwd, m1 + p)[0]
            step = s1 + (m - m1) * (s2 - s1) / p
    return max(step / (m * slowest) - 1.0, 0.0)
