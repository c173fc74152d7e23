"""analyze: per-run, per-rank and scaling metrics of runs and sweeps."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import add_json, add_runs_dir, emit_json, whole_number

NAME = "analyze"
ORDER = 60
HELP = ("metrics of runs and sweeps: step time, tokens/s, MFU, memory, shares, stragglers by cause, goodput, "
        "scaling fits (each with its 95-percent interval and R^2, or 'no fit' and why)")
# short_label: only what varies across the runs (analysis.labels), e.g. "tp=2 pp=4".
COLUMNS = ("world_size", "short_label", "repeat", "status", "step_time_median_s", "tokens_per_s_per_gpu",
           "tflops_per_gpu", "mfu", "peak_mem_gb", "comm_share", "stragglers", "goodput", "last_val_loss")


def add_analysis_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments `analyze` and `report` share."""
    p.add_argument("refs", nargs="+", metavar="RUN_OR_SWEEP",
                   help="run folders, sweep folders, folders of runs, run ids or Slurm job ids")
    p.add_argument("--warmup", type=whole_number(0, what="warm-up steps"), default=None, metavar="N",
                   help="warm-up steps of every start excluded from the figures (default: profiling.warmup_steps)")
    p.add_argument("--scaling", choices=["auto", "strong", "weak", "none"], default=None,
                   help="how to read the runs as a scaling series (default: the sweep's setting, else auto)")
    add_runs_dir(p)
    add_json(p)


def analysed(args: argparse.Namespace):
    """The analysis of the runs the arguments name."""
    from hpc_tools.analysis import breakdown_report
    from hpc_tools.analysis.analyze import analyse
    from hpc_tools.errors import UserError

    if args.warmup is not None and args.warmup < 0:
        raise UserError(f"--warmup {args.warmup} must be >= 0 (steps excluded from the statistics)")
    result = analyse(args.refs, args.warmup, args.runs_dir, args.scaling)
    breakdown_report.remember(result, args.refs, args.runs_dir)  # the report's breakdown section finds the traces
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_analysis_arguments(p)
    p.add_argument("--breakdown", action="store_true",
                   help="where each traced step went, per rank: compute, exposed communication per parallel group, "
                        "bubble, data, host, checkpoint, other; against the planner's terms (docs/breakdown.md)")


def run_breakdown(args: argparse.Namespace) -> int:
    """`analyze RUN --breakdown`: one breakdown per run named (a sweep: each of its runs)."""
    from hpc_tools.analysis.breakdown import breakdown, format_text
    from hpc_tools.analysis.inputs import discover
    from hpc_tools.errors import UserError

    if args.warmup is not None and args.warmup < 0:
        raise UserError(f"--warmup {args.warmup} must be >= 0 (steps excluded from the statistics)")
    inputs, _ = discover(args.refs, args.runs_dir)
    results = [breakdown(i, args.warmup) for i in inputs]
    missing = [b.run_id for b in results if not b.ranks]
    if missing:
        raise UserError(f"--breakdown: run(s) {', '.join(missing)} hold no trace with step marks under profiler/ "
                        "(profiling.trace_sample_interval or profiling.torch_profiler.enabled turns tracing on; "
                        "runs traced before it carry no marks)")
    if args.json:
        emit_json({"ok": True, "runs": [b.to_json() for b in results]} if len(results) > 1 else
                  {"ok": True, **results[0].to_json()})
        return 0
    print("\n\n".join(format_text(b) for b in results))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.breakdown:
        return run_breakdown(args)
    result = analysed(args)
    if args.json:
        emit_json({"ok": True, **result.to_json()})
        return 0
    print_analysis(result)
    return 0


# Short headers for the terminal (the --json and the report keep the field names); units: profiling.units.
HEADERS = {"world_size": "GPUs", "short_label": "config", "repeat": "rep", "status": "status",
           "step_time_median_s": "s/step", "tokens_per_s_per_gpu": "tok/s/gpu", "tflops_per_gpu": "TFLOP/s/gpu",
           "mfu": "MFU", "peak_mem_gb": "peak GB", "comm_share": "comm", "stragglers": "stragglers",
           "goodput": "goodput", "last_val_loss": "val loss", "run_id": "run", "unit": "unit", "lives": "lives",
           "allocation_hours": "alloc h", "productive_hours": "productive h", "lost_work_hours": "lost h",
           "recomputed_steps": "recomputed", "requeue_wait_s": "requeue s", "startup_hours": "start-up h",
           "checkpoint_blocked_hours": "ckpt blocked h", "evaluation_hours": "eval h", "other_hours": "other h"}
# What a narrow terminal keeps first (the rest of COLUMNS after these, in their order).
PRIORITY = ("step_time_median_s", "tokens_per_s_per_gpu", "mfu", "peak_mem_gb", "status", "goodput",
            "tflops_per_gpu", "comm_share", "last_val_loss", "stragglers", "world_size", "repeat")
GOODPUT_SHOWN = ("run_id", "allocation_hours", "goodput", "productive_hours", "lost_work_hours", "startup_hours",
                 "checkpoint_blocked_hours", "evaluation_hours", "other_hours", "requeue_wait_s", "recomputed_steps",
                 "lives", "unit")


def print_analysis(result) -> None:
    """The per-run table, the straggler verdicts, goodput and scaling, fitted to the terminal (``cli._screen``)."""
    from hpc_tools.cli._screen import echo, table
    from profiling.units import cell, pct

    def rows(df) -> list[dict]:
        return df.to_dict("records") if df is not None and not df.empty else []

    echo("\n".join(table(rows(result.runs), COLUMNS, keep=1, fmt=cell, headers=HEADERS, priority=PRIORITY))
         if not result.runs.empty else "no runs")
    for _, row in result.runs.iterrows():
        echo(f"stragglers of {row['run_id']}: {row.get('straggler_verdict') or 'not measured'}")
    if not result.goodput.empty:
        echo("\ngoodput (hours = wall time x ranks; requeue wait is outside the allocation):")
        echo("\n".join(table(rows(result.goodput), GOODPUT_SHOWN, keep=1, fmt=cell, headers=HEADERS)))
        total = result.goodput_total
        if total.get("runs", 0) > 1:
            echo(f"all {total['runs']} runs: {total['allocation_hours']:.4g} {total['unit']}-hours, goodput "
                 f"{pct(total['goodput'] or 0)}, lost work {total['lost_work_hours']:.4g} h, "
                 f"{total['recomputed_steps']} recomputed step(s)")
    for s in result.scaling:
        echo(f"{s.kind} scaling" + (f": {s.fit.verdict()}" if s.fit else ""))
        echo("\n".join(table(rows(s.table), ("world_size", "repeats", "step_time_s", "spread", "speedup",
                                               "efficiency"), fmt=cell, headers=HEADERS)))
