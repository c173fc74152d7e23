"""The collectives of preflight over groups of ranks (steps 4 and 5 of ``run``): every rank's time agreed on every
rank, groups timed at once or in turn where they share a machine, the busbw expected of a link at a message size,
and the slow-link search's cost function (``RoundRunner``, the rounds ``bisect.find_slow`` asks for). Imports torch
where it runs collectives only."""

from __future__ import annotations

from hpc_tools.runtime.preflight import measure
from hpc_tools.runtime.preflight.verdict import SLOW_FACTOR, busbw_gbps

STEP_LATENCY_S = 10e-6
"""Latency of one step of a ring all-reduce between nodes (2(n-1) steps), assumed (InfiniBand's few microseconds plus
NCCL's own per step; not measured here): the expected busbw at a message size (``expected_at``)."""
# GPU collectives are timed over this many back-to-back runs per host synchronize: one synchronize per run would add
# its own microseconds to every run of a small message.
PER_SYNC = {"cpu": 1, "cuda": 5}
# Ranks sharing a host (local ranks standing for nodes) measure in turn, this many times round (a third of it for
# GEMM and memory), the best kept: another process of the host may take the cores during any one turn.
SHARED_REPEATS = 9


def expected_at(bw_gbps: float | None, nbytes: int, n: int) -> float | None:
    """The all-reduce busbw a link the planner gives ``bw_gbps`` for (its large-message figure) is expected to reach
    with a message of ``nbytes`` over ``n`` ranks: a ring's 2(n-1) steps each pay ``STEP_LATENCY_S``, and each rank
    moves 2(n-1)/n x ``nbytes`` at ``bw_gbps`` (nccl-tests' busbw of that time). None without a figure."""
    if not bw_gbps or n < 2:
        return bw_gbps
    moved = nbytes * 2 * (n - 1) / n
    return moved / (2 * (n - 1) * STEP_LATENCY_S + moved / (bw_gbps * 1e9)) / 1e9


def bytes_moved(nbytes: int, n: int) -> int:
    return max(nbytes // 4 // n * n, n) * 4


def agreed_seconds(secs: float, world: int) -> list[float]:
    """Every rank's time, on every rank (one all-gather over the default group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(secs)], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    out = [torch.zeros_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]


def smallest_figure(node: str, figures: dict[frozenset, float | None]) -> float | None:
    """The busbw of the smallest group holding ``node`` (of those, the last measured)."""
    holding = [(len(g), -i, v) for i, (g, v) in enumerate(figures.items()) if node in g and v is not None]
    return min(holding)[2] if holding else None


def timed_groups(ctx, measured, ranks, pgs, mine, nbytes, device, hosts_of) -> list[float]:
    """Every rank's all-reduce time over its group of this round, on every rank. Groups on separate machines run
    at once; groups that share a machine (``machine_id``: local ranks standing for nodes, namespace nodes) run one
    after another, so that they do not share its cores while they are timed."""
    import torch.distributed as dist

    world = ctx.dist.world_size
    hosts = [{hosts_of[r] for r in ranks[g]} for g in measured]
    shared = any(a & b for i, a in enumerate(hosts) for b in hosts[i + 1:])
    if not shared:
        secs = measure.collective_seconds("all_reduce", nbytes, pgs[mine], len(ranks[mine]), device,
                                          ctx.rank, per_sync=PER_SYNC[device.type]) if mine else 0.0
        return agreed_seconds(secs, world)
    secs = float("inf")  # one timed run per group in turn, SHARED_REPEATS times round: both see the host's load alike
    for i in range(SHARED_REPEATS):
        for g in measured:
            if g == mine:
                secs = min(secs, measure.collective_seconds("all_reduce", nbytes, pgs[mine], len(ranks[mine]),
                                                            device, ctx.rank, iters=1, warmup=i == 0))
            dist.barrier()
    return agreed_seconds(secs if mine else 0.0, world)


class RoundRunner:
    """The search's cost function on the ranks: one round's groups measured at once (an all-reduce each), slow =
    below ``SLOW_FACTOR`` x the other group's busbw or the expected figure.

    A group of one node has no link of its own to test. The search pairs it with a node already found healthy when
    there is one; where there is none (a round of a pair and a lone node: three candidates, the first split), the
    runner measures every pair of the three, one after another, and judges the nodes from the pairs alone (pairs
    of the same size: a figure over three ranks is not comparable with one over two): a node is slow when every
    pair holding it is slow and a pair without it is not; a single slow pair names both of its ends (a slow link
    cannot be pinned on one of them). Later rounds over those nodes answer from the same pairs."""

    def __init__(self, ctx, nodes, nbytes, device, group, figures, expected, hosts_of, factor=SLOW_FACTOR):
        self.ctx, self.nodes, self.nbytes, self.device, self.group = ctx, nodes, nbytes, device, group
        self.figures, self.expected, self.hosts_of, self.factor = figures, expected, hosts_of, factor
        self.by_pairs: dict[str, bool] = {}

    def expected_for(self, group: tuple[str, ...]) -> float | None:
        """The busbw expected of ``group``'s all-reduce at the search's message size (``expected_at``)."""
        if not self.expected:
            return None
        return expected_at(self.expected, self.nbytes, sum(len(self.nodes[n]) for n in group))

    def timed(self, measured, ranks, pgs, mine) -> list[float]:
        return timed_groups(self.ctx, measured, ranks, pgs, mine, self.nbytes, self.device, self.hosts_of)

    def measure(self, measured: list[tuple[str, ...]]) -> dict[tuple[str, ...], float | None]:
        """One collective round over ``measured`` (disjoint groups of nodes); the figures, also kept for the table."""
        ranks = {g: [r for n in g for r in self.nodes[n]] for g in measured}
        pgs = {g: self.group(ranks[g]) for g in measured}
        mine = next((g for g in measured if self.ctx.rank in ranks[g]), None)
        agreed = self.timed(measured, ranks, pgs, mine)
        figs: dict[tuple[str, ...], float | None] = {}
        for g in measured:
            figs[g] = busbw_gbps("all_reduce", bytes_moved(self.nbytes, len(ranks[g])),
                                 max(agreed[r] for r in ranks[g]), len(ranks[g]))
            self.figures[frozenset(g)] = figs[g]
        return figs

    def __call__(self, groups: list[tuple[str, ...]]) -> list[bool | None]:
        if len(groups) == 1:  # the whole group (measured already, or now: the nodes a node named alone left)
            if frozenset(groups[0]) not in self.figures:
                self.measure([groups[0]])
            fig = self.figures[frozenset(groups[0])]
            if self.expected and fig is not None:
                return [fig < self.factor * self.expected_for(groups[0])]
            return [None]
        if self.by_pairs and all(n in self.by_pairs for g in groups for n in g):  # judged from the pairs already
            return [any(self.by_pairs[n] for n in g) for g in groups]
        if all(len(g) == 1 for g in groups):
            return [None] * len(groups)
        measured = [g for g in groups if len(g) > 1]
        figs = self.measure(measured)
        ref = max([v for v in figs.values() if v is not None] + [self.expected_for(g) or 0.0 for g in measured])
        out: list[bool | None] = [figs[g] < self.factor * ref if figs.get(g) is not None else None for g in groups]
        if len(groups) == 2 and [len(g) for g in groups if len(g) == 1] == [1] and len(measured[0]) == 2:
            lone = next(i for i, g in enumerate(groups) if len(g) == 1)
            self.by_pairs = self.judge_triangle(measured[0], groups[lone][0], figs[measured[0]])
            out[lone] = self.by_pairs.get(groups[lone][0])
            out[1 - lone] = any(self.by_pairs.get(n) for n in measured[0]) if self.by_pairs else out[1 - lone]
        return out

    def judge_triangle(self, pair: tuple[str, ...], lone: str, pair_fig: float | None) -> dict[str, bool]:
        """Every pair of the three nodes measured twice (one at a time: they share nodes), the better figure of each
        kept; each node's verdict."""
        a, b = pair
        figs = {frozenset(pair): pair_fig}
        for other in ((a, lone), (b, lone)):
            figs[frozenset(other)] = self.measure([other])[other]
        for again in (pair, (a, lone), (b, lone)):  # each pair twice, the better kept: one disturbed measurement of
            fig = self.measure([again])[again]      # a healthy pair on a shared host is not a slow link
            old = figs[frozenset(again)]
            figs[frozenset(again)] = self.figures[frozenset(again)] = None if fig is None or old is None else max(
                fig, old)
        if any(v is None for v in figs.values()):
            return {}
        ref = max(max(figs.values()), self.expected_for(pair) or 0.0)
        slow = {p for p, v in figs.items() if v < self.factor * ref}
        verdict = {n: all(p in slow for p in figs if n in p) and any(p not in slow for p in figs if n not in p)
                   for n in (a, b, lone)}
        if len(slow) == 1:  # one slow link: both of its ends
            verdict.update({n: True for n in next(iter(slow))})
        return verdict
