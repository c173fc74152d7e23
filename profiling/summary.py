"""Run summaries: the line rank 0 prints every ``summary_interval`` steps, and the summary files written at close.

Each rank writes ``records/summary_rank<R>.json``: this start's header (layout, FLOPs convention, peak, ...) and the
rank's own figures over this start's records (no collective at close: a rank that fails or a trainer that closes on
some ranks only cannot hang the others). Rank 0 then waits a few seconds for the rank files of this start and writes
``<run>/summary.json``: the job's figures over every step record of the run (all starts), reduced by
``profiling.figures`` exactly as ``analyze`` and the calibration reduce them (the definitions are stated there, once).
``merge(run_dir, world_size)`` rebuilds it later from whatever files exist.
"""

from __future__ import annotations

import json
import statistics
import time
from array import array
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from profiling import figures

# Fields of the periodic line: medians over the last ``summary_interval`` measured steps of this rank.
WINDOW_MAX = 10_000  # the longest window kept (the line's window is summary_interval steps)
_WINDOW_FIELDS = ("step_time_s", "data_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "hfu",
                  "pp_wait_s", "bubble_fraction")


def summary_rank_path(records_dir: Path, rank: int) -> Path:
    return Path(records_dir) / f"summary_rank{rank:05d}.json"


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class RankSummary:
    """This rank's records of this start, reduced at the end by ``profiling.figures``; the window of the periodic line
    skips the warm-up steps by the same rule (``figures.is_warmup``)."""

    def __init__(self, warmup_steps: int, header: dict[str, Any]):
        self.warmup_steps = warmup_steps
        self.header = {**header, "warmup_steps": warmup_steps}
        self.rows: deque[dict[str, Any]] = deque(maxlen=WINDOW_MAX)  # the last measured steps, for the line
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
        self.rows.append({k: record.get(k) for k in _WINDOW_FIELDS})
        self._comm += [{**row, "step": record["step"], "restart": record.get("restart", 0)} for row in comm_rows or ()]

    def window(self, n: int) -> dict[str, Any]:
        """Medians over the last ``n`` measured steps (for the periodic summary line)."""
        rows = list(self.rows)[-n:]
        return {k: _median([r[k] for r in rows]) for k in _WINDOW_FIELDS}

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


def format_line(step: int, loss: float | None, w: dict[str, Any], convention: str, theory_bubble: float | None,
                comm_rows: list[dict[str, Any]] | None = None, mem_bytes: int | None = None) -> str:
    """``step 20 | loss 4.1 | 0.120 s/step (data 1%) | 8.5k tok/s, 2.1k/gpu | 0.3 TFLOP/s/gpu | MFU - ...``."""
    parts = [f"step {step}"]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    st = w.get("step_time_s")
    if st:
        data = w.get("data_time_s")
        parts.append(f"{st:.3f} s/step" + (f" (data {100 * data / st:.0f}%)" if data else ""))
        parts.append(f"{_k(w['tokens_per_s'])} tok/s, {_k(w['tokens_per_s_per_gpu'])}/gpu")
    if w.get("tflops_per_gpu") is not None:
        mfu, hfu = w.get("mfu"), w.get("hfu")
        pct = (f"MFU {100 * mfu:.1f}% HFU {100 * hfu:.1f}%" if mfu is not None else "MFU n/a (unknown peak)")
        parts.append(f"{w['tflops_per_gpu']:.3g} TFLOP/s/gpu, {pct} [{convention}]")
    if mem_bytes:
        parts.append(f"mem {mem_bytes / 2**30:.2f} GiB")
    if w.get("bubble_fraction") is not None:
        theory = figures.bubble_share_theory(theory_bubble)
        parts.append(f"pp wait {100 * w['bubble_fraction']:.0f}%"
                     + (f" (theory {100 * theory:.0f}%)" if theory is not None else ""))
    for row in comm_rows or ():
        if row["kind"] != "p2p" and row.get("busbw_gbps") is not None:
            parts.append(f"{row['kind']}x{row['group_size']} {row['busbw_gbps']:.2f} GB/s busbw")
    return " | ".join(parts)


def format_job_line(job: dict[str, Any]) -> str:
    """The one line rank 0 logs at the end: ``2 ranks | 0.1234 s/step | ... | MFU 41.0% | pp wait per stage ...``."""
    st, mfu = job.get("step_time_median_s"), job.get("mfu")
    parts = [f"{job['world_size']} ranks", f"{st:.4f} s/step" if st else "no steps after warm-up"]
    if job.get("tokens_per_s"):
        parts.append(f"{job['tokens_per_s']:.0f} tok/s ({job['tokens_per_s_per_gpu']:.0f}/gpu)")
    if job.get("tflops_per_gpu") is not None:
        parts.append(f"{job['tflops_per_gpu']:.3g} TFLOP/s/gpu [{job.get('flops_convention')}]")
        parts.append(f"MFU {100 * mfu:.1f}%" if mfu is not None else "MFU n/a (unknown peak)")
    if job.get("bubble_share_per_stage"):
        stages = ", ".join(f"{k}: {100 * v:.0f}%" for k, v in job["bubble_share_per_stage"].items())
        theory = job.get("bubble_share_theory")
        parts.append(f"pp wait per stage {stages}, bubble {100 * job['bubble_share']:.0f}% of the step"
                     + (f" (theory {100 * theory:.0f}%)" if theory is not None else ""))
    return " | ".join(parts)


def _k(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


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
