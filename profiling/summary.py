"""Run summaries: the ``comm`` line rank 0 prints every ``summary_interval`` steps (when that step timed collectives),
the job's summary line and the summary files written at close.

Each rank writes ``records/summary_rank<R>.json``: this start's header (layout, FLOPs convention, peak, ...) and the
rank's own figures over this start's records (no collective at close: a rank that fails or a trainer that closes on
some ranks only cannot hang the others). Rank 0 then waits a few seconds for the rank files of this start and writes
``<run>/summary.json``: the job's figures over every step record of the run (all starts), reduced by
``profiling.figures`` exactly as ``analyze`` and the calibration reduce them (the definitions are stated there, once).
``merge(run_dir, world_size)`` rebuilds it later from whatever files exist.
"""

from __future__ import annotations

import json
import time
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from profiling import figures, units
from profiling.units import gb, pct, rate, seconds_per_step


def summary_rank_path(records_dir: Path, rank: int) -> Path:
    return Path(records_dir) / f"summary_rank{rank:05d}.json"


class RankSummary:
    """This rank's records of this start, reduced at the end by ``profiling.figures``; the sampled collectives of
    its warm-up steps (``figures.is_warmup``) are left out."""

    def __init__(self, warmup_steps: int, header: dict[str, Any]):
        self.warmup_steps = warmup_steps
        self.header = {**header, "warmup_steps": warmup_steps}
        self._columns = {c: array("d") for c in figures.COLUMNS}  # 8 bytes a value: a long run stays small
        self._comm: list[dict[str, Any]] = []
        self.first_step: int | None = None

    def add(self, record: dict[str, Any], comm_rows: list[dict[str, Any]] | None = None) -> None:
        if self.first_step is None:
            self.first_step = record["step"]
        for c, values in self._columns.items():
            value = record.get(c)
            values.append(np.nan if value is None else value)
        if figures.is_warmup(record["step"], self.first_step, self.warmup_steps):
            return
        self._comm += [{**row, "step": record["step"], "restart": record.get("restart", 0)} for row in comm_rows or ()]

    def to_dict(self) -> dict[str, Any]:
        """Header, this rank's figures over this start (``figures.RankFigures``) and its sampled collectives."""
        cols = {c: np.frombuffer(v, dtype=np.float64).copy() for c, v in self._columns.items()}
        out = {**self.header, "steps": None, "comm": figures.sum_comm(self._comm)}
        out.update(dict.fromkeys(f for f in figures.RankFigures.__dataclass_fields__ if f != "rank"))
        if cols["step"].size:
            cols, measured = figures.prepare_rank(cols, self.warmup_steps)
            found = figures.rank_figures(self.header.get("rank", 0), cols, measured)
            if found is not None:
                out.update({k: v for k, v in found.as_dict().items() if k != "rank"})
                steps = cols["step"][measured]
                out["steps"] = [int(steps[0]), int(steps[-1])]
        return out


def format_comm_line(step: int, comm_rows: list[dict[str, Any]] | None) -> str | None:
    """``comm at step 20: all_reduce x4 1.23 GB/s busbw, all_gather x2 0.80 GB/s busbw``: the bus bandwidth of the
    collectives timed on a sampled step, the one thing the progress line (``hpc_tools.runtime.progress``) does not
    carry; None when none was timed."""
    rows = [r for r in comm_rows or () if r["kind"] != "p2p" and r.get("busbw_gbps") is not None]
    if not rows:
        return None
    return f"comm at step {step}: " + ", ".join(f"{r['kind']} x{r['group_size']} {r['busbw_gbps']:.2f} GB/s busbw"
                                                for r in rows)


def format_job_line(job: dict[str, Any]) -> str:
    """The one line rank 0 logs at the end, the run's figures as ``summary.json`` holds them:
    ``2 ranks | 0.123 s/step | 1.74k tok/s (870/gpu) | 0.3 TFLOP/s/gpu [megatron] | MFU 41.0 % | peak 0.39 GB``."""
    st, mfu = job.get("step_time_median_s"), job.get("mfu")
    parts = [f"{job['world_size']} ranks", seconds_per_step(st) + " (median)" if st else "no steps after warm-up"]
    if job.get("tokens_per_s"):
        parts.append(f"{rate(job['tokens_per_s'])} tok/s ({rate(job['tokens_per_s_per_gpu'])}/gpu)")
    if job.get("tflops_per_gpu") is not None:
        parts.append(f"{job['tflops_per_gpu']:.3g} TFLOP/s/gpu [{job.get('flops_convention')}]")
        parts.append(f"MFU {pct(mfu)}" if mfu is not None else "MFU n/a (unknown peak)")
    peak = job.get("peak_mem_gb")
    if peak is not None:
        parts.append(f"peak {gb(peak * units.GB)} ({job.get('peak_mem_kind')})")
    if job.get("bubble_share_per_stage"):
        stages = ", ".join(f"{k}: {pct(v, 0)}" for k, v in job["bubble_share_per_stage"].items())
        theory = job.get("bubble_share_theory")
        parts.append(f"pp wait per stage {stages}, bubble {pct(job['bubble_share'], 0)} of the step"
                     + (f" (theory {pct(theory, 0)})" if theory is not None else ""))
    return " | ".join(parts)


def write_rank(records_dir: Path, rank: int, summary: dict[str, Any]) -> Path:
    from profiling.files import atomic_write

    path = summary_rank_path(records_dir, rank)
    atomic_write(path, json.dumps(summary, indent=2, sort_keys=True))
    return path


# Header fields the job summary takes from the rank files (what the job was, not what it measured).
_HEADER = ("run_id", "layout", "flops_convention", "gpu", "timing", "backend", "recompute")


def merge(run_dir: Path, world_size: int, wait_s: float = 0.0, restart: int | None = None) -> dict[str, Any]:
    """Job summary written to <run>/summary.json, once the rank summary files of this start are there (waiting up to
    ``wait_s`` for all of them; with ``restart``, only files of that start count).

    The figures (``profiling.figures.JOB_FIGURES``) come from the step records of every start, reduced by
    ``profiling.figures``: the same numbers ``analyze`` gives for this run folder. ``ranks`` holds the per-rank
    figures, ``comm`` the sampled collectives per (kind, group size).
    """
    from profiling.files import atomic_write

    records = Path(run_dir) / "records"
    deadline = time.monotonic() + wait_s
    while True:
        ranks = [json.loads(p.read_text()) for p in sorted(records.glob("summary_rank*.json"))]
        ranks = [r for r in ranks if restart is None or r.get("restart") == restart]
        if len(ranks) >= world_size or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if not ranks:
        return {}
    head = ranks[0]
    warmup = int(head.get("warmup_steps") or 0)
    n = head.get("world_size", world_size)
    reducer = figures.reduce_records(records, warmup)
    job = {k: head.get(k) for k in _HEADER}
    job.update(world_size=n, restart=head.get("restart"), ranks_reporting=[r["rank"] for r in ranks],
               **reducer.figures(n, head.get("bubble_theory")), comm=figures.comm_table(records, warmup),
               ranks=[r.as_dict() for r in reducer.ranks])
    atomic_write(Path(run_dir) / "summary.json", json.dumps(job, indent=2, sort_keys=True))
    return job
