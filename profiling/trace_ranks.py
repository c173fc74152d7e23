"""Which ranks take the sampled traces (``profiling.trace_ranks``): every rank of a small job, a chosen subset of a
large one.

A sampled window costs each traced rank the same share of its run whatever the job's size, but every traced rank
writes a file per window and ``analyze --breakdown`` reads each of them: at 1024 ranks a window every 200 steps is
1024 files. What the breakdown needs from a large job is every place a step can lose time seen at least once: each
pipeline stage, each parallel group (a group's wait shows on any of its members), each node. ``auto`` traces every
rank up to ``ALL_UP_TO`` ranks, and above that a small set with a rank in every pipeline stage, every TP, CP, EP, DP
and PP group of more than one rank and every node: a greedy set cover, rank 0 first (its log holds the run's
lines). The groups follow Megatron-core's rank order as ``hpc_tools.topology.group_kinds`` states it (the layout is
the caller's ``hpc_tools.layout.ParallelLayout``, a value: profiling does not import it). A rank is in one group of
each kind, so no set is smaller than the largest number of groups of one kind (or of nodes, or of stages); on the
layouts of ``tests/unit/test_trace_ranks.py`` the cover is within 12.5 % of that bound.
"""

from __future__ import annotations

import heapq
from typing import Any, Iterable

ALL_UP_TO = 32
"""``auto`` traces every rank of a job of at most this many ranks."""


def _kinds(layout: Any) -> list[tuple[str, int, int]]:
    """(kind, size, stride) of each parallel group kind: tp-cp-dp-pp for the dense groups, etp-ep-edp-pp for EP."""
    t, c, e = layout.tensor_size, layout.context_size, layout.expert_size
    return [("TP", t, 1), ("CP", c, t), ("EP", e, layout.expert_tensor_size or t), ("DP", layout.data_size, t * c),
            ("PP", layout.pipeline_size, t * c * layout.data_size)]


def families(layout: Any) -> dict[str, list[range]]:
    """{kind: the rank sets of every group of that kind}: stages, nodes, and the TP/CP/EP/DP/PP groups of more than
    one rank."""
    world = layout.world_size
    per_stage = world // layout.pipeline_size
    out: dict[str, list[range]] = {
        "stage": [range(s * per_stage, (s + 1) * per_stage) for s in range(layout.pipeline_size)],
        "node": [range(n * layout.ranks_per_node, (n + 1) * layout.ranks_per_node) for n in range(layout.nodes)],
    }
    for name, size, stride in _kinds(layout):
        if size > 1:
            block = size * stride
            out[name] = [range(base + off, base + block, stride)
                         for base in range(0, world - world % block, block) for off in range(stride)]
    return out


def cover(layout: Any) -> list[int]:
    """A small set of ranks with one in every stage, node and parallel group (sorted; rank 0 always in it)."""
    member: dict[int, list[tuple[str, int]]] = {r: [] for r in range(layout.world_size)}
    for kind, sets in families(layout).items():
        for i, ranks in enumerate(sets):
            for r in ranks:
                member[r].append((kind, i))
    uncovered = {g for gs in member.values() for g in gs}
    chosen = [0]
    uncovered.difference_update(member[0])
    # Lazy greedy: a rank's gain only falls as others are chosen, so a popped rank whose recomputed gain still beats
    # the next one's stale gain is the best (ties: the lowest rank).
    heap = [(-len(gs), r) for r, gs in member.items() if r != 0]
    heapq.heapify(heap)
    while uncovered and heap:
        _, r = heapq.heappop(heap)
        gain = sum(g in uncovered for g in member[r])
        if gain and (not heap or (-gain, r) <= heap[0]):
            chosen.append(r)
            uncovered.difference_update(member[r])
        elif gain:
            heapq.heappush(heap, (-gain, r))
    return sorted(chosen)


def traced_ranks(layout: Any, setting: str | Iterable[int]) -> list[int]:
    """The ranks that take sampled traces: ``all``, ``auto`` (all up to ``ALL_UP_TO`` ranks, else ``cover``), or an
    explicit list (ranks beyond the job's world, after an elastic shrink, trace nothing)."""
    world = layout.world_size
    if setting == "all" or (setting == "auto" and world <= ALL_UP_TO):
        return list(range(world))
    if setting == "auto":
        return cover(layout)
    return sorted({int(r) for r in setting if 0 <= int(r) < world})
