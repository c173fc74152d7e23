"""The report's opening summary, before any table: what ran, its figures and the verdict, in words, each quantity
once and in ``profiling.units``' unit (the tables and the method section follow it)."""

from __future__ import annotations

import math

import pandas as pd

from hpc_tools.analysis.analyze import Analysis
from profiling.units import GB, gb, pct, rate, sci, seconds_per_step

MAX_NAMED = 3  # runs named one by one; more are counted


def _num(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def _last(steps: pd.DataFrame, run_id: str, col: str) -> float | None:
    """The newest value of a per-step column of one run (lr, gradient norm)."""
    if steps.empty or col not in steps:
        return None
    values = steps.loc[steps["run_id"] == run_id, ["step", col]].dropna()
    return None if values.empty else float(values.sort_values("step")[col].iloc[-1])


def what_ran(a: Analysis) -> str:
    runs = a.runs
    where = f" in sweep {', '.join(a.sweeps)}" if a.sweeps else ""
    if len(runs) > MAX_NAMED:
        states = runs["status"].value_counts().to_dict() if "status" in runs else {}
        return (f"What ran: {len(runs)} runs{where} ({', '.join(f'{n} {s}' for s, n in states.items())}), "
                f"{runs['world_size'].min()}-{runs['world_size'].max()} ranks.")
    parts = [f"{r['run_id']} ({r.get('backend') or '?'}, {r.get('layout') or '?'}, {r.get('status') or '?'}, "
             f"{int(r.get('steps_measured') or 0)} measured steps)" for r in runs.to_dict("records")]
    return f"What ran{where}: " + "; ".join(parts) + "."


def figures_line(r: dict, steps: pd.DataFrame) -> str:
    """One run's figures: median step time, throughput, TFLOP/s, MFU, peak memory, goodput, loss, lr, grad norm."""
    st = _num(r.get("step_time_median_s"))
    if st is None:
        return f"{r['run_id']}: no measured steps."
    parts = [f"{seconds_per_step(st)} (median)", f"{rate(_num(r.get('tokens_per_s')))} tok/s "
             f"({rate(_num(r.get('tokens_per_s_per_gpu')))}/GPU)"]
    if _num(r.get("tflops_per_gpu")) is not None:
        mfu = _num(r.get("mfu"))
        parts.append(f"{r['tflops_per_gpu']:.3g} TFLOP/s/GPU, MFU {pct(mfu) if mfu is not None else 'n/a (no peak)'}")
    mem = _num(r.get("peak_mem_gb"))
    if mem is not None:
        parts.append(f"peak memory {gb(mem * GB)} ({r.get('peak_mem_kind')})")
    if _num(r.get("goodput")) is not None:
        parts.append(f"goodput {pct(r['goodput'])}")
    for col, name in (("last_loss", "last loss"), ("last_val_loss", "validation loss")):
        if _num(r.get(col)) is not None:
            parts.append(f"{name} {r[col]:.4f}")
    lr, norm = _last(steps, r["run_id"], "lr"), _last(steps, r["run_id"], "grad_norm")
    if lr is not None or norm is not None:
        parts.append(f"last lr {sci(lr)}, grad norm {sci(norm)}")
    return f"{r['run_id']}: " + ", ".join(parts) + "."


def verdicts(a: Analysis) -> list[str]:
    """The straggler verdicts, the fastest configuration of several, the scaling fits, predicted vs measured."""
    runs = a.runs
    lines = []
    for r in runs.head(MAX_NAMED).to_dict("records"):
        lines.append(f"Stragglers of {r['run_id']}: {r.get('straggler_verdict') or 'not measured'}.")
    if len(runs) > 1 and "tokens_per_s_per_gpu" in runs and runs["tokens_per_s_per_gpu"].notna().any():
        best = runs.loc[runs["tokens_per_s_per_gpu"].idxmax()]
        lines.append(f"Fastest per GPU: {best.get('short_label') or best['run_id']} "
                     f"({rate(best['tokens_per_s_per_gpu'])} tok/s/GPU, {best['run_id']}).")
    for s in a.scaling:
        if s.fit is not None:
            lines.append(f"{s.kind.capitalize()} scaling: {s.fit.verdict()}")
    ratio = runs["predicted_vs_measured"].dropna() if "predicted_vs_measured" in runs else pd.Series(dtype=float)
    if len(ratio):
        lines.append(f"Planner: predicted / measured step time {ratio.min():.2f}-{ratio.max():.2f}x.")
    return lines


def summary_lines(a: Analysis) -> list[str]:
    """The report's summary: what ran, each named run's figures, the verdicts."""
    if a.runs.empty:
        return ["No runs with step records."]
    lines = [what_ran(a)]
    lines += [figures_line(r, a.steps) for r in a.runs.head(MAX_NAMED).to_dict("records")]
    return lines + verdicts(a)
