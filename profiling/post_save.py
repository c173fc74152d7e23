"""Post-save step inflation: how many training steps right after each checkpoint save ran slower than the run's steady
steps, and by how much.

A save blocks training only for its staging when it is written in the background (``checkpoint.async_save``, the
node-local tier's copy to the next node); the write then competes with the next steps for memory bandwidth, PCIe,
the file system and the CPU, and others measured those steps up to 10x slower while the copy drains. Goodput counts
only the blocked time (``profiling.goodput``: checkpoint blocked); this module measures what follows, from the lowest
rank's step records and its ``checkpoint_save`` events (a synchronous step ends on every rank together):

- steady median: the median step time of the measured steps (each start's warm-up steps left out, the rule of
  ``profiling.figures``) that are not among the first ``SETTLE_STEPS`` after a save;
- per save of step s: the steps s+1, s+2, ... of the same start (the save's ``restart``), up to the next save's step
  and at most ``MAX_AFTER`` of them, counted while each one is longer than ``INFLATED`` x the steady median (the
  first step that is not ends the count, so a slow step later on is not the save's); their count (``steps``), the
  time they took beyond the median (``extra_s``), the first step's ratio to the median and the largest ratio;
- totals: the saves measured, how many were followed by inflated steps, the mean and largest count, the extra time
  summed (``extra_s``), its share of the run's step time, the largest ratio; each kind of save (``async`` or not)
  separately too, since a synchronous save's next steps are the reference an async save's are compared with.

The save's event is written when the save ends (for a background write: at its commit, steps later); its step
number, not its time, says where the save began: right after that step's record.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

INFLATED = 1.25
"""A step counts as inflated when it is longer than this many times the steady median (a loaded machine's noise stays
below it on most steps; the count stops at the first step that is not)."""
MAX_AFTER = 20
"""At most this many steps after a save are looked at."""
SETTLE_STEPS = 3
"""The first steps after each save left out of the steady median."""


@dataclass
class SaveInflation:
    """The steps after one save."""

    step: int
    restart: int
    async_: bool
    tier: str
    steps: int = 0  # consecutive steps after the save longer than INFLATED x the steady median
    extra_s: float = 0.0  # their time beyond the steady median
    first_ratio: float | None = None  # the first step after the save over the steady median (None: no such step)
    max_ratio: float | None = None  # the largest ratio among the counted steps (None when none counted)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["async"] = out.pop("async_")
        return out


@dataclass
class PostSave:
    """A run's post-save inflation (see the module docstring)."""

    steady_median_s: float | None
    threshold: float = INFLATED
    saves: list[SaveInflation] = field(default_factory=list)
    step_time_s: float = 0.0  # the measured steps' total, the share's denominator

    def totals(self, which: list[SaveInflation] | None = None) -> dict[str, Any]:
        saves = self.saves if which is None else which
        hit = [s for s in saves if s.steps]
        extra = float(sum(s.extra_s for s in saves))
        ratios = [s.max_ratio for s in hit if s.max_ratio is not None]
        firsts = [s.first_ratio for s in saves if s.first_ratio is not None]
        return {"saves": len(saves), "saves_inflated": len(hit),
                "mean_steps": float(np.mean([s.steps for s in saves])) if saves else 0.0,
                "max_steps": max((s.steps for s in saves), default=0), "extra_s": extra,
                "extra_share": extra / self.step_time_s if self.step_time_s > 0 else None,
                "max_ratio": max(ratios) if ratios else None,
                "mean_first_ratio": float(np.mean(firsts)) if firsts else None}

    def as_dict(self) -> dict[str, Any]:
        """``status --json``'s ``post_save``: the steady median, the threshold, the totals (all saves, then async and
        synchronous ones) and one row per save."""
        return {"steady_median_s": self.steady_median_s, "threshold": self.threshold, **self.totals(),
                "async": self.totals([s for s in self.saves if s.async_]),
                "sync": self.totals([s for s in self.saves if not s.async_]),
                "per_save": [s.as_dict() for s in self.saves]}


def _lowest_rank(records_dir: Path) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    from profiling.records import rank_files, read_columns, read_events

    files = rank_files(records_dir)
    events = read_events(records_dir)
    cols = read_columns(files[min(files)], ("step", "restart", "step_time_s")) if files else {}
    return cols, (events[min(events)] if events else [])


def measure(records_dir: Path, warmup: int) -> PostSave:
    """The post-save inflation of the run whose records are in ``records_dir`` (``warmup``: the recipe's
    ``profiling.warmup_steps``)."""
    cols, events = _lowest_rank(Path(records_dir))
    saves = {}  # (restart, step) -> event: one row per save (a retried event for the same step counts once)
    for e in events:
        if e.get("event") == "checkpoint_save" and e.get("step") is not None:
            saves[(int(e.get("restart") or 0), int(e["step"]))] = e
    return compute(cols, [(r, s, bool(e.get("async", False)), str(e.get("tier", "shared")))
                          for (r, s), e in sorted(saves.items())], warmup)


def compute(cols: dict[str, np.ndarray], saves: list[tuple[int, int, bool, str]], warmup: int) -> PostSave:
    """The inflation from one rank's columns (``step``, ``restart``, ``step_time_s``) and its saves ((restart, step,
    async, tier), sorted)."""
    from profiling.figures import warmup_mask

    if not cols or cols.get("step") is None or cols["step"].size == 0:
        return PostSave(None, saves=[SaveInflation(s, r, a, t) for r, s, a, t in saves])
    step = cols["step"].astype(np.int64)
    restart = cols["restart"].astype(np.int64) if cols.get("restart") is not None else np.zeros_like(step)
    st = cols["step_time_s"].astype(np.float64)
    valid = np.isfinite(st) & ~warmup_mask(step, restart, warmup)
    settling = np.zeros(step.shape, dtype=bool)
    for r, s, _, _ in saves:
        settling |= (restart == r) & (step > s) & (step <= s + SETTLE_STEPS)
    steady = st[valid & ~settling]
    if steady.size == 0:  # a save after every few steps: every measured step settles; the median of all of them
        steady = st[valid]
    median = float(np.median(steady)) if steady.size else None
    out = PostSave(median, saves=[], step_time_s=float(st[valid].sum()))
    next_step = {(r, s): min([s2 for r2, s2, _, _ in saves if r2 == r and s2 > s], default=None)
                 for r, s, _, _ in saves}
    for r, s, async_, tier in saves:
        row = SaveInflation(s, r, async_, tier)
        out.saves.append(row)
        if median is None or median <= 0:
            continue
        last = min(s + MAX_AFTER, next_step[(r, s)] or s + MAX_AFTER)
        times = _after(step, restart, st, r, s, last)
        if times:
            row.first_ratio = times[0] / median
        for t in times:
            if t <= INFLATED * median:
                break
            row.steps += 1
            row.extra_s += t - median
            row.max_ratio = max(row.max_ratio or 0.0, t / median)
    return out


def _after(step: np.ndarray, restart: np.ndarray, st: np.ndarray, r: int, s: int, last: int) -> list[float]:
    """The step times of steps s+1..last of start ``r`` while they follow each other (a gap ends them: a step lost to
    a failure or not recorded)."""
    where = {int(k): float(v) for k, v in zip(step[(restart == r) & (step > s) & (step <= last)],
                                               st[(restart == r) & (step > s) & (step <= last)])}
    out = []
    for k in range(s + 1, last + 1):
        if k not in where or not np.isfinite(where[k]):
            break
        out.append(where[k])
    return out


def text(p: dict[str, Any] | None) -> str | None:
    """One line for ``status`` and the reports: ``N of M saves slowed the next steps: K steps on average (at most
    L), up to Rx the steady S s/step, E s in all (P of the step time)``; None without saves."""
    if not p or not p.get("saves"):
        return None
    if p.get("steady_median_s") is None:
        return f"{p['saves']} save(s); no measured steps to compare the steps after them with"
    median = p["steady_median_s"]
    head = f"{p['saves_inflated']} of {p['saves']} save(s) slowed the next steps (> {p['threshold']:g}x the steady " \
           f"{median:.4g} s/step)"
    if not p["saves_inflated"]:
        first = f"; the first step after a save {p['mean_first_ratio']:.2f}x on average" \
            if p.get("mean_first_ratio") is not None else ""
        return head + first
    share = f" ({p['extra_share'] * 100:.2g} % of the step time)" if p.get("extra_share") is not None else ""
    return (head + f": {p['mean_steps']:.2g} step(s) per save on average (at most {p['max_steps']}), up to "
            f"{p['max_ratio']:.2f}x, {p['extra_s']:.3g} s beyond the median in all{share}")
