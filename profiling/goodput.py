"""Goodput: how much of a run's allocation trained the model, and where the rest went (the buckets of Google's
ml-goodput-measurement, from what the run folder records).

A run has one *life* per start of its ranks (the first start, each Slurm requeue, each ``resume``). Each life is
anchored by the start event its lowest rank's collector writes (``records/events_rank<R>.jsonl``, see
``profiling.collector``), or, for runs without events files, by the manifest's ``started`` events. A step record or
event belongs to the latest life that began before it.

Per life, in seconds of wall time (x world size = GPU-seconds, or rank-seconds on CPU):

- allocation: from the life's start (the earliest of its rank process start and the launcher's manifest event,
  ``launched`` / ``batch started`` / ``started``) to its end (the first manifest event after its last activity
  that leaves a live state: completed, failed, preempted, requeued..., written by the ranks or the launcher; else
  its last record or event; now, for the running life). Slurm's own verdicts (``slurm ...`` events) are stamped
  when someone asked, not when the job ended, so they do not end a life;
- start-up: from the life's start to the beginning of its first step, less its checkpoint load;
- checkpoint load and checkpoint blocked: the times the training loop measured around ``engine.resume`` (with the
  checkpoint verification) and the time each save blocked training (``checkpoint_save`` events: the whole save when
  synchronous; with ``checkpoint.async_save`` the staging and the commit, not the background write), the slowest
  rank's per save;
- preflight: the ``preflight`` events' seconds (``cluster.preflight``: the allocation checked before step 1,
  ``hpc_tools.runtime.preflight``), the slowest rank's per life, taken out of the life's start-up; and the health
  checks repeated while training (``health_check`` events, ``hpc_tools.runtime.health``: the same checks between two
  steps), the slowest rank's per check;
- recovery: the ``recovery`` events' seconds (a restart inside the allocation: from the fault to the new life's first
  step, recorded by the restart machinery); taken out of the life's start-up;
- productive: the step time of every step whose record is final (no later life recorded that step again), trained
  in the recipe's layout;
- degraded: the same for the steps an elastic run (``cluster.min_nodes``) trained on fewer nodes, in the layout the
  planner chose for them (the manifest's ``layouts``: each from the step it resumed at), with the throughput ratio
  (the median final step time in the recipe's layout over the median on fewer nodes; the global batch is the same);
- lost work: the step time of the steps a later life recomputed (recorded again after a failure lost them), with
  their count;
- evaluation: the ``eval_time_s`` of the lowest rank's records (validation loss after a step, never part of its
  step time; records of schema version 1 have none);
- other: the rest of the allocation (between-step work such as the stop agreement and logging, the end-of-job
  summary, a step cut short by a kill);
- requeue wait (outside the allocation): from a life's end to the next life's start (queue time after a requeue,
  or the pause before a ``resume``).

Hangs: each one the hang watchdog named (the manifest's ``hangs``, ``hpc_tools.runtime.watchdog``) with its detection
time, the seconds from the phase's last progress to the verdict (``hang_detection_s``, in order): the part of the
allocation a hang costs before anything acts, within the phase's calibrated bound (``hpc_tools.runtime.hang_bounds``).

goodput = (productive + degraded) / allocation. Step times are the lowest rank's (every rank ends a synchronous step
together).
Manifest times have one-second resolution; the collector's times are exact.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

START_EVENTS = ("launched", "batch started", "started")
LIVE_STATES = ("CREATED", "PENDING", "STARTING", "RUNNING")
BUCKETS = ("productive", "degraded", "startup", "preflight", "checkpoint_load", "checkpoint_blocked", "recovery",
           "lost_work", "evaluation", "other")
ALIASES = {"checkpoint_save": "checkpoint_blocked"}
"""Older names of buckets, still given in ``summary()`` and ``total()`` (same values)."""


def _ts(iso: str | None) -> float | None:
    if not iso:
        return None
    try:
        return dt.datetime.fromisoformat(iso).timestamp()
    except ValueError:
        return None


@dataclass
class Life:
    """One start of the ranks (see the module docstring)."""

    index: int
    start: float
    end: float
    first_step_start: float | None = None
    steps: int = 0
    productive_s: float = 0.0
    degraded_s: float = 0.0
    lost_work_s: float = 0.0
    recomputed_steps: int = 0
    checkpoint_load_s: float = 0.0
    checkpoint_blocked_s: float = 0.0
    saves: int = 0
    recovery_s: float = 0.0
    evaluation_s: float = 0.0
    preflight_s: float = 0.0
    health_s: float = 0.0  # the health checks between steps (in the preflight bucket, not out of start-up)

    @property
    def allocation_s(self) -> float:
        return max(self.end - self.start, 0.0)

    @property
    def startup_s(self) -> float:
        if self.first_step_start is None:
            return max(self.allocation_s - self.checkpoint_load_s - self.recovery_s - self.preflight_s, 0.0)
        return max(self.first_step_start - self.start - self.checkpoint_load_s - self.recovery_s - self.preflight_s,
                   0.0)


@dataclass
class Goodput:
    """A run's goodput and badput buckets; seconds are wall time of the job, hours are x world size."""

    world_size: int
    unit: str  # "GPU" or "rank"
    lives: list[Life] = field(default_factory=list)
    requeue_wait_s: float = 0.0
    live: bool = False
    degraded_ratio: float | None = None  # throughput on fewer nodes / in the recipe's layout (None: never degraded)
    hangs: list[dict[str, Any]] = field(default_factory=list)  # the manifest's ``hangs``: phase, bound, detection time

    def seconds(self) -> dict[str, float]:
        """Wall seconds per bucket (``BUCKETS``), summed over lives; ``other`` closes the allocation."""
        out = {"productive": sum(life.productive_s for life in self.lives),
               "degraded": sum(life.degraded_s for life in self.lives),
               "startup": sum(life.startup_s for life in self.lives),
               "preflight": sum(life.preflight_s + life.health_s for life in self.lives),
               "checkpoint_load": sum(life.checkpoint_load_s for life in self.lives),
               "checkpoint_blocked": sum(life.checkpoint_blocked_s for life in self.lives),
               "recovery": sum(life.recovery_s for life in self.lives),
               "lost_work": sum(life.lost_work_s for life in self.lives),
               "evaluation": sum(life.evaluation_s for life in self.lives)}
        out["other"] = max(self.allocation_s - sum(out.values()), 0.0)
        return out

    @property
    def allocation_s(self) -> float:
        return sum(life.allocation_s for life in self.lives)

    @property
    def goodput(self) -> float | None:
        alloc = self.allocation_s
        secs = self.seconds()
        return (secs["productive"] + secs["degraded"]) / alloc if alloc > 0 else None

    def summary(self) -> dict[str, Any]:
        """One flat row: allocation and bucket hours (x world size), shares, goodput, lives, recomputed steps."""
        secs = self.seconds()
        alloc = self.allocation_s
        row: dict[str, Any] = {"unit": self.unit, "world_size": self.world_size, "lives": len(self.lives),
                               "allocation_hours": alloc * self.world_size / 3600, "goodput": self.goodput,
                               "recomputed_steps": sum(life.recomputed_steps for life in self.lives),
                               "checkpoint_saves": sum(life.saves for life in self.lives),
                               "requeue_wait_s": self.requeue_wait_s, "allocation_s": alloc, "live": self.live,
                               "degraded_ratio": self.degraded_ratio, "hangs": len(self.hangs),
                               "hang_detection_s": [h.get("detected_after_s") for h in self.hangs]}
        for name, s in secs.items():
            row[f"{name}_s"] = s
            row[f"{name}_hours"] = s * self.world_size / 3600
        for old, new in ALIASES.items():
            row[f"{old}_s"], row[f"{old}_hours"] = row[f"{new}_s"], row[f"{new}_hours"]
        return row

    def table(self) -> list[dict[str, Any]]:
        """Rows (bucket, wall seconds, unit-hours, share of the allocation), the requeue wait last (no share: it is
        outside the allocation)."""
        alloc = self.allocation_s
        rows = [{"bucket": name, "seconds": s, "hours": s * self.world_size / 3600,
                 "share": s / alloc if alloc > 0 else None} for name, s in self.seconds().items()]
        rows.append({"bucket": "requeue_wait", "seconds": self.requeue_wait_s,
                     "hours": self.requeue_wait_s * self.world_size / 3600, "share": None})
        return rows

    def as_dict(self) -> dict[str, Any]:
        return {**self.summary(), "buckets": self.table(), "per_life": [asdict(life) for life in self.lives]}


def _lowest_rank_columns(records_dir: Path) -> dict[str, np.ndarray]:
    from profiling.records import rank_files, read_columns

    files = rank_files(records_dir)
    if not files:
        return {}
    return read_columns(files[min(files)], ("step", "restart", "time", "step_time_s", "eval_time_s"))


def measure(records_dir: Path, manifest: dict[str, Any], world_size: int, gpu: bool,
            now: float | None = None) -> Goodput:
    """The goodput of the run whose records and manifest are given (see the module docstring)."""
    from profiling.records import read_events

    now = time.time() if now is None else now
    cols = _lowest_rank_columns(Path(records_dir))
    events = read_events(Path(records_dir))
    out = Goodput(world_size=world_size, unit="GPU" if gpu else "rank",
                  live=str(manifest.get("state", "")).upper() in ("RUNNING", "STARTING", "PENDING", "REQUEUED"))
    out.hangs = [h for h in manifest.get("hangs") or [] if isinstance(h, dict)]
    have_steps = "step" in cols and "time" in cols and cols["step"].size > 0
    step_start = cols["time"] - cols["step_time_s"] if have_steps else np.empty(0)
    anchors, process_starts = _anchors(events, manifest, step_start)
    if not anchors:
        return out
    manifest_events = [(t, e.get("event"), e.get("state")) for e in manifest.get("events", [])
                       if (t := _ts(e.get("time")))]
    ended = [t for t, name, state in manifest_events
             if state and state not in LIVE_STATES and not str(name).startswith("slurm ")]
    owned = _events_by_life({r: [e for e in es if e.get("event") != "preflight"] for r, es in events.items()}, anchors)
    preflight = _preflight_by_life(events, anchors)
    life_of_step = np.searchsorted(anchors, step_start, side="right") - 1 if have_steps else np.empty(0, int)
    lives = []
    for k, anchor in enumerate(anchors):
        nxt = anchors[k + 1] if k + 1 < len(anchors) else np.inf
        life = Life(index=k, start=anchor, end=anchor)
        prev_end = lives[-1].end if lives else -np.inf
        launch = [t for t, name, _ in manifest_events if name in START_EVENTS and prev_end - 1 < t <= anchor]
        life.start = min([anchor, *launch, *([process_starts[k]] if process_starts.get(k) else [])])
        in_life = life_of_step == k
        last_activity = anchor
        if have_steps and in_life.any():
            life.first_step_start = float(step_start[in_life].min())
            last_activity = max(last_activity, float(cols["time"][in_life].max()))
            life.steps = int(in_life.sum())
            if "eval_time_s" in cols:
                life.evaluation_s = float(np.nansum(cols["eval_time_s"][in_life]))
                # an evaluation ends after its step's record time: the life lasted at least that long
                last_activity += float(np.nan_to_num(cols["eval_time_s"][in_life][-1:]).sum())
        last_activity = _count_events(life, owned.get(k, []), last_activity)
        life.preflight_s = preflight.get(k, 0.0)
        ends = [t for t in ended if last_activity - 1 <= t < nxt]
        if ends:
            life.end = max(last_activity, min(ends))
        elif k == len(anchors) - 1 and out.live:
            life.end = max(now, last_activity)
        else:
            life.end = last_activity
        lives.append(life)
    if have_steps:
        out.degraded_ratio = _productive_and_lost(cols, life_of_step, lives, fewer_nodes_steps(manifest))
    out.lives = lives
    out.requeue_wait_s = float(sum(max(b.start - a.end, 0.0) for a, b in zip(lives, lives[1:])))
    return out


def _count_events(life: Life, owned: list[dict[str, Any]], last_activity: float) -> float:
    """A life's own events into ``life``: its checkpoint load and recovery (the slowest rank's), each step's save
    once (the slowest rank's seconds, summed as the time saves blocked); returns the latest event time, or
    ``last_activity`` when that is later."""
    saves: dict[Any, float] = {}
    checks: dict[Any, float] = {}
    for e in owned:
        last_activity = max(last_activity, e["time"])
        if e.get("event") == "checkpoint_load":
            life.checkpoint_load_s = max(life.checkpoint_load_s, float(e.get("seconds") or 0.0))
        elif e.get("event") == "checkpoint_save":
            saves[e.get("step")] = max(saves.get(e.get("step"), 0.0), float(e.get("seconds") or 0.0))
        elif e.get("event") == "recovery":  # one per life (a restart starts a life): the slowest rank's
            life.recovery_s = max(life.recovery_s, float(e.get("seconds") or 0.0))
        elif e.get("event") == "health_check":  # one per check, at a step: the slowest rank's
            checks[e.get("step")] = max(checks.get(e.get("step"), 0.0), float(e.get("seconds") or 0.0))
    life.checkpoint_blocked_s, life.saves = float(sum(saves.values())), len(saves)
    life.health_s = float(sum(checks.values()))
    return last_activity


def _preflight_by_life(events: dict[int, list[dict[str, Any]]], anchors: list[float]) -> dict[int, float]:
    """life index -> its preflight's seconds (the slowest rank's). Preflight runs before the collector starts, so its
    event belongs to the first life anchored at or after it, not to the one before."""
    out: dict[int, float] = {}
    for rank_events in events.values():
        for e in rank_events:
            if e.get("event") == "preflight" and e.get("time") is not None:
                k = min(int(np.searchsorted(anchors, e["time"], side="left")), len(anchors) - 1)
                out[k] = max(out.get(k, 0.0), float(e.get("seconds") or 0.0))
    return out


def _events_by_life(events: dict[int, list[dict[str, Any]]], anchors: list[float]) -> dict[int, list[dict]]:
    """life index -> the events of every rank in it. A rank's events belong to the life of its own latest start event
    (ranks start their collectors a little apart, so the lowest rank's anchors cannot split another rank's events);
    a rank's start event is matched to the nearest life anchor."""
    out: dict[int, list[dict]] = {}
    for rank_events in events.values():
        life = 0
        for e in sorted((e for e in rank_events if e.get("time") is not None), key=lambda e: e["time"]):
            if e.get("event") == "start":
                life = int(np.argmin([abs(a - e["time"]) for a in anchors]))
            out.setdefault(life, []).append(e)
    return out


def _anchors(events: dict[int, list[dict[str, Any]]], manifest: dict[str, Any],
             step_start: np.ndarray) -> tuple[list[float], dict[int, float]]:
    """Life anchor times (sorted) and, per life, the rank process start when the collector recorded it."""
    if events:
        lowest = events[min(events)]
        starts = [e for e in lowest if e.get("event") == "start" and e.get("time") is not None]
        if starts:
            starts.sort(key=lambda e: e["time"])
            return ([float(e["time"]) for e in starts],
                    {k: float(e["process_start"]) for k, e in enumerate(starts) if e.get("process_start")})
    started = sorted(t for e in manifest.get("events", []) if e.get("event") == "started"
                     and (t := _ts(e.get("time"))) is not None)
    if started:
        if step_start.size:  # a record before the first manifest start (clock skew): anchor the first life earlier
            started[0] = min(started[0], float(step_start.min()))
        return started, {}
    return ([float(step_start.min())] if step_start.size else []), {}


def fewer_nodes_steps(manifest: dict[str, Any]) -> list[tuple[int, float]]:
    """The step ranges (first, last] an elastic run trained on fewer nodes than its recipe's (the manifest's
    ``layouts``: each layout from the step it resumed at to the next one's)."""
    layouts = [e for e in manifest.get("layouts") or [] if isinstance(e, dict)]
    if not layouts:
        return []
    full = max(int(e.get("nodes") or 0) for e in layouts)
    out = []
    for e, nxt in zip(layouts, [*layouts[1:], None]):
        if int(e.get("nodes") or 0) < full:
            out.append((int(e.get("from_iteration") or 0),
                        float(nxt.get("from_iteration") or 0) if nxt is not None else np.inf))
    return out


def _productive_and_lost(cols: dict[str, np.ndarray], life_of_step: np.ndarray, lives: list[Life],
                         fewer: list[tuple[int, float]] = ()) -> float | None:
    """Final records are productive (degraded: those of the steps in ``fewer``'s ranges); a record whose step a later
    life recorded again is lost work. Returns the throughput ratio on fewer nodes (None without such steps)."""
    steps, st = cols["step"], cols["step_time_s"]
    life = np.asarray(life_of_step, dtype=np.int64)
    if steps.size == 0:
        return
    # The last life that recorded each step: its record is the one that counts.
    _, which = np.unique(steps, return_inverse=True)
    last_life = np.full(int(which.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(last_life, which, life)
    counted = life >= 0
    lost = counted & (last_life[which] > life)
    n = len(lives)
    # Per life, summed in record order (bincount adds its weights in order, as a loop over the records would).
    lost_s = np.bincount(life[lost], weights=st[lost], minlength=n)
    recomputed = np.bincount(life[lost], minlength=n)
    kept = counted & ~lost
    on_fewer = np.zeros(steps.shape, dtype=bool)
    for first, last in fewer:
        on_fewer |= (steps > first) & (steps <= last)
    full, degraded = kept & ~on_fewer, kept & on_fewer
    productive_s = np.bincount(life[full], weights=st[full], minlength=n)
    degraded_s = np.bincount(life[degraded], weights=st[degraded], minlength=n)
    for k, item in enumerate(lives):
        item.lost_work_s += float(lost_s[k])
        item.recomputed_steps += int(recomputed[k])
        item.productive_s += float(productive_s[k])
        item.degraded_s += float(degraded_s[k])
    if not degraded.any() or not full.any():
        return None
    return float(np.median(st[full]) / np.median(st[degraded]))


def total(goodputs: list[Goodput]) -> dict[str, Any]:
    """A sweep's goodput: allocation and buckets summed over its runs in unit-hours (runs differ in world size)."""
    if not goodputs:
        return {}
    hours = {f"{b}_hours": sum(g.summary()[f"{b}_hours"] for g in goodputs) for b in BUCKETS}
    hours.update({f"{old}_hours": hours[f"{new}_hours"] for old, new in ALIASES.items()})
    alloc = sum(g.summary()["allocation_hours"] for g in goodputs)
    units = {g.unit for g in goodputs}
    return {"runs": len(goodputs), "unit": units.pop() if len(units) == 1 else "GPU/rank",
            "allocation_hours": alloc, **hours,
            "requeue_wait_hours": sum(g.requeue_wait_s * g.world_size / 3600 for g in goodputs),
            "recomputed_steps": sum(g.summary()["recomputed_steps"] for g in goodputs),
            "goodput": (hours["productive_hours"] + hours["degraded_hours"]) / alloc if alloc > 0 else None}
