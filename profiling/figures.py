"""The measured figures of a run, each defined once: the run summary (``summary.json``), ``analyze`` and its report, and
the planner's calibration all reduce step records through this module and nothing else.

``DEFINITIONS`` (``profiling.definitions``, re-exported here) states every figure in words (the report prints it as its
method section); the code below is the definition. Input: the per-rank step records (``profiling.schema``), found and
read through ``profiling.records``. A run is reduced one rank file at a time (``RunReducer.add_rank``), so a trace of
millions of records is never held whole: each rank leaves a few numbers (``RankFigures``) and its share of per-step
arrays indexed by step number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from profiling import stragglers as straggler_rules
from profiling.definitions import DEFINITIONS, definitions_text  # noqa: F401  (importers of figures' words keep them)
from profiling.records import is_constant
from profiling.schema import fields
from profiling.units import GB  # the one memory unit, defined in profiling.units; importers of figures.GB keep it

# The record fields the figures read; every one but step and step_time_s is optional. val_loss (schema version 2) is
# set at evaluation steps only; version-1 files lack it and read as no validation loss.
COLUMNS = fields("step", "restart", "pp_rank", "step_time_s", "tokens", "data_time_s", "comm_time_s", "pp_wait_s",
                 "loss", "model_flops", "hardware_flops", "tflops_per_gpu", "mfu", "mem_allocated_max_bytes",
                 "mem_reserved_max_bytes", "rss_bytes", "val_loss", "cpu_time_s", "involuntary_switches",
                 "collective_wait_s", "host_stall_s", "moe_load_imbalance", "moe_aux_loss")
REQUIRED = fields("step", "step_time_s")
STRAGGLER_THRESHOLD = straggler_rules.THRESHOLD  # excess busy time (share of the step) that makes a straggler

# The job's figures, in the order the run summary and analyze's per-run table carry them.
JOB_FIGURES = ("ranks_measured", "steps_measured", "warmup_steps", "step_time_median_s", "step_time_p10_s",
               "step_time_p90_s", "step_time_mean_s", "tokens_per_step", "tokens_per_s", "tokens_per_s_per_gpu",
               "model_flops_per_step", "hardware_flops_per_step", "peak_tflops_per_gpu", "tflops_per_gpu", "mfu", "hfu",
               "data_share", "comm_share", "bubble_share", "bubble_share_per_stage", "bubble_share_theory",
               "mem_allocated_peak_bytes", "mem_reserved_peak_bytes", "rss_peak_bytes", "peak_mem_gb", "peak_mem_kind",
               "rank_skew", "slowest_rank", "stragglers", "straggler_nodes", "straggler_verdict", "last_loss",
               "moe_load_imbalance_median", "moe_load_imbalance_max", "moe_aux_loss")


# --- the warm-up rule and the requeue rule --------------------------------------------------------------------------

def is_warmup(step, first_step_of_start, warmup: int):
    """The warm-up rule for one step (or an array of them): fewer than ``warmup`` steps after its start's first."""
    return step - first_step_of_start < warmup


def warmup_mask(steps: np.ndarray, restart: np.ndarray | None, warmup: int) -> np.ndarray:
    """True for the warm-up records of one rank, in file order: a record is warm-up when its step is fewer than
    ``warmup`` steps after the first step its start (its ``restart`` value) recorded."""
    if steps.size == 0:
        return np.zeros(0, dtype=bool)
    # the common case (a NaN makes min and max differ)
    one_start = restart is None or is_constant(restart) or restart.min() == restart.max()
    if not one_start:
        restart = np.nan_to_num(restart, nan=0.0)
        one_start = bool(np.all(restart == restart[0]))
    if one_start:  # no sort
        first = steps[0]
    else:
        _, first_idx, inverse = np.unique(restart, return_index=True, return_inverse=True)
        first = steps[first_idx][inverse]
    return is_warmup(steps, first, warmup)


def keep_last(steps: np.ndarray) -> np.ndarray | None:
    """Indices (sorted) of the last record of each step; None when every step is recorded once, in order."""
    if steps.size < 2 or np.all(np.diff(steps) > 0):
        return None
    _, first_in_rev = np.unique(steps[::-1], return_index=True)
    return np.sort(steps.size - 1 - first_in_rev)


def prepare_rank(cols: dict[str, np.ndarray], warmup: int, layout: StepLayout | None = None
                 ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One rank's columns with the requeue rule applied (last record of a step wins), and the mask of its measured
    (not warm-up) records. ``layout``: the rank's ``StepLayout`` when the caller has it (else it is worked out)."""
    layout = layout or StepLayout.of(cols["step"], cols.get("restart"), warmup)
    if layout.keep is not None:
        cols = {k: v[layout.keep] for k, v in cols.items()}
    return cols, layout.measured


@dataclass
class StepLayout:
    """What one rank's ``step`` and ``restart`` columns decide, whatever its other columns hold: which records count
    (the requeue rule), which are warm-up, and where its steps go in per-step arrays. The ranks of a run mostly record
    the same steps in the same starts, so ``RunReducer`` works it out once and reuses it while they do."""

    step: np.ndarray  # the step column it was worked out from (as read)
    restart: np.ndarray | None
    warmup: int
    keep: np.ndarray | None  # ``keep_last``
    measured: np.ndarray  # mask over the kept records
    steps: np.ndarray  # the kept records' steps, int64, unique
    at: np.ndarray | slice  # ``step_index(steps)``
    size: int  # the last step + 1
    warm_steps: np.ndarray  # the kept warm-up records' steps
    measured_sel: np.ndarray | slice  # ``selector(measured)``

    @classmethod
    def of(cls, step: np.ndarray, restart: np.ndarray | None, warmup: int) -> StepLayout:
        warm = warmup_mask(step, restart, warmup)
        keep = keep_last(step)
        steps = (step if keep is None else step[keep]).astype(np.int64)
        if keep is not None:
            warm = warm[keep]
        at = step_index(steps, increasing=keep is None)  # keep_last found them strictly increasing
        return cls(step=step, restart=restart, warmup=warmup, keep=keep, measured=~warm, steps=steps, at=at,
                   size=int(steps[-1] if isinstance(at, slice) else steps.max()) + 1, warm_steps=steps[warm],
                   measured_sel=selector(~warm))

    def fits(self, step: np.ndarray, restart: np.ndarray | None, warmup: int) -> bool:
        """True when a rank with these columns has this layout (the same steps in the same starts)."""
        if warmup != self.warmup or step.size != self.step.size or not np.array_equal(step, self.step):
            return False
        if restart is None or self.restart is None:
            return restart is None and self.restart is None
        if is_constant(restart) and is_constant(self.restart):
            return bool(restart[0] == self.restart[0])
        return bool(np.array_equal(restart, self.restart, equal_nan=True))


# --- per rank ---------------------------------------------------------------------------------------------------------

@dataclass
class RankFigures:
    """One rank's figures (see DEFINITIONS); step-time figures over its measured steps, memory over all steps."""

    rank: int
    pp_rank: int
    steps_measured: int
    step_time_median_s: float
    step_time_p10_s: float
    step_time_p90_s: float
    step_time_mean_s: float
    data_share: float | None
    comm_share: float | None
    bubble_share: float | None
    mem_allocated_peak_bytes: float | None
    mem_reserved_peak_bytes: float | None
    rss_peak_bytes: float | None
    peak_mem_gb: float | None
    peak_mem_kind: str | None
    slowdown_vs_median: float | None = None
    straggler: bool = False
    straggler_cause: str | None = None
    node: str | None = None
    busy_median_s: float | None = None
    compute_median_s: float | None = None
    excess_s: float | None = None
    excess_share: float | None = None
    steps_compared: int | None = None
    steps_slower: int | None = None
    straggler_p: float | None = None
    straggler_z: float | None = None
    late_s: float | None = None
    late_share: float | None = None
    late_unexplained_s: float | None = None
    cpu_excess_s: float | None = None
    switches_excess: float | None = None
    stall_excess_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        # Every field is a scalar: a shallow dict equals asdict(), without its per-field deep copies (a thousand ranks)
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def _share(cols: dict[str, np.ndarray], name: str, step_time: np.ndarray) -> float | None:
    """sum(part) / sum(step time) over the steps where the part was recorded."""
    part = cols.get(name)
    if part is None:
        return None
    whole = part.sum()
    if not np.isnan(whole):  # recorded on every step (data time): a NaN anywhere makes the sum NaN
        total = step_time.sum()
        return float(whole / total) if part.size and total > 0 else None
    ok = ~np.isnan(part)
    total = step_time[ok].sum()
    return float(part[ok].sum() / total) if ok.any() and total > 0 else None


def _peak(values: np.ndarray | None) -> float | None:
    if values is None or values.size == 0:
        return None
    if is_constant(values):
        return None if np.isnan(values[0]) else float(values[0])
    if np.all(np.isnan(values)):
        return None
    return float(np.nanmax(values))


def peak_memory(allocated: float | None, rss: float | None) -> tuple[float | None, str | None]:
    """(peak_mem_gb, peak_mem_kind): the allocated peak on GPUs, else the host RSS."""
    if allocated is not None:
        return allocated / GB, "gpu_allocated"
    if rss is not None:
        return rss / GB, "host_rss"
    return None, None


def percentiles(values: np.ndarray, q=(10, 50, 90)) -> np.ndarray:
    """``np.percentile(values, q)`` (linear interpolation), bit for bit, from one sort: numpy partitions once per
    wanted order statistic, which costs several times a sort (the step-time quantiles of every rank of a long run)."""
    values = np.sort(values)
    n = values.size
    if n == 0 or np.isnan(values[-1]):  # NaN sorts last; numpy's own rules for it
        return np.percentile(values, q)
    # numpy's "linear" method: virtual index (n - 1) q, its floor and the next index, lerp with numpy's _lerp.
    virtual = (n - 1) * np.true_divide(np.asarray(q), 100)
    below = np.floor(virtual)
    gamma = virtual - below
    below = below.astype(np.intp)
    a, b = values[below], values[np.minimum(below + 1, n - 1)]
    diff = b - a
    out = a + diff * gamma
    np.subtract(b, diff * (1 - gamma), out=out, where=gamma >= 0.5)
    return out


def selector(mask: np.ndarray) -> np.ndarray | slice:
    """``mask`` as a slice when its True entries are one contiguous run (one start after its warm-up: the common
    case), so that selecting the measured records is a view, not a copy; else the mask itself."""
    if not isinstance(mask, np.ndarray):
        return mask
    count = int(np.count_nonzero(mask))
    first = int(np.argmax(mask)) if count else 0
    return slice(first, first + count) if count == 0 or mask[first:first + count].all() else mask


def rank_figures(rank: int, cols: dict[str, np.ndarray], measured: np.ndarray | slice) -> RankFigures | None:
    """One rank's figures from its prepared columns (``prepare_rank``); None when it has no measured step."""
    measured = selector(measured)
    st = cols["step_time_s"][measured]
    if st.size == 0:
        return None
    p10, p50, p90 = percentiles(st)
    sub = {k: cols[k][measured] for k in ("data_time_s", "comm_time_s", "pp_wait_s") if k in cols}
    alloc, reserved, rss = (_peak(cols.get(c)) for c in ("mem_allocated_max_bytes", "mem_reserved_max_bytes",
                                                          "rss_bytes"))
    mem_gb, kind = peak_memory(alloc, rss)
    pp = cols.get("pp_rank")
    return RankFigures(rank=rank, pp_rank=int(pp[0]) if pp is not None and not np.isnan(pp[0]) else 0,
                       steps_measured=int(st.size), step_time_median_s=float(p50), step_time_p10_s=float(p10),
                       step_time_p90_s=float(p90), step_time_mean_s=float(st.mean()),
                       data_share=_share(sub, "data_time_s", st), comm_share=_share(sub, "comm_time_s", st),
                       bubble_share=_share(sub, "pp_wait_s", st), mem_allocated_peak_bytes=alloc,
                       mem_reserved_peak_bytes=reserved, rss_peak_bytes=rss, peak_mem_gb=mem_gb, peak_mem_kind=kind)


def mark_stragglers(ranks: list[RankFigures], sample: straggler_rules.StragglerSample | None = None,
                    step_median_s: float | None = None, node_of=None) -> dict[str, Any]:
    """Set each rank's slowdown_vs_median and its straggler verdict (``profiling.stragglers``: by what the rank does,
    not by its step time); returns the job's rank_skew, slowest_rank, stragglers, straggler_nodes, straggler_verdict."""
    if not ranks:
        return {"rank_skew": None, "slowest_rank": None, "stragglers": "", "straggler_nodes": "",
                "straggler_verdict": "not measured: no measured step"}
    medians = np.array([r.step_time_median_s for r in ranks])
    centre = float(np.median(medians))
    for r in ranks:
        r.slowdown_vs_median = r.step_time_median_s / centre - 1.0 if centre > 0 else None
    verdicts, line = straggler_rules.judge(sample or straggler_rules.StragglerSample(), step_median_s, node_of)
    by_rank = {v.rank: v for v in verdicts}
    for r in ranks:
        v = by_rank.get(r.rank)
        if v is None:
            continue
        r.straggler, r.straggler_cause, r.node = v.straggler, v.cause, v.node
        r.busy_median_s, r.compute_median_s, r.excess_s, r.excess_share = (v.busy_median_s, v.compute_median_s,
                                                                             v.excess_s, v.excess_share)
        r.steps_compared, r.steps_slower, r.straggler_p, r.straggler_z = (v.steps_compared, v.steps_slower,
                                                                           v.p_value, v.z)
        r.late_s, r.late_share, r.late_unexplained_s, r.cpu_excess_s, r.switches_excess = (
            v.late_s, v.late_share, v.late_unexplained_s, v.cpu_excess_s, v.switches_excess)
        r.stall_excess_s = v.stall_excess_s
        if v.cause == straggler_rules.HOST_STALLED:  # how sure: the host rule's steps and p
            r.steps_compared, r.steps_slower, r.straggler_p = v.host_steps, v.steps_latest, v.host_p
    named = [v for v in verdicts if v.straggler]
    return {"rank_skew": float((medians.max() - medians.min()) / centre) if centre > 0 else None,
            "slowest_rank": ranks[int(np.argmax(medians))].rank,
            "stragglers": ",".join(str(v.rank) for v in named),
            "straggler_nodes": ",".join(dict.fromkeys(v.node for v in named if v.node)),
            "straggler_verdict": line}


# --- the job ----------------------------------------------------------------------------------------------------------

def bubble_share_theory(bubble_fraction: float | None) -> float | None:
    """(p-1)/(v m) is relative to the ideal compute time; as a share of the whole step it is b / (1 + b)."""
    return None if bubble_fraction is None else bubble_fraction / (1 + bubble_fraction)


def step_index(steps: np.ndarray, increasing: bool = False) -> np.ndarray | slice:
    """``steps`` (unique, int) as a slice when they are one contiguous increasing range, else the array itself.
    ``increasing``: the caller knows they are strictly increasing (then the first and last step decide)."""
    first, last = int(steps[0]), int(steps[-1])
    if last - first + 1 == steps.size and (increasing or steps.size < 2 or bool(np.all(np.diff(steps) == 1))):
        return slice(first, last + 1)
    return steps


def _add_mean_terms(total: np.ndarray, count: np.ndarray, n: int, steps: np.ndarray, at: np.ndarray | slice,
                    values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Add one rank's per-step values (NaN: not reported) to a per-step sum and count of reporting ranks."""
    complete = not np.isnan(values.sum())  # no NaN: one pass instead of a mask (the training loss of the last stage)
    ok = None if complete else ~np.isnan(values)
    if ok is not None and not ok.any():
        return total, count
    total, count = _grow(total, n, 0.0), _grow(count, n, 0.0)
    if complete:
        total[at] += values
        count[at] += 1.0
    else:
        total[steps[ok]] += values[ok]
        count[steps[ok]] += 1.0
    return total, count


def _grow(arr: np.ndarray, size: int, fill: float | bool) -> np.ndarray:
    if arr.size >= size:
        return arr
    out = np.full(size, fill, dtype=arr.dtype)
    out[: arr.size] = arr
    return out


def _median_or_none(values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    if is_constant(values):
        return None if np.isnan(values[0]) else float(values[0])
    if values.size and values.min() == values.max():  # one value, no NaN (a NaN makes the min NaN, never equal)
        return float(values[0])
    values = values[~np.isnan(values)]
    if values.size and values.min() == values.max():  # a per-job constant (tokens, FLOPs): no partition needed
        return float(values[0])
    return float(np.median(values)) if values.size else None


def _max_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _mean_or_none(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


class Prepared(NamedTuple):
    """One rank as ``RunReducer.add_rank`` folded it in."""

    cols: dict[str, np.ndarray]  # ``prepare_rank``'s columns
    measured: np.ndarray  # mask of the measured records
    layout: StepLayout


class RunReducer:
    """Reduces a run's rank files one at a time into the job's figures.

    Per-step arrays are indexed by step number: ``step_time_max_s`` (the slowest rank per step, NaN where none
    recorded it), ``step_warmup`` (a warm-up step on some rank), ``loss_sum``/``loss_count`` (over ranks).
    """

    def __init__(self, warmup: int, max_step: int | None = None):
        self.warmup = warmup
        self.max_step = max_step
        self.ranks: list[RankFigures] = []
        self.straggler_sample = straggler_rules.StragglerSample()
        self.node_of = None  # rank -> node name, for the named stragglers (set by whoever knows the record files)
        self.step_time_max_s = np.empty(0)
        self.step_warmup = np.zeros(0, dtype=bool)
        self.loss_sum = np.empty(0)
        self.loss_count = np.empty(0)
        self.val_loss_sum = np.empty(0)
        self.val_loss_count = np.empty(0)
        self.files = 0
        self._tokens: list[float | None] = []
        self._flops: list[float | None] = []
        self._hw_flops: list[float | None] = []
        self._peaks: list[float | None] = []
        self._mem: list[tuple[float | None, float | None, float | None]] = []
        self._moe: list[tuple[float | None, float | None, float | None]] = []  # imbalance median, max; aux mean
        self._layout: StepLayout | None = None  # the last rank's, reused while the ranks record the same steps

    def add_rank(self, rank: int, cols: dict[str, np.ndarray]) -> Prepared | None:
        """Fold one rank's columns (``profiling.records.read_columns(path, COLUMNS)``) in; returns its prepared columns,
        measured mask and step layout (for callers that bin them further), or None for a file without step records."""
        if any(c not in cols for c in REQUIRED) or cols["step"].size == 0:
            return None
        self.files += 1
        layout = self._layout
        if layout is None or not layout.fits(cols["step"], cols.get("restart"), self.warmup):
            layout = self._layout = StepLayout.of(cols["step"], cols.get("restart"), self.warmup)
        cols, measured = prepare_rank(cols, self.warmup, layout)
        steps = layout.steps
        n = max(layout.size, (self.max_step or 0) + 1)
        self.step_time_max_s = _grow(self.step_time_max_s, n, np.nan)
        self.step_warmup = _grow(self.step_warmup, n, False)
        # Steps are unique after keep_last: plain indexing is exact, and a slice where they are one contiguous range
        # (the common case) updates in place without the gather and scatter of fancy indexing.
        at = layout.at
        self.step_time_max_s[at] = np.fmax(self.step_time_max_s[at], cols["step_time_s"])
        if layout.warm_steps.size:
            self.step_warmup[layout.warm_steps] = True
        loss = cols.get("loss")
        if loss is not None:
            self.loss_sum, self.loss_count = _add_mean_terms(self.loss_sum, self.loss_count, n, steps, at, loss)
        val = cols.get("val_loss")  # the same rule as the training loss: the mean over the ranks that report it
        if val is not None:
            self.val_loss_sum, self.val_loss_count = _add_mean_terms(self.val_loss_sum, self.val_loss_count, n, steps,
                                                                     at, val)
        measured_sel = layout.measured_sel  # a view where it can be: the columns below are selected without copies
        figures = rank_figures(rank, cols, measured_sel)
        if figures is not None:
            self.ranks.append(figures)
            self.straggler_sample.add(rank, figures.pp_rank, cols, measured_sel)
        self._tokens.append(_median_or_none(cols["tokens"][measured_sel] if "tokens" in cols else None))
        self._flops.append(_median_or_none(cols["model_flops"][measured_sel] if "model_flops" in cols else None))
        self._hw_flops.append(_median_or_none(cols["hardware_flops"][measured_sel] if "hardware_flops" in cols
                                              else None))
        if "tflops_per_gpu" in cols and "mfu" in cols:
            with np.errstate(divide="ignore", invalid="ignore"):
                self._peaks.append(_median_or_none((cols["tflops_per_gpu"] / cols["mfu"])[measured_sel]))
        if figures is not None:  # the same peaks over the same prepared columns: not computed twice
            self._mem.append((figures.mem_allocated_peak_bytes, figures.mem_reserved_peak_bytes,
                              figures.rss_peak_bytes))
        else:
            self._mem.append(tuple(_peak(cols.get(c)) for c in ("mem_allocated_max_bytes", "mem_reserved_max_bytes",
                                                                  "rss_bytes")))
        self._moe.append(_moe_figures(cols, measured_sel))
        return Prepared(cols, measured, layout)

    def measured_step_times(self) -> np.ndarray:
        """The slowest rank's time of every measured step, in step order."""
        st = self.step_time_max_s
        return st[~np.isnan(st) & ~self.step_warmup]

    def figures(self, world_size: int | None = None, bubble_fraction: float | None = None) -> dict[str, Any]:
        """The job's figures (``JOB_FIGURES``, defined in ``DEFINITIONS``). ``world_size`` defaults to the number of
        ranks measured; ``bubble_fraction`` is the layout's (p-1)/(v m), None without pipeline parallelism."""
        from profiling.peaks import hfu, mfu

        after = self.measured_step_times()
        world = world_size or max(len(self.ranks), 1)
        out: dict[str, Any] = {"ranks_measured": len(self.ranks), "steps_measured": int(after.size),
                               "warmup_steps": self.warmup}
        if after.size:
            p10, p50, p90 = percentiles(after)
            out.update(step_time_median_s=float(p50), step_time_p10_s=float(p10), step_time_p90_s=float(p90),
                       step_time_mean_s=float(after.mean()))
        else:
            out.update(step_time_median_s=None, step_time_p10_s=None, step_time_p90_s=None, step_time_mean_s=None)
        med = out["step_time_median_s"]
        tokens, flops, hw, peak = (_first(v) for v in (self._tokens, self._flops, self._hw_flops, self._peaks))
        out["tokens_per_step"] = tokens
        out["tokens_per_s"] = tokens / med if tokens and med else None
        out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / world if out["tokens_per_s"] else None
        out["model_flops_per_step"], out["hardware_flops_per_step"], out["peak_tflops_per_gpu"] = flops, hw, peak
        out["tflops_per_gpu"] = flops / med / world / 1e12 if flops and med else None
        out["mfu"] = mfu(flops, med, world, peak) if flops and med else None
        out["hfu"] = hfu(hw, med, world, peak) if hw and med else None
        out["data_share"] = _mean_or_none([r.data_share for r in self.ranks])
        out["comm_share"] = _mean_or_none([r.comm_share for r in self.ranks])
        stages: dict[int, list[float]] = {}
        for r in self.ranks:
            if r.bubble_share is not None:
                stages.setdefault(r.pp_rank, []).append(r.bubble_share)
        per_stage = {str(k): float(np.mean(v)) for k, v in sorted(stages.items())}
        out["bubble_share"] = min(per_stage.values()) if per_stage else None
        out["bubble_share_per_stage"] = per_stage or None
        out["bubble_share_theory"] = bubble_share_theory(bubble_fraction)
        alloc, reserved, rss = (_max_or_none([m[i] for m in self._mem]) for i in range(3))
        out.update(mem_allocated_peak_bytes=alloc, mem_reserved_peak_bytes=reserved, rss_peak_bytes=rss)
        out["peak_mem_gb"], out["peak_mem_kind"] = peak_memory(alloc, rss)
        out.update(mark_stragglers(self.ranks, self.straggler_sample, med, self.node_of))
        out["last_loss"] = self.last_loss()
        moe = next((m for m in self._moe if m[0] is not None), (None, None, None))  # the same on every rank
        out["moe_load_imbalance_median"], out["moe_load_imbalance_max"], out["moe_aux_loss"] = moe
        return {k: out[k] for k in JOB_FIGURES}

    def last_loss(self) -> float | None:
        have = np.nonzero(self.loss_count > 0)[0]
        return float(self.loss_sum[have[-1]] / self.loss_count[have[-1]]) if have.size else None

    def step_losses(self, steps: np.ndarray, validation: bool = False) -> np.ndarray:
        """Mean loss over the ranks that report it, per given step (NaN where none does); ``validation``: the
        validation loss (``val_loss``, set at evaluation steps only)."""
        total, count = (self.val_loss_sum, self.val_loss_count) if validation else (self.loss_sum, self.loss_count)
        loss = np.full(steps.size, np.nan)
        idx = steps[steps < count.size]
        with np.errstate(invalid="ignore", divide="ignore"):
            loss[: idx.size] = np.where(count[idx] > 0, total[idx] / count[idx], np.nan)
        return loss


def _moe_figures(cols: dict[str, np.ndarray], measured) -> tuple[float | None, float | None, float | None]:
    """One rank's router figures over its measured steps: imbalance median and max, aux loss mean (DEFINITIONS)."""
    imbalance = cols.get("moe_load_imbalance")
    if imbalance is None:
        return None, None, None
    values = np.asarray(imbalance[measured], dtype=float)
    values = values[~np.isnan(values)]
    if not values.size:
        return None, None, None
    aux = cols.get("moe_aux_loss")
    aux_values = np.asarray(aux[measured], dtype=float) if aux is not None else np.empty(0)
    aux_values = aux_values[~np.isnan(aux_values)]
    return (float(np.median(values)), float(values.max()),
            float(aux_values.mean()) if aux_values.size else None)


def all_to_all_share(comm_rows: list[dict[str, Any]], step_time_median_s: float | None) -> float | None:
    """All-to-all time per sampled rank-step / the median step time (DEFINITIONS), from ``comm_table`` rows; None
    when no all-to-all was timed."""
    rows = [r for r in comm_rows if r.get("kind") == "all_to_all" and r.get("samples")]
    if not rows or not step_time_median_s:
        return None
    samples = max(r["samples"] for r in rows)  # every group size's row counts the same sampled rank-steps
    return sum(r["time_s"] for r in rows) / samples / step_time_median_s


def _first(values: list[float | None]) -> float | None:
    return next((v for v in values if v is not None), None)


def node_reader(records_dir: Path):
    """rank -> the node its records name (read only for the ranks asked about: the named stragglers)."""
    from profiling.records import first_value

    return lambda rank: first_value(records_dir, rank, "node")


def reduce_records(records_dir: Path, warmup: int, max_step: int | None = None) -> RunReducer:
    """Every rank file of a run folder's ``records/`` folded into one reducer, streamed one rank at a time
    (``profiling.records.iter_rank_columns``: memory stays bounded however long the run)."""
    from profiling.records import iter_rank_columns

    reducer = RunReducer(warmup, max_step)
    reducer.node_of = node_reader(records_dir)
    for rank, cols in iter_rank_columns(records_dir, COLUMNS):
        reducer.add_rank(rank, cols)
    return reducer


def comm_table(records_dir: Path, warmup: int) -> list[dict[str, Any]]:
    """Sampled collectives of the measured steps (see DEFINITIONS), one row per (kind, group size)."""
    from profiling.records import rank_files, read_columns, read_comm_rows

    measured_rows: list[dict[str, Any]] = []
    for rank, path in rank_files(records_dir).items():
        rows = read_comm_rows(records_dir, rank)
        if not rows:
            continue
        cols = read_columns(path, ("step", "restart"))
        if "step" not in cols:
            continue
        cols, measured = prepare_rank(cols, warmup)
        restart = cols.get("restart", np.zeros(cols["step"].size))
        # The (step, start) pairs whose records count: a re-run step's earlier collectives are superseded too.
        kept = set(zip(cols["step"][measured].astype(int).tolist(),
                       np.nan_to_num(restart[measured]).astype(int).tolist()))
        measured_rows += [row for row in rows if (row.get("step"), row.get("restart", 0)) in kept]
    return sum_comm(measured_rows)


def sum_comm(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sampled-collective rows (``profiling.comm.per_kind`` rows) summed per (kind, group size), with bandwidths."""
    from profiling.comm import busbw_factor

    acc: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        a = acc.setdefault((row["kind"], row["group_size"]), {
            "kind": row["kind"], "group_size": row["group_size"], "calls": 0, "bytes": 0, "time_s": 0.0,
            "span_s": 0.0, "samples": 0})
        for key in ("calls", "bytes", "time_s", "span_s"):
            a[key] += row[key]
        a["samples"] += 1  # (rank, step) pairs sampled
    for a in acc.values():
        a["algbw_gbps"] = a["bytes"] / a["span_s"] / 1e9 if a["span_s"] > 0 else None
        algbw = a["algbw_gbps"]
        a["busbw_gbps"] = None if algbw is None else algbw * busbw_factor(a["kind"], a["group_size"])
    return sorted(acc.values(), key=lambda a: (a["kind"], a["group_size"]))
