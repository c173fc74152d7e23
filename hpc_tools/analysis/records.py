"""Reading a run's step records at scale: streamed one rank file at a time (one pyarrow dataset scan over the run's
rank files, only the needed columns), each reduced as soon as read, so memory holds a few rank files and the per-rank
and per-step results, never the run's records.

The files are found and read by ``profiling.records`` (the owner of their names) and reduced by
``profiling.figures.RunReducer`` (the owner of every figure's definition), the same reducer the run summary and the
calibration use. This module adds what only the analysis shows: a binned step-time row per rank for the heatmap and
per-step timelines over the ranks (MFU, memory, learning rate, gradient norm) for the report's plots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from profiling.figures import COLUMNS, RankFigures, RunReducer, StepLayout
from profiling.records import iter_rank_columns
from profiling.schema import fields

HEATMAP_BINS = 100
# Per-step timelines: record field -> how the ranks of a step are combined ("mean", or "range": the max and the min
# over the ranks, the band of a memory timeline).
TIMELINES = {"mfu": "mean", "mem_allocated_max_bytes": "range", "mem_reserved_max_bytes": "range", "rss_bytes": "range",
             "lr": "mean", "grad_norm": "mean"}
# The columns read: the figures' and the timelines' (lr and the gradient norm are the same on every rank that has them).
READ = tuple(dict.fromkeys(COLUMNS + fields(*TIMELINES)))

__all__ = ["COLUMNS", "HEATMAP_BINS", "TIMELINES", "RunRecords", "read_run"]


@dataclass
class RunRecords:
    """A run's records reduced: the figures' reducer (per-rank figures, per-step arrays) and the heatmap."""

    reducer: RunReducer
    heatmap: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))  # ranks x bins, mean step time
    heatmap_edges: np.ndarray = field(default_factory=lambda: np.empty(0))
    heatmap_ranks: list[int] = field(default_factory=list)
    _bin_cache: tuple | None = field(default=None, repr=False)  # (steps, bin index, counts, runs per bin)
    # field -> per-step arrays indexed by step number: (sum, count) for "mean", (max, min) for "range"
    timelines: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def ranks(self) -> list[RankFigures]:
        return self.reducer.ranks

    @property
    def warmup_steps(self) -> int:
        return self.reducer.warmup

    @property
    def source_files(self) -> int:
        return self.reducer.files

    def timeline(self, name: str, steps: np.ndarray) -> dict[str, np.ndarray]:
        """A field's per-step timeline at ``steps``: {name: mean} or {name_max, name_min} over the ranks; {} when no
        rank recorded the field."""
        if name not in self.timelines:
            return {}
        a, b = self.timelines[name]
        inside = steps < a.size
        first, second = np.full(steps.size, np.nan), np.full(steps.size, np.nan)
        first[inside], second[inside] = a[steps[inside]], b[steps[inside]]
        if TIMELINES[name] == "mean":
            with np.errstate(invalid="ignore", divide="ignore"):
                return {name: np.where(second > 0, first / second, np.nan)}
        return {f"{name}_max": first, f"{name}_min": second}


def read_run(records_dir: Path, warmup: int, max_step: int | None = None) -> RunRecords:
    """Reduce every rank file of a run; ``max_step`` (train_iters) sizes the per-step arrays and heatmap bins."""
    out = RunRecords(reducer=RunReducer(warmup, max_step))
    heat_rows: list[np.ndarray] = []
    for rank, cols in iter_rank_columns(Path(records_dir), READ):
        prepared = out.reducer.add_rank(rank, cols)
        if prepared is None:
            continue
        cols, layout = prepared.cols, prepared.layout
        heat_rows.append(_heatmap_row(out, layout.steps, cols["step_time_s"], max_step))
        out.heatmap_ranks.append(rank)
        _add_timelines(out, layout, cols)
    if heat_rows:
        out.heatmap = np.vstack(heat_rows)
    return out


def _add_timelines(out: RunRecords, layout: StepLayout, cols: dict[str, np.ndarray]) -> None:
    """Fold one rank's prepared columns (one record per step, NaN where not measured) into the per-step timelines."""
    size = layout.size
    at = layout.at  # a slice for one contiguous range: in-place updates without a gather
    for name, how in TIMELINES.items():
        values = cols.get(name)
        if values is None:
            continue
        a, b = out.timelines.get(name, (np.empty(0), np.empty(0)))
        if a.size < size:
            fill = 0.0 if how == "mean" else np.nan
            a = np.concatenate([a, np.full(size - a.size, fill)])
            b = np.concatenate([b, np.full(size - b.size, fill)])
        if how == "mean":
            a[at] += np.nan_to_num(values)
            b[at] += ~np.isnan(values)
        else:  # fmax / fmin skip NaN: an unmeasured step leaves the others' range as it was
            a[at] = np.fmax(a[at], values)
            b[at] = np.fmin(b[at], values)
        out.timelines[name] = (a, b)


def _heatmap_row(out: RunRecords, steps: np.ndarray, step_time: np.ndarray, max_step: int | None) -> np.ndarray:
    """Mean step time of one rank per step bin; the bins (at most HEATMAP_BINS) are fixed by the first rank read."""
    if out.heatmap_edges.size == 0:
        last = int(max(max_step or 0, int(steps.max())))
        bins = min(HEATMAP_BINS, max(last, 1))
        out.heatmap_edges = np.linspace(1, last + 1, bins + 1)
    bins = out.heatmap_edges.size - 1
    cached = out._bin_cache
    if cached is not None and (cached[0] is steps or (cached[0].size == steps.size
                                                      and np.array_equal(cached[0], steps))):
        _, idx, counts, runs = cached  # the ranks of a run mostly record the same steps: bin them once
    else:
        idx = np.clip(np.searchsorted(out.heatmap_edges, steps, side="right") - 1, 0, bins - 1)
        counts = np.bincount(idx, minlength=bins)
        runs = None  # steps in order (the common case): each bin's records are one run, summed by one reduceat
        if idx.size and bool(np.all(idx[1:] >= idx[:-1])):
            starts = np.flatnonzero(np.concatenate(([True], idx[1:] != idx[:-1])))
            runs = (starts, idx[starts])
        out._bin_cache = (steps, idx, counts, runs)
    if runs is None:
        sums = np.bincount(idx, weights=step_time, minlength=bins)
    else:
        sums = np.zeros(bins)
        sums[runs[1]] = np.add.reduceat(step_time, runs[0])
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
