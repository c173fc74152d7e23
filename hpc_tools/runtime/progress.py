"""What rank 0 tells the user while a job runs: the start-up phases and one progress line per ``log_interval``.

The progress line (plain text, one line, in the rank's log and on the console of a foreground ``submit``)::

    step 20/30 loss 5.6544 val 5.7012 lr 3.00e-04 grad 1.25 tok/s 1.74k (436/gpu) TFLOP/s/gpu 0.000576 MFU n/a
    mem 0.40 GB elapsed 0:00:12 eta 0:00:03

(one line; wrapped here). It is the rank log's only line per interval with these figures; the collector adds a
``comm`` line of bus bandwidths on sampled steps only (``profiling.summary.format_comm_line``). ``lr`` and ``grad``
(the gradient norm before clipping) are the newest step's; rates (tok/s, TFLOP/s, MFU, and ``pp wait``, the share of
the step rank 0 waited on pipeline neighbours, on pipelined runs) are over the steps since the previous line: total
tokens (FLOPs, wait) over total step time, so a slow step weighs what it cost. ``mem`` is the peak allocated device
memory (GPU) or the resident set size (CPU). Units: ``profiling.units`` (GB = 1e9 bytes). The ETA is the mean step
time of this start's steps after its first (which pays the warm-up) times the steps left, plus the evaluations still
due at their mean cost. The newest line is also written to ``progress.json`` in the
run folder (``status`` reads it: ``read_progress``), atomically and only at log lines.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from profiling.units import gb, hms, pct, rate, sci

log = logging.getLogger("hpc_tools")

PROGRESS_FILE = "progress.json"
STARTUP_PHASES = ("imports", "process group", "model build", "checkpoint load", "first step")


__all__ = ["PROGRESS_FILE", "STARTUP_PHASES", "ProgressMeter", "StartupLog", "hms", "read_progress",
           "write_progress"]


class StartupLog:
    """The start-up phases of one start of the ranks, each logged once on rank 0 as it ends:
    ``start-up: model build 2.31 s``. ``info`` is ``RankContext.info`` (rank 0 only)."""

    def __init__(self, info: Callable[..., None]):
        self.info = info
        self.seconds: dict[str, float] = {}

    def done(self, phase: str, seconds: float, detail: str = "") -> None:
        """Phase ``phase`` (one of ``STARTUP_PHASES``) took ``seconds``; logged the first time only."""
        if phase in self.seconds:
            return
        self.seconds[phase] = seconds
        self.info("start-up: %s %.2f s%s", phase, seconds, f" ({detail})" if detail else "")


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), for the ``imports`` phase."""
    from profiling.collector import process_start_time

    start = process_start_time()
    return None if start is None else max(time.time() - start, 0.0)


@dataclass
class ProgressMeter:
    """Rank 0's view of the run for the progress line and the trackers, fed with each step's record."""

    first: int
    total: int
    started: float = field(default_factory=time.time)
    _window: list[dict[str, Any]] = field(default_factory=list)
    _step_s: list[float] = field(default_factory=list)
    _eval_s: list[float] = field(default_factory=list)
    val_loss: float | None = None
    val_step: int | None = None
    eval_interval: int | None = None

    def add(self, record: dict[str, Any] | None, step: int, loss: float | None) -> None:
        """One step's record (``StepCollector.end_step``'s; None without records: only the loss is known)."""
        record = dict(record or {})
        record.setdefault("step", step)
        if loss is not None:
            record["loss"] = loss
        self._window.append(record)
        if step > self.first and record.get("step_time_s"):
            self._step_s.append(float(record["step_time_s"]))

    def add_eval(self, step: int, val_loss: float, seconds: float) -> None:
        self.val_loss, self.val_step = val_loss, step
        self._eval_s.append(seconds)

    def eta_s(self, step: int) -> float | None:
        if not self._step_s:
            return None
        left = self.total - step
        mean = sum(self._step_s) / len(self._step_s)
        evals = 0.0
        if self.eval_interval and self._eval_s:
            k = self.eval_interval  # evaluations after steps step+1..total: the multiples of k, and the last
            due = self.total // k - step // k + (1 if self.total % k and step < self.total else 0)
            evals = due * sum(self._eval_s) / len(self._eval_s)
        return left * mean + evals

    def scalars(self) -> dict[str, float]:
        """The window's figures: loss (newest), rates over the window, peak memory; what the trackers log."""
        w = self._window
        if not w:
            return {}
        last = w[-1]
        out: dict[str, float] = {}
        for key in ("loss", "lr", "grad_norm"):
            if last.get(key) is not None:
                out[key] = float(last[key])
        dt = sum(float(r.get("step_time_s") or 0.0) for r in w)
        if dt > 0:
            out["step_time_s"] = dt / len(w)
            tokens = sum(float(r.get("tokens") or 0.0) for r in w)
            if tokens:
                out["tokens_per_s"] = tokens / dt
                world = _world(last)
                if world:
                    out["tokens_per_s_per_gpu"] = out["tokens_per_s"] / world
            waits = [(float(r["pp_wait_s"]), float(r.get("step_time_s") or 0.0)) for r in w
                     if r.get("pp_wait_s") is not None]
            if waits and sum(t for _, t in waits) > 0:
                out["pp_wait_share"] = sum(v for v, _ in waits) / sum(t for _, t in waits)
            for key in ("tflops_per_gpu", "mfu"):  # rates: weighted by step time = total work / total time
                vals = [(float(r[key]), float(r.get("step_time_s") or 0.0)) for r in w if r.get(key) is not None]
                if vals:
                    out[key] = sum(v * t for v, t in vals) / max(sum(t for _, t in vals), 1e-12)
        for key in ("mem_allocated_max_bytes", "rss_bytes"):  # GPU allocated peak; on CPU the host RSS
            mem = [r[key] for r in w if r.get(key)]
            if mem:
                out[key] = float(max(mem))
                break
        if self.val_step is not None and any(r.get("step") == self.val_step for r in w):
            out["val_loss"] = float(self.val_loss)
        return out

    def line(self, step: int) -> tuple[str, dict[str, float]]:
        """The progress line of ``step`` and its scalars; starts the next window."""
        s = self.scalars()
        parts = [f"step {step}/{self.total}", f"loss {s['loss']:.4f}" if "loss" in s else "loss -"]
        if "val_loss" in s:
            parts.append(f"val {s['val_loss']:.4f}")
        parts += [f"lr {sci(s.get('lr'))}", f"grad {sci(s.get('grad_norm'))}"]
        tps = f"tok/s {rate(s.get('tokens_per_s'))}"
        parts.append(tps + (f" ({rate(s['tokens_per_s_per_gpu'])}/gpu)" if "tokens_per_s_per_gpu" in s else ""))
        parts.append(f"TFLOP/s/gpu {s['tflops_per_gpu']:.3g}" if "tflops_per_gpu" in s else "TFLOP/s/gpu -")
        parts.append(f"MFU {pct(s['mfu'])}" if "mfu" in s else "MFU n/a")
        if "pp_wait_share" in s:
            parts.append(f"pp wait {pct(s['pp_wait_share'])}")
        parts.append(f"mem {gb(s.get('mem_allocated_max_bytes', s.get('rss_bytes')))}")
        age = process_age_s()
        elapsed = age if age is not None else time.time() - self.started
        parts.append(f"elapsed {hms(elapsed)} eta {hms(self.eta_s(step))}")
        self._window = []
        return " ".join(parts), s


def _world(record: dict[str, Any]) -> int | None:
    """The world size a step record implies (its tokens/s over its tokens/s per GPU), None when it does not say."""
    tps, per_gpu = record.get("tokens_per_s"), record.get("tokens_per_s_per_gpu")
    return round(tps / per_gpu) if tps and per_gpu else None


def write_progress(run_dir: Path, step: int, total: int, line: str, scalars: dict[str, float],
                   eta_s: float | None, val: tuple[int, float] | None) -> None:
    """Rank 0's newest progress line as ``run_dir/progress.json`` (atomic; a full disk only loses the file)."""
    payload = {"step": step, "total": total, "line": line, "time": time.time(), "eta_s": eta_s, **scalars}
    if val is not None:
        payload["val_step"], payload["latest_val_loss"] = val
    path = Path(run_dir) / PROGRESS_FILE
    tmp = path.with_name(f".{PROGRESS_FILE}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(payload))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def read_progress(run_dir: Path) -> dict[str, Any] | None:
    """The newest progress ``write_progress`` left in ``run_dir``, or None."""
    try:
        return json.loads((Path(run_dir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None
