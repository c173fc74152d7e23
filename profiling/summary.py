"""Run summaries: the line rank 0 prints every ``summary_interval`` steps, and the summary files written at close.

Each rank writes ``records/summary_rank<R>.json`` (no collective at close: a rank that fails or a trainer that closes
on some ranks only cannot hang the others). Rank 0 then merges the rank files present within a few seconds into
``<run>/summary.json``; ``merge(run_dir, world_size)`` rebuilds it later from whatever rank files exist.
Figures are medians over the steps after ``warmup_steps``.

Pipeline bubble: each stage's ``pp_wait_s / step_time_s`` is listed per stage; the job's ``bubble_measured`` is the
smallest of them. In 1F1B every stage ideally waits (p-1)(t_f+t_b) per step; a stage that waits more is waiting on
a slower stage (imbalance, a descheduled CPU rank), so the least-waiting stage shows the schedule's own bubble. It is
compared with the theory as a share of the step, b / (1 + b) for b = (p-1)/(v m) (``bubble_theory_of_step``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any


_MEDIAN_FIELDS = ("step_time_s", "data_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "hfu",
                  "pp_wait_s", "bubble_fraction")
_MAX_FIELDS = ("mem_allocated_max_bytes", "mem_reserved_max_bytes", "rss_bytes")


def summary_rank_path(records_dir: Path, rank: int) -> Path:
    return Path(records_dir) / f"summary_rank{rank:05d}.json"


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


class RankSummary:
    """Accumulates this rank's step records (after warm-up) and sampled communication rows."""

    def __init__(self, warmup_steps: int, header: dict[str, Any]):
        self.warmup_steps = warmup_steps
        self.header = header
        self.rows: list[dict[str, Any]] = []
        self.comm: dict[tuple[str, int], dict[str, Any]] = {}
        self.first_step: int | None = None

    def add(self, record: dict[str, Any], comm_rows: list[dict[str, Any]] | None = None) -> None:
        if self.first_step is None:
            self.first_step = record["step"]
        if record["step"] - self.first_step < self.warmup_steps:
            return
        self.rows.append({k: record.get(k) for k in ("step", "loss", *_MEDIAN_FIELDS, *_MAX_FIELDS)})
        for row in comm_rows or ():
            acc = self.comm.setdefault((row["kind"], row["group_size"]), {
                "kind": row["kind"], "group_size": row["group_size"], "calls": 0, "bytes": 0, "time_s": 0.0,
                "span_s": 0.0, "sampled_steps": 0})
            for key in ("calls", "bytes", "time_s", "span_s"):
                acc[key] += row[key]
            acc["sampled_steps"] += 1

    def window(self, n: int) -> dict[str, Any]:
        """Medians over the last ``n`` steps (for the periodic summary line)."""
        rows = self.rows[-n:]
        return {k: _median([r[k] for r in rows]) for k in _MEDIAN_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        from profiling.comm import busbw_factor

        comm = []
        for acc in self.comm.values():
            algbw = acc["bytes"] / acc["span_s"] / 1e9 if acc["span_s"] > 0 else None
            comm.append({**acc, "algbw_gbps": algbw,
                         "busbw_gbps": None if algbw is None else algbw * busbw_factor(acc["kind"], acc["group_size"])})
        out = {**self.header, "steps_summarised": len(self.rows),
               "steps": [self.rows[0]["step"], self.rows[-1]["step"]] if self.rows else None,
               **{f"median_{k}": _median([r[k] for r in self.rows]) for k in _MEDIAN_FIELDS},
               **{f"max_{k}": max((r[k] for r in self.rows if r[k] is not None), default=None) for k in _MAX_FIELDS},
               "last_loss": next((r["loss"] for r in reversed(self.rows) if r["loss"] is not None), None),
               "comm": comm}
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
        theory = f" (theory {100 * _of_step(theory_bubble):.0f}%)" if theory_bubble is not None else ""
        parts.append(f"pp wait {100 * w['bubble_fraction']:.0f}%{theory}")
    for row in comm_rows or ():
        if row["kind"] != "p2p" and row.get("busbw_gbps") is not None:
            parts.append(f"{row['kind']}x{row['group_size']} {row['busbw_gbps']:.2f} GB/s busbw")
    return " | ".join(parts)


def _of_step(bubble: float | None) -> float | None:
    """(p-1)/(v m) is relative to the ideal compute time; as a share of the whole step it is b / (1 + b)."""
    return None if bubble is None else bubble / (1 + bubble)


def _k(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def write_rank(records_dir: Path, rank: int, summary: dict[str, Any]) -> Path:
    from hpc_tools.registry import atomic_write

    path = summary_rank_path(records_dir, rank)
    atomic_write(path, json.dumps(summary, indent=2, sort_keys=True))
    return path


def merge(run_dir: Path, world_size: int, wait_s: float = 0.0, restart: int | None = None) -> dict[str, Any]:
    """Job summary from the per-rank files (waiting up to ``wait_s`` for all of them), written to <run>/summary.json.

    With ``restart``, only rank files of that start count (a requeued job does not mix in the previous start's).

    Job-level figures: step time = the slowest rank's median (the step ends when the last rank does); tokens/s,
    TFLOP/s and MFU from that step time; the measured bubble per pipeline stage (mean over its ranks); collectives
    summed over ranks per (kind, group size).
    """
    from hpc_tools.registry import atomic_write
    from profiling.comm import busbw_factor

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
    step_times = [r["median_step_time_s"] for r in ranks if r.get("median_step_time_s")]
    step_s = max(step_times) if step_times else None
    flops, peak = head.get("model_flops_per_step"), head.get("peak_tflops_per_gpu")
    hw = head.get("hardware_flops_per_step")
    n = head.get("world_size", world_size)
    stages: dict[int, list[float]] = {}
    for r in ranks:
        if r.get("median_bubble_fraction") is not None:
            stages.setdefault(r["pp_rank"], []).append(r["median_bubble_fraction"])
    comm: dict[tuple[str, int], dict[str, Any]] = {}
    for r in ranks:
        for row in r.get("comm", ()):
            acc = comm.setdefault((row["kind"], row["group_size"]), {"kind": row["kind"], "group_size": row["group_size"],
                                                                     "calls": 0, "bytes": 0, "time_s": 0.0, "span_s": 0.0})
            for key in ("calls", "bytes", "time_s", "span_s"):
                acc[key] += row[key]
    for acc in comm.values():
        acc["busbw_gbps"] = (acc["bytes"] / acc["span_s"] / 1e9 * busbw_factor(acc["kind"], acc["group_size"])
                             if acc["span_s"] > 0 else None)
    job = {
        "run_id": head.get("run_id"), "world_size": n, "ranks_reporting": [r["rank"] for r in ranks],
        "layout": head.get("layout"), "flops_convention": head.get("flops_convention"), "gpu": head.get("gpu"),
        "peak_tflops_per_gpu": peak, "tokens_per_step": head.get("tokens_per_step"),
        "model_flops_per_step": flops, "hardware_flops_per_step": hw, "step_time_s": step_s,
        "tokens_per_s": head["tokens_per_step"] / step_s if step_s else None,
        "tokens_per_s_per_gpu": head["tokens_per_step"] / step_s / n if step_s else None,
        "tflops_per_gpu": flops / step_s / n / 1e12 if step_s and flops else None,
        "mfu": flops / step_s / n / (peak * 1e12) if step_s and flops and peak else None,
        "hfu": hw / step_s / n / (peak * 1e12) if step_s and hw and peak else None,
        "bubble_theory": head.get("bubble_theory"),
        "bubble_theory_of_step": _of_step(head.get("bubble_theory")),
        "bubble_measured_per_stage": {str(k): statistics.mean(v) for k, v in sorted(stages.items())} or None,
        "bubble_measured": min(statistics.mean(v) for v in stages.values()) if stages else None,
        "comm": sorted(comm.values(), key=lambda a: (a["kind"], a["group_size"])),
        "last_loss": next((r["last_loss"] for r in reversed(ranks) if r.get("last_loss") is not None), None),
        "ranks": ranks,
    }
    atomic_write(Path(run_dir) / "summary.json", json.dumps(job, indent=2, sort_keys=True))
    return job
