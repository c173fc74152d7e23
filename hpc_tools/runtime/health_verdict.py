"""Health while training, without torch: when the next check runs, which nodes a series of checks names, what the
run folder and the manifest keep, and the one line ``status`` and the report show (docs/preflight.md, "Health while
training"). The measurements are preflight's (``preflight.measure``), the per-check verdict is preflight's
(``preflight.verdict.judge``); this module only adds what repeating them needs.

- ``next_step``: checks are every ``profiling.health_interval_min`` minutes, but every rank must take the check at the
  same step (it is collective) without a collective per step to agree on the time: each check gathers every rank's
  seconds per step since the previous check, and every rank derives the same next step from the slowest rank's rate.
  The first check of a start follows the warm-up, so that the rate and the collectives' baseline exist early.
- ``Tracker``: a node is *named* when ``CONFIRM`` checks in a row find it slow (one check can fall in a moment other
  work took the host; a throttled node is slow in every check); a node named once stays named for the start.
- ``Record``: what ``health.json`` holds (every check: its step, seconds, each node's GEMM and verdict; the named
  nodes, this start's and, in ``named_all``, every start's) and the manifest's ``health`` summary; ``summary_line``
  is the status and report line.
- The world all-reduce at a small size is compared with the start's first check: below ``EXPECTED_FLOOR`` x that
  baseline is a job-level problem (a link or switch degraded; no single node is named by it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_tools.runtime.preflight.verdict import EXPECTED_FLOOR, OK
from profiling.files import atomic_write

CONFIRM = 2
"""Checks in a row that must find a node slow before it is named (the done-when allows three after the fault)."""
REPORT_NAME = "health.json"
KEEP_CHECKS = 500  # checks kept in health.json (a week at the default interval): the file stays small
MIN_STEPS_APART = 1


def next_step(step: int, interval_s: float, seconds_per_step: list[float]) -> int:
    """The step of the next check after a check at ``step``: ``interval_s`` ahead at the slowest rank's measured
    seconds per step (the same list on every rank, hence the same answer), at least ``MIN_STEPS_APART`` ahead."""
    rate = max([s for s in seconds_per_step if s and s > 0 and math.isfinite(s)], default=0.0)
    if rate <= 0:
        return step + MIN_STEPS_APART
    return step + max(MIN_STEPS_APART, int(interval_s / rate))


def first_step(first: int, warmup: int) -> int:
    """The first check of a start: after the warm-up steps (compilation and allocator warm-up are not a node's
    speed), so that later checks have a rate and a baseline."""
    return first + max(warmup, 1)


@dataclass
class Tracker:
    """Which nodes the checks of this start name: ``streak`` counts each node's checks in a row found slow;
    ``named`` the nodes confirmed (``CONFIRM``), with the check that named them."""

    confirm: int = CONFIRM
    streak: dict[str, int] = field(default_factory=dict)
    named: dict[str, int] = field(default_factory=dict)

    def add(self, check: int, slow: list[str]) -> list[str]:
        """Check number ``check`` found ``slow``; the nodes it names for the first time."""
        self.streak = {n: self.streak.get(n, 0) + 1 for n in slow}
        new = [n for n, k in self.streak.items() if k >= self.confirm and n not in self.named]
        for n in new:
            self.named[n] = check
        return new


def slow_nodes(rows: list[Any]) -> list[str]:
    """The nodes a check's table (``verdict.NodeRow``) finds not ok."""
    return [r.node for r in rows if r.verdict != OK]


def link_problem(busbw: float | None, baseline: float | None, nbytes: int) -> str | None:
    """The world all-reduce's bus bandwidth against the start's first check (``EXPECTED_FLOOR``)."""
    if busbw is None or not baseline or busbw >= EXPECTED_FLOOR * baseline:
        return None
    return (f"all-reduce busbw over all ranks {busbw:.3g} GB/s at {nbytes / 2**20:g} MiB is {busbw / baseline:.2f}x "
            f"the first check's {baseline:.3g} GB/s (below {EXPECTED_FLOOR}x)")


@dataclass
class Record:
    """This start's checks (rank 0 keeps it): ``health.json`` and the manifest's ``health``."""

    start: int
    interval_min: float
    checks: list[dict] = field(default_factory=list)
    named: dict[str, dict] = field(default_factory=dict)
    seconds: float = 0.0
    started: float = 0.0  # wall clock of the first step of this start (time.time())

    def add(self, check: dict) -> None:
        self.checks.append(check)
        self.seconds += check["seconds"]

    def name(self, node: str, row: Any, check: dict, action: str) -> dict:
        about = {"node": node, "start": self.start, "step": check["step"], "check": check["check"],
                 "time": check["time"], "reasons": list(row.reasons), "gemm_tflops": row.gemm_tflops,
                 "verdict": row.verdict, "action": action}
        self.named[node] = about
        return about

    def share(self, now: float) -> float | None:
        """The checks' share of this start's wall time since its first step."""
        wall = now - self.started
        return self.seconds / wall if wall > 0 and self.started else None

    def summary(self, now: float) -> dict:
        share = self.share(now)
        return {"start": self.start, "interval_min": self.interval_min, "checks": len(self.checks),
                "seconds": round(self.seconds, 3), "share": None if share is None else round(share, 5),
                "last_step": self.checks[-1]["step"] if self.checks else None, "named": list(self.named.values())}

    def write(self, run_dir: Path, now: float) -> Path:
        """``health.json``: this start's checks and named nodes, and (``named_all``) the nodes earlier starts named,
        which a restart that left them out must not erase from the file."""
        path = Path(run_dir) / REPORT_NAME
        before = read_report(run_dir) or {}
        summary = self.summary(now)
        data = {"version": 1, **summary, "checks_kept": self.checks[-KEEP_CHECKS:], "confirm": CONFIRM,
                "named_all": merged_named(before.get("named_all") or before.get("named"), summary["named"])}
        atomic_write(path, json.dumps(data, indent=1, default=str) + "\n")
        return path


def read_report(run_dir: Path) -> dict | None:
    try:
        data = json.loads((Path(run_dir) / REPORT_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def merged_named(before: list[dict] | None, now: list[dict]) -> list[dict]:
    """The manifest's named nodes across starts: earlier starts' entries kept, this start's replaced."""
    starts = {e.get("start") for e in now}
    return [e for e in (before or []) if e.get("start") not in starts] + list(now)


def summary_line(health: dict | None) -> str | None:
    """``status`` and the report: checks, their cost, and each node named with its step and first reason."""
    if not isinstance(health, dict) or not health.get("checks"):
        return None
    share = health.get("share")
    cost = f"{health.get('seconds', 0):.3g} s" + (f" ({share * 100:.2f} % of the start)" if share is not None else "")
    line = f"{health['checks']} check(s) every {health.get('interval_min'):g} min, {cost}"
    named = health.get("named_all") or health.get("named") or []
    if not named:
        return line + "; no node named"
    parts = [f"{e['node']} at step {e['step']} (check {e['check']}"
             + (f", start {e['start']}" if e.get("start") else "") + f"): {(e.get('reasons') or ['slow'])[0]}"
             + (f"; {e['action']}" if e.get("action") else "") for e in named]
    return line + "; named " + " | ".join(parts)
