"""Calibrated hang timeouts: one bound per phase of a rank's life, learned from the run's own observed maxima.

The hang watchdog (``hpc_tools.runtime.watchdog``) asks ``Bounds.bound(phase)`` how long the phase it watches may
go without progress. The phases (``PHASES``):

- ``first step``: from the rank's start to its first completed step (imports, rendezvous, preflight, model build,
  checkpoint load and the step itself);
- ``step``: one training step (heartbeat to heartbeat, the sections below taken out);
- ``checkpoint save``: the saver's call after a step, bounded by its progress (each phase, each chunk copied): the
  longest stretch without progress is what is observed and bounded;
- ``evaluation``: the validation loss after a step.

With ``cluster.hang_timeout_min`` unset (null, the default) each bound is ``min(cap, max(floor, FACTOR x the
slowest observed))``: the cap is ``DEFAULT_CAP_MIN`` (30 minutes; ``STARTUP_S`` more for the first step), the floors
are ``FLOORS`` (60 s for a step: a rank stopped after the warm-up is named within max(60 s, 5 x the slowest step)).
A phase not yet observed (and the step before ``WARMUP_STEPS`` steps were) gets the cap: nothing is known about it
yet. With ``cluster.hang_timeout_min`` set, that value is every phase's fixed timeout (an explicit override, the
old behaviour; 0 turns the watchdog off).

The maxima are kept in the run folder (``FILE``, written by rank 0's watchdog thread when they grow), so a restart
inside the allocation, a requeue or a ``resume`` starts calibrated: its first step is bounded by the slowest first
step seen before, its steps at once by the slowest step. Maxima observed at another world size (an elastic run on
fewer nodes) are not used.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

FILE = "hang_bounds.json"
FIRST, STEP, SAVE, EVAL = "first step", "step", "checkpoint save", "evaluation"
PHASES = (FIRST, STEP, SAVE, EVAL)
DEFAULT_CAP_MIN = 30.0  # the cap of every calibrated bound (cluster.hang_timeout_min's old default)
FACTOR = 5.0  # NVRx's safety factor: a phase may take 5 x its slowest observed before it is a hang
# Before the first step of a start: imports, rendezvous, model build and checkpoint load come on top of the bound.
STARTUP_S = 600.0
FLOORS = {FIRST: STARTUP_S, STEP: 60.0, SAVE: 300.0, EVAL: 120.0}  # a save's stalls vary most (shared file systems)
WARMUP_STEPS = 5  # steps observed before the step bound is calibrated (the first steps build caches, warm kernels)
VERSION = 1


@dataclass
class Observed:
    """The slowest time seen per phase, and how many steps were seen (this run, every start at ``world_size``)."""

    max_s: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    world_size: int = 0

    def add(self, phase: str, seconds: float) -> bool:
        """One observation of ``phase``; True when a maximum grew (worth keeping in the run folder)."""
        if phase == STEP:
            self.steps += 1
        if seconds > self.max_s.get(phase, -1.0):
            self.max_s[phase] = float(seconds)
            return True
        return phase == STEP and self.steps <= WARMUP_STEPS  # the warm-up's count matters until it is done

    def as_dict(self) -> dict:
        return {"version": VERSION, "world_size": self.world_size, "steps": self.steps,
                "max_s": {k: round(v, 3) for k, v in self.max_s.items()}}

    @classmethod
    def load(cls, run_dir: Path, world_size: int) -> "Observed":
        """The maxima the run folder keeps, or none (no file, an unreadable one, or one of another world size)."""
        try:
            data = json.loads((Path(run_dir) / FILE).read_text())
            if data.get("version") != VERSION or int(data.get("world_size", -1)) != world_size:
                return cls(world_size=world_size)
            max_s = {str(k): float(v) for k, v in data["max_s"].items() if k in PHASES and float(v) >= 0}
            return cls(max_s=max_s, steps=max(int(data.get("steps", 0)), 0), world_size=world_size)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return cls(world_size=world_size)



@dataclass
class Bounds:
    """Each phase's timeout: calibrated (``fixed_s`` None) under ``cap_s``, or ``fixed_s`` for every phase."""

    cap_s: float = DEFAULT_CAP_MIN * 60
    fixed_s: float | None = None
    factor: float = FACTOR
    floors: dict[str, float] = field(default_factory=lambda: dict(FLOORS))
    warmup: int = WARMUP_STEPS
    observed: Observed = field(default_factory=Observed)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def fixed(cls, timeout_s: float) -> "Bounds":
        """Every phase ``timeout_s`` (``STARTUP_S`` more before the first step); <= 0: off."""
        return cls(cap_s=timeout_s, fixed_s=timeout_s)

    @classmethod
    def of_cluster(cls, hang_timeout_min: float | None, run_dir: Path | None = None, world_size: int = 1) -> "Bounds":
        """The recipe's ``cluster.hang_timeout_min``: null = calibrated (with the run folder's maxima), a number =
        that fixed timeout."""
        observed = Observed.load(run_dir, world_size) if run_dir is not None else Observed(world_size=world_size)
        if hang_timeout_min is None:
            return cls(observed=observed)
        out = cls.fixed(hang_timeout_min * 60)
        out.observed = observed
        return out

    @property
    def off(self) -> bool:
        return self.cap_s <= 0

    @property
    def calibrated(self) -> bool:
        return self.fixed_s is None

    def add(self, phase: str, seconds: float) -> bool:
        with self._lock:
            return self.observed.add(phase, seconds)

    def bound(self, phase: str) -> float:
        """Seconds ``phase`` may go without progress before it is a hang (see the module docstring)."""
        extra = STARTUP_S if phase == FIRST else 0.0
        if self.fixed_s is not None:
            return self.fixed_s + extra
        cap = self.cap_s + extra
        seen = self.observed.max_s.get(phase)
        if seen is None or (phase == STEP and self.observed.steps < self.warmup):
            return cap
        return min(cap, max(self.floors.get(phase, self.floors[SAVE]), self.factor * seen))

    def why(self, phase: str) -> str:
        """How ``bound(phase)`` was chosen, in words (for HANG.txt and the manifest)."""
        limit = self.bound(phase)
        if self.fixed_s is not None:
            return f"{limit:.0f} s (cluster.hang_timeout_min{' + the start-up allowance' if phase == FIRST else ''})"
        seen = self.observed.max_s.get(phase)
        if seen is None or (phase == STEP and self.observed.steps < self.warmup):
            return f"{limit:.0f} s (the cap: no {phase} calibrated yet)"
        floor = self.floors.get(phase, self.floors[SAVE])
        return (f"{limit:.0f} s (calibrated: max(floor {floor:.0f} s, {self.factor:g} x the slowest {phase} "
                f"{seen:.2f} s), cap {self.cap_s + (STARTUP_S if phase == FIRST else 0):.0f} s)")

    def save(self, run_dir: Path) -> None:
        """Keep the maxima in the run folder; a full or read-only disk loses them, never the rank."""
        from profiling.files import atomic_write

        with self._lock:
            text = json.dumps(self.observed.as_dict(), sort_keys=True)
        with contextlib.suppress(OSError):
            atomic_write(Path(run_dir) / FILE, text)
