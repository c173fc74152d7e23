"""Stragglers by what they do: which rank holds the others back, on which node, and why (compute, data or
communication), with how sure the verdict is.

Why not the step time: in a synchronous job (data, tensor and pipeline parallel alike) every rank waits for the
slowest one inside the step's collectives, so all ranks' step times come out equal and the slow rank is the one that
waits *least*. What differs is how the step is spent. On every step where the collectives were timed
(``profiling.communication``, every ``communication_sample_interval``-th step) a rank's step splits into

    busy    = step_time_s - comm_time_s     (comm_time_s: time stalled in every collective and pipeline p2p)
    data    = data_time_s                   (producing the step's batches)
    compute = busy - data

A rank that arrives late at the collectives has more busy time than its peers by as much as they wait for it.

The verdict compares each rank with its *peers*: the ranks of its own pipeline stage (they run the same layers; stages
legitimately differ, e.g. the last one computes the loss). Per step, a rank's excess is its busy time minus the
median of its peers' (the other ranks of the stage) on the same step. A rank is a straggler when

- its median excess over the compared steps is more than ``THRESHOLD`` (5 %) of the job's median step time, and
- it is busier than its peers on so many of the steps that chance is ruled out: a one-sided sign test, p <= ``P_MAX``
  (0.01; needs at least 7 compared steps). ``z`` (robust z-score of its median busy time among the stage's ranks,
  median and MAD, 3+ ranks) says how far it stands out.

Its cause is the larger of its median data excess and its median compute excess. A rank whose *waiting* exceeds its
peers' by the same rule, while it is not less busy than them (its extra wait is not the wait for a late peer) and no
peer of its stage is a busy straggler, is a straggler by communication: its own transfers are slow (link, NIC).
Only a bounded sample of steps is kept per rank (``MAX_STEPS``, evenly spaced), so memory stays small at any run
length.

Stalled by the host (``CAUSES``' "host stalled"): a rank that the OS deschedules (CPU contention, a noisy neighbour,
memory pressure, a throttled host, a SIGSTOP) is slowed from outside its own code, and its busy time need not show it:
the stall lands inside a collective or a pipeline wait as often as not, where its peers, which cannot progress without
it, are held as long as it is. What does tell, on every measured step (not the sampled ones) from the records' host
figures (``cpu_time_s``, ``involuntary_switches``, ``collective_wait_s``: CPU ranks):

    outside = step_time_s - collective_wait_s      (its time in the step outside collectives)
    late    = outside - peers' mean outside         (how much longer the others waited for it in the step)

A rank that arrives last at a collective waits least in it, so ``late`` adds up, over the step's collectives, how
long its peers waited for it to arrive, less how much later than them it started the step (the loop's work between
steps, such as rank 0's progress line, is not lateness); a stall inside a collective holds every member alike and
adds nothing. Of that lateness, its extra CPU time (``cpu_time_s`` over its peers' mean: more work) and extra data
time explain what its own code did; the rest it spent off its CPU outside collectives: stalled. A rank is a
straggler with the cause "host stalled" when, over all measured steps its stage's ranks recorded (``MAX_HOST_STEPS``
at most, evenly spaced),

- its mean lateness is more than ``THRESHOLD`` of the stage's mean step time (a mean, not a median: a stall hits some
  steps and not others), and so is its mean unexplained lateness (late - CPU excess - data excess), which is also more
  than half of its lateness, while its extra CPU time is not (a rank with that much more work is slow in its own
  code, however much a busy host adds to it: its busy-time verdict stands), and
- its lateness is no chance: a one-sided test of its per-step lateness having mean 0 (t = mean / standard error,
  normal tail) gives p <= P_MAX, and it was the latest of its stage, by more than ``THRESHOLD`` of the median step,
  on two steps or more (the verdict also says on how many of the steps where a rank was that late).

Its own evidence, which a stall inside a collective does not hide: ``host_stall_s`` (``stall.py``), how long the
host kept the process from running at all in the step (stopped or descheduled: a thread of it woke late). A rank is
also "host stalled" when its mean ``host_stall_s`` over its peers' mean is more than ``THRESHOLD`` of the stage's
mean step time, with p <= P_MAX by the same test of its per-step excess against mean 0 (the steps' spread is the
noise it is measured against: a busy machine that stalls every rank alike names none), and its extra CPU time is not
above ``THRESHOLD`` either. Lateness alone misses such a rank where its stalls land inside the collectives (its peers
wait there for it as long as it is stopped) and its peers are descheduled outside them (then they look late).

The verdict overrides a busy-time verdict of the same rank (a stall in its compute also makes it busier). A rank late
by its extra CPU time or data keeps its busy-time verdict (compute or data), and an injected sleep is, from outside,
a stall. A stall travels down the pipeline (the stalled rank sends late; its neighbour in the next stage waits in
its recv and arrives late at its own stage's collectives): of stalled-looking ranks of several stages, those whose
lateness is mostly their extra pipeline wait (``pp_wait_s`` over their peers') are the stalled one's victims, not
named. Involuntary context switches (over its peers' mean per step) are reported, not judged: many say the CPU
was taken from it (contention), few with a large lateness say it was stopped. GPU ranks record no
``collective_wait_s`` (their collectives return before they ran): there this rule does not apply.

What it cannot see: a stage with one rank has no peers; a whole stage slower than the others shows as
pipeline wait (``bubble_share_per_stage``), not here; and a slow link shared by a whole collective group makes every
member wait alike, so no one rank stands out (the per-kind bus bandwidth of the communication table shows it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

THRESHOLD = 0.05  # excess busy time, as a share of the median step time, that makes a straggler
P_MAX = 0.01  # sign-test p-value at or below which the excess is not chance
MIN_STEPS = 7  # the fewest compared steps at which P_MAX can be reached (0.5**7 = 0.0078)
MAX_STEPS = 512  # compared steps kept per rank (evenly spaced over the run)
MAX_HOST_STEPS = 1 << 13  # steps kept per rank for the host-stall rule (all of them up to this, then evenly spaced)
CAUSES = ("compute", "data", "communication", "host stalled")
HOST_STALLED = "host stalled"


@dataclass
class RankVerdict:
    """One rank's comparison with its peers (see the module docstring); medians in seconds per step."""

    rank: int
    pp_rank: int
    steps_compared: int = 0
    busy_median_s: float | None = None
    compute_median_s: float | None = None
    excess_s: float | None = None  # median over steps of (busy - peers' median busy)
    excess_share: float | None = None  # excess_s / the job's median step time
    compute_excess_s: float | None = None
    data_excess_s: float | None = None
    comm_excess_s: float | None = None  # how much more this rank waits in collectives than its peers
    steps_slower: int | None = None  # steps on which it was busier than its peers
    p_value: float | None = None
    z: float | None = None
    straggler: bool = False
    cause: str | None = None
    node: str | None = None
    # the host-stall rule, over every measured step with host figures (means over steps, seconds per step)
    host_steps: int | None = None  # steps compared
    late_s: float | None = None  # mean of (its time outside collectives - its peers' mean of it)
    late_share: float | None = None  # late_s / the stage's mean step time
    late_unexplained_s: float | None = None  # late_s - cpu_excess_s - its mean data excess
    p2p_excess_s: float | None = None  # mean of (its pp_wait_s - its peers' mean): late for a pipeline neighbour
    cpu_excess_s: float | None = None  # mean of (its cpu_time_s - its peers' mean)
    switches_excess: float | None = None  # mean of (its involuntary_switches - its peers' mean)
    steps_latest: int | None = None  # steps on which it was the latest of its stage by more than THRESHOLD
    steps_late: int | None = None  # steps on which some rank of its stage was late by more than THRESHOLD
    late_p: float | None = None  # one-sided p of its mean lateness being chance (``mean_above_zero_p``)
    stall_excess_s: float | None = None  # mean of (its host_stall_s - its peers' mean): kept from running
    stall_p: float | None = None  # one-sided p of its mean stall excess being chance
    host_p: float | None = None  # the p of the host-stall rule that named it (stall_p when kept from running)
    busy_cause: str | None = None  # the busy-time verdict a host-stall verdict replaced

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def sign_test_p(k: int, n: int) -> float:
    """P(at least k of n fair coin flips come up heads): the chance that a rank no slower than its peers is busier
    on k or more of n steps."""
    if n <= 0 or k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if n > 1000:  # 0.5 ** n underflows: the exact big-integer sum
        return float(sum(math.comb(n, j) for j in range(k, n + 1)) / 2 ** n)
    # As floats from the tail inward, term_j = C(n, j) / 2^n, term_(j-1) = term_j * j / (n - j + 1): the big-integer
    # sum costs milliseconds per rank, seconds for a thousand ranks.
    term = total = 0.5**n
    for j in range(n, k, -1):
        term *= j / (n - j + 1)
        total += term
    return min(1.0, total)


@functools.lru_cache(maxsize=64)
def sign_test_tail(n: int) -> tuple[float, ...]:
    """``sign_test_p(k, n)`` for every k = 0..n: the same tail sums, accumulated once (a rank's verdict costs one
    look-up, not a loop over its steps)."""
    if n > 1000:  # sign_test_p's exact big-integer sums
        return tuple(sign_test_p(k, n) for k in range(n + 1))
    term = total = 0.5**n
    tail = [min(1.0, total)] * (n + 1)
    for j in range(n, 0, -1):  # after term j, total is the tail from j - 1 on
        term *= j / (n - j + 1)
        total += term
        tail[j - 1] = min(1.0, total)
    tail[0] = 1.0
    return tuple(tail)


def others_median(x: np.ndarray) -> np.ndarray:
    """For a ranks x steps matrix (no NaN), each rank's peers' median per step: the median of the other rows."""
    n = x.shape[0]
    if n < 2:
        return np.full_like(x, np.nan)
    if np.isnan(x).any():  # NaN sorts last: kept to the order-based rule below, whatever a NaN makes of it
        return _others_median_by_order(x)
    m = n - 1  # peers per rank
    ks = [(m - 1) // 2] if m % 2 else [m // 2 - 1, m // 2]
    # Only the order statistics v[k] and v[k + 1] are needed: one partition, no sort. The k-th smallest of the others
    # is v[k] where this rank's value lies above it, else v[k + 1] (equal to v[k] where ties reach past k).
    v = np.partition(x, sorted({*ks, *(min(k + 1, n - 1) for k in ks)}), axis=0)

    def kth_of_others(k: int) -> np.ndarray:
        return np.where(x > v[k][None, :], v[k][None, :], v[min(k + 1, n - 1)][None, :])

    if m % 2:
        return kth_of_others(ks[0])
    return (kth_of_others(ks[0]) + kth_of_others(ks[1])) / 2


def others_mean(x: np.ndarray) -> np.ndarray:
    """For a ranks x steps matrix, each rank's peers' mean per step: the mean of the other rows."""
    n = x.shape[0]
    if n < 2:
        return np.full_like(x, np.nan)
    return (x.sum(axis=0, keepdims=True) - x) / (n - 1)


def _others_median_by_order(x: np.ndarray) -> np.ndarray:
    """``others_median`` by each value's position in its step's stable sort (where a step holds a NaN)."""
    n = x.shape[0]
    order = np.argsort(x, axis=0, kind="stable")
    v = np.take_along_axis(x, order, axis=0)  # sorted per step
    pos = np.empty_like(order)
    np.put_along_axis(pos, order, np.arange(n)[:, None].repeat(x.shape[1], axis=1), axis=0)
    m = n - 1  # peers per rank

    def kth_of_others(k: int) -> np.ndarray:
        # The k-th smallest of the others: v[k] if this rank sits above position k, else v[k + 1].
        return np.where(pos > k, v[k][None, :], v[min(k + 1, n - 1)][None, :])

    if m % 2:
        return kth_of_others((m - 1) // 2)
    return (kth_of_others(m // 2 - 1) + kth_of_others(m // 2)) / 2


def mean_above_zero_p(x: np.ndarray) -> float:
    """One-sided p that values with mean 0 give a mean as high as ``x``'s: t = mean / (sd / sqrt(n)), against the
    normal tail (n >= ``MIN_STEPS``). One large value alone (a single long pause) keeps t near 1: it is not enough."""
    n = x.size
    if n < 2:
        return 1.0
    mean, sd = float(x.mean()), float(x.std(ddof=1))
    if sd <= 0:
        return 0.0 if mean > 0 else 1.0
    return 0.5 * math.erfc(mean / (sd / math.sqrt(n)) / math.sqrt(2))


HOST_COLUMNS = ("collective_wait_s", "cpu_time_s", "data_time_s", "pp_wait_s", "step_time_s", "involuntary_switches",
                "host_stall_s")


class StragglerSample:
    """Per rank, the split of the measured steps on which collectives were timed (bounded by ``MAX_STEPS``), and the
    host figures of every measured step (``host``, bounded by ``MAX_HOST_STEPS``)."""

    def __init__(self):
        self.ranks: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self.host: dict[int, tuple[int, np.ndarray, dict[str, np.ndarray]]] = {}

    def add_host(self, rank: int, pp_rank: int, cols: dict[str, np.ndarray], measured) -> None:
        """One rank's host figures on its measured steps that recorded ``collective_wait_s`` and ``cpu_time_s``."""
        wait, cpu = cols.get("collective_wait_s"), cols.get("cpu_time_s")
        if wait is None or cpu is None:
            return
        if isinstance(measured, slice):
            idx = np.flatnonzero(~np.isnan(wait[measured]) & ~np.isnan(cpu[measured])) + (measured.start or 0)
        else:
            idx = np.flatnonzero(measured & ~np.isnan(wait) & ~np.isnan(cpu))
        if idx.size == 0:
            return
        if idx.size > MAX_HOST_STEPS:
            idx = idx[:: math.ceil(idx.size / MAX_HOST_STEPS)]
        out: dict[str, np.ndarray | None] = {}  # float32 (a thousand ranks stay small); None: not recorded (0)
        for name in HOST_COLUMNS:
            col = cols.get(name)
            col = None if col is None else col[idx]
            out[name] = None if col is None or np.isnan(col).all() else np.nan_to_num(col, nan=0.0).astype(np.float32)
        self.host[rank] = (pp_rank, cols["step"][idx].astype(np.int64), out)

    def add_rank(self, rank: int, pp_rank: int, cols: dict[str, np.ndarray], measured: np.ndarray) -> None:
        """One rank's prepared columns (``figures.prepare_rank``) and measured mask."""
        comm = cols.get("comm_time_s")
        if comm is None:
            return
        st = cols["step_time_s"]
        if isinstance(measured, slice):  # the measured records as one run (a view): no mask over the whole run
            idx = np.flatnonzero(~np.isnan(comm[measured])) + (measured.start or 0)
        else:
            idx = np.flatnonzero(measured & ~np.isnan(comm))
        if idx.size > MAX_STEPS:  # every rank samples the same step numbers, so the same stride keeps the same steps
            idx = idx[:: math.ceil(idx.size / MAX_STEPS)]
        data = cols.get("data_time_s")
        if data is None:
            data = np.zeros(idx.size)
        else:
            data = data[idx]
            if not np.isfinite(data).all():  # nan_to_num only where needed (it costs more than the rest here)
                data = np.nan_to_num(data, nan=0.0)
        # comm_time_s of a sampled step covers every collective and pipeline p2p the rank waited in (pp_wait_s is a
        # part of it), so nothing else is subtracted.
        busy = st[idx] - comm[idx]
        self.ranks[rank] = (pp_rank, cols["step"][idx].astype(np.int64), busy, data, comm[idx])

    def add(self, rank: int, pp_rank: int, cols: dict[str, np.ndarray], measured) -> None:
        """``add_rank`` and ``add_host``: everything the verdict reads of one rank."""
        self.add_rank(rank, pp_rank, cols, measured)
        self.add_host(rank, pp_rank, cols, measured)


def judge(sample: StragglerSample, step_median_s: float | None,
          node_of: Callable[[int], str | None] | None = None) -> tuple[list[RankVerdict], str]:
    """Every rank's verdict and one line saying what was found (or why nothing could be); ``node_of(rank)`` names
    the node of a straggler (asked for the named ranks only)."""
    if not sample.ranks and not sample.host:
        return [], ("not measured: no measured step had its collectives timed (profiling.communication on, with "
                    "profiling.communication_sample_interval below the number of measured steps)")
    if not step_median_s or step_median_s <= 0:
        return [], "not measured: no median step time"
    stages: dict[int, list[int]] = {}
    for rank, (pp, *_rest) in sorted({**sample.host, **sample.ranks}.items()):
        stages.setdefault(pp, []).append(rank)
    verdicts: list[RankVerdict] = []
    fewest = host_fewest = None
    for pp, ranks in sorted(stages.items()):
        found = _judge_stage(sample, pp, ranks, step_median_s)
        verdicts += found
        if len(ranks) > 1:
            n = found[0].steps_compared
            fewest = n if fewest is None else min(fewest, n)
            h = found[0].host_steps or 0
            host_fewest = h if host_fewest is None else min(host_fewest, h)
    _drop_pipeline_victims(verdicts)
    named = [v for v in verdicts if v.straggler]
    for v in named:
        v.node = node_of(v.rank) if node_of is not None else None
    if named:
        return verdicts, "; ".join(describe(v, step_median_s) for v in named)
    if fewest is None:
        return verdicts, "no verdict: no pipeline stage has two or more ranks to compare"
    if host_fewest is not None and host_fewest >= MIN_STEPS:
        return verdicts, (f"none: no rank is slower than its peers or late at their collectives (over {host_fewest} "
                          f"steps; busy time over {fewest} with timed collectives)")
    if fewest < MIN_STEPS:
        return verdicts, (f"inconclusive: {fewest} step(s) with timed collectives, {MIN_STEPS} needed (lower "
                          "profiling.communication_sample_interval, e.g. 1 to time every step)")
    return verdicts, f"none: no rank is slower than its peers (over {fewest} compared steps)"


def _stage_matrices(sample: StragglerSample, ranks: list[int]) -> tuple[int, list[np.ndarray] | None]:
    """The number of the stage's compared steps (those every rank sampled) and its busy, data and comm matrices
    (ranks x compared steps; None when no step is compared)."""
    rows = [sample.ranks[r] for r in ranks]
    first = rows[0][1]
    if (all(s[1].shape == first.shape for s in rows) and (first.size < 2 or bool(np.all(first[1:] > first[:-1])))
            and bool(np.all(np.vstack([s[1] for s in rows]) == first))):  # all sampled the same steps: the rows as kept
        if first.size == 0:
            return 0, None
        return int(first.size), [np.vstack([s[i] for s in rows]) for i in (2, 3, 4)]
    steps = first
    for s in rows[1:]:
        steps = np.intersect1d(steps, s[1], assume_unique=True)
    if steps.size == 0:
        return 0, None
    keep = [np.isin(s[1], steps, assume_unique=True) for s in rows]
    return int(steps.size), [np.vstack([s[i][k] for s, k in zip(rows, keep)]) for i in (2, 3, 4)]


def _judge_stage(sample: StragglerSample, pp: int, ranks: list[int], step_median_s: float) -> list[RankVerdict]:
    out = [RankVerdict(rank=r, pp_rank=pp) for r in ranks]
    if len(ranks) < 2:
        return out
    comm_rule: list[tuple[RankVerdict, int, float]] = []
    if all(r in sample.ranks for r in ranks):
        comm_rule = _judge_busy(sample, out, step_median_s)
    if all(r in sample.host for r in ranks):
        _judge_host(sample, out)
    if any(v.straggler for v in out):
        return out
    for v, waits_more, p in comm_rule:  # nobody is late: is somebody's own communication slow?
        v.straggler, v.cause, v.steps_slower, v.p_value = True, "communication", waits_more, p
    return out


def _judge_busy(sample: StragglerSample, out: list[RankVerdict], step_median_s: float
                ) -> list[tuple[RankVerdict, int, float]]:
    """The busy-time rule (module docstring) on the sampled steps, into ``out``; returns the ranks the communication
    rule would name (with their count of steps and p), applied only when no rank of the stage is named otherwise."""
    ranks = [v.rank for v in out]
    n, mats = _stage_matrices(sample, ranks)
    for v in out:
        v.steps_compared = n
    if mats is None:
        return []
    busy, data, comm = mats
    compute = busy - data
    e_busy, e_data, e_comp, e_comm = (x - others_median(x) for x in (busy, data, compute, comm))
    # Each rank's medians, all ranks in one call per matrix (row by row, as np.median of each row).
    med_busy, med_comp, m_e_busy, m_e_comp, m_e_data, m_e_comm = (np.median(x, axis=1) for x in (
        busy, compute, e_busy, e_comp, e_data, e_comm))
    z = None
    if len(ranks) >= 3:
        centre = float(np.median(med_busy))
        mad = 1.4826 * float(np.median(np.abs(med_busy - centre)))
        z = ((med_busy - centre) / max(mad, 0.01 * step_median_s)).tolist()  # identical peers: 1 % of the step
    tail = sign_test_tail(n)  # p of the sign test for every count of slower steps
    slower = np.count_nonzero(e_busy > 0, axis=1).tolist()
    cols = zip(med_busy.tolist(), med_comp.tolist(), m_e_busy.tolist(), m_e_comp.tolist(), m_e_data.tolist(),
               m_e_comm.tolist(), slower)
    for i, (v, (b, c, eb, ec, ed, em, k)) in enumerate(zip(out, cols)):
        v.busy_median_s, v.compute_median_s, v.excess_s, v.compute_excess_s = b, c, eb, ec
        v.data_excess_s, v.comm_excess_s = ed, em
        v.excess_share = v.excess_s / step_median_s
        v.steps_slower = k
        v.p_value = tail[k]
        v.z = None if z is None else z[i]
        if n >= MIN_STEPS and v.excess_share > THRESHOLD and v.p_value <= P_MAX:
            v.straggler = True
            v.cause = "data" if v.data_excess_s > v.compute_excess_s else "compute"
    if any(v.straggler for v in out):
        return []
    named = []
    for v, waits_more in zip(out, np.count_nonzero(e_comm > 0, axis=1).tolist()):
        p = tail[waits_more]
        if (n >= MIN_STEPS and v.comm_excess_s / step_median_s > THRESHOLD and p <= P_MAX
                and v.excess_s > -0.5 * v.comm_excess_s):
            named.append((v, waits_more, p))
    return named


def _host_matrices(sample: StragglerSample, ranks: list[int]) -> tuple[int, dict[str, np.ndarray] | None]:
    """The stage's host figures on the steps every rank recorded (ranks x steps per column of ``HOST_COLUMNS``)."""
    rows = [sample.host[r] for r in ranks]
    first = rows[0][1]
    if all(r[1].shape == first.shape and np.array_equal(r[1], first) for r in rows[1:]):
        keep = [slice(None)] * len(rows)
        steps = first
    else:
        steps = first
        for r in rows[1:]:
            steps = np.intersect1d(steps, r[1])
        keep = [np.isin(r[1], steps) for r in rows]
    if steps.size == 0:
        return 0, None

    def column(name: str) -> np.ndarray:
        return np.vstack([np.zeros(steps.size) if r[2][name] is None else r[2][name][k].astype(np.float64)
                          for r, k in zip(rows, keep)])

    return int(steps.size), {c: column(c) for c in HOST_COLUMNS}


def _judge_host(sample: StragglerSample, out: list[RankVerdict]) -> None:
    """The host-stall rule (module docstring) over every measured step, into ``out``."""
    n, m = _host_matrices(sample, [v.rank for v in out])
    for v in out:
        v.host_steps = n
    if m is None:
        return
    step_mean = float(m["step_time_s"].mean())
    step_median = float(np.median(m["step_time_s"]))
    if step_mean <= 0:
        return
    # Its time in the step outside collectives over its peers': how much longer they waited for it at the step's
    # collectives than it started the step after them (work between steps, e.g. rank 0's progress line, is not late).
    outside = m["step_time_s"] - m["collective_wait_s"]
    # Over its peers' mean, not their median: these figures are skewed on a busy machine (mostly small, now and then
    # a long descheduling), and a median below the mean would make every rank's mean excess positive.
    late = outside - others_mean(outside)
    cpu_x = m["cpu_time_s"] - others_mean(m["cpu_time_s"])
    data_x = m["data_time_s"] - others_mean(m["data_time_s"])
    p2p_x = m["pp_wait_s"] - others_mean(m["pp_wait_s"])
    sw_x = m["involuntary_switches"] - others_mean(m["involuntary_switches"])
    stall_x = None  # recorded by schema version 5 on
    if all(sample.host[v.rank][2]["host_stall_s"] is not None for v in out):
        stall_x = m["host_stall_s"] - others_mean(m["host_stall_s"])
    # Steps on which some rank was late by more than THRESHOLD of the median step, and which rank was the latest.
    worst = late.max(axis=0)
    big = worst > THRESHOLD * step_median
    latest = np.argmax(late, axis=0)
    steps_late = int(np.count_nonzero(big))
    for i, v in enumerate(out):
        v.late_s = float(late[i].mean())
        v.late_share = v.late_s / step_mean
        v.cpu_excess_s = float(cpu_x[i].mean())
        v.late_unexplained_s = v.late_s - v.cpu_excess_s - float(data_x[i].mean())
        v.p2p_excess_s = float(p2p_x[i].mean())
        v.switches_excess = float(sw_x[i].mean())
        v.steps_late = steps_late
        v.steps_latest = int(np.count_nonzero(big & (latest == i)))
        v.late_p = mean_above_zero_p(late[i])
        if stall_x is not None:
            v.stall_excess_s = float(stall_x[i].mean())
            v.stall_p = mean_above_zero_p(stall_x[i])
        arrived_late = (v.steps_latest >= 2 and v.late_share > THRESHOLD and v.late_p <= P_MAX
                and v.late_unexplained_s > max(0.5 * v.late_s, THRESHOLD * step_mean))
        stopped = stall_x is not None and v.stall_excess_s > THRESHOLD * step_mean and v.stall_p <= P_MAX
        if (n >= MIN_STEPS and (arrived_late or stopped)
                and v.cpu_excess_s <= THRESHOLD * step_mean):  # more CPU work than that: slow in its own code
            v.straggler, v.cause, v.busy_cause = True, HOST_STALLED, v.cause
            v.host_p = v.stall_p if stopped else v.late_p


def _own_stall_s(v: RankVerdict) -> float:
    """The part of a late rank's lateness that no pipeline neighbour explains: less its extra pipeline wait."""
    return (v.late_unexplained_s or 0.0) - max(v.p2p_excess_s or 0.0, 0.0)


def _drop_pipeline_victims(verdicts: list[RankVerdict]) -> None:
    """A stall travels down the pipeline: the stalled rank sends late, its neighbour in the next stage waits for it
    in its pipeline recv and arrives late at its own stage's collectives. Of the stalled-looking ranks of several
    stages, those whose lateness is mostly their extra pipeline wait, where another one's is its own, are its
    victims, not stalled (their busy-time verdict, if any, stands)."""
    stalled = [v for v in verdicts if v.cause == HOST_STALLED]
    if len({v.pp_rank for v in stalled}) < 2:
        return
    top = max(_own_stall_s(v) for v in stalled)
    for v in stalled:
        if _own_stall_s(v) < 0.5 * top:
            v.cause, v.busy_cause = v.busy_cause, None
            v.straggler = v.cause is not None


def describe(v: RankVerdict, step_median_s: float) -> str:
    """``rank 2 (node n1): compute, busy +0.301 s/step over its peers (+152 % of the step), on 18 of 18 steps
    (p 3.8e-06)``; a stalled rank: ``rank 1: host stalled, late at collectives +0.12 s/step over its peers (+31 % of
    the step), +0.001 s/step of it on its CPU, +0.4 involuntary switches/step, the latest on 40 of 41 steps where a
    rank was late (p 2e-22)``."""
    if v.cause == HOST_STALLED:
        node = f" (node {v.node})" if v.node else ""
        kept = ("" if v.stall_excess_s is None else
                f"kept from running {v.stall_excess_s:+.3g} s/step over its peers (p {v.stall_p:.2g}), ")
        return (f"rank {v.rank}{node}: {HOST_STALLED}, {kept}late at collectives {v.late_s:+.3g} s/step over its "
                f"peers ({100 * v.late_share:+.0f} % of the step), {v.cpu_excess_s:+.3g} s/step of it on its CPU, "
                f"{v.switches_excess:+.3g} involuntary switches/step, the latest on {v.steps_latest} of "
                f"{v.steps_late} steps where a rank was late, over {v.host_steps} steps (p {v.late_p:.2g})")
    excess = (v.comm_excess_s if v.cause == "communication" else v.excess_s) or 0.0
    node = f" (node {v.node})" if v.node else ""
    z = f", z {v.z:.1f}" if v.z is not None else ""
    what = "waits" if v.cause == "communication" else "busy"
    return (f"rank {v.rank}{node}: {v.cause}, {what} +{excess:.3g} s/step over its peers "
            f"(+{100 * excess / step_median_s:.0f} % of the step), on {v.steps_slower} of {v.steps_compared} steps "
            f"(p {v.p_value:.2g}{z})")
