"""report: a report folder (report.md, self-contained report.html, PNG plots, CSV/parquet tables)."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import add_json, add_runs_dir, emit_json, say

NAME = "report"
ORDER = 61
HELP = "write report.md, a self-contained report.html, plots and tables for runs or a sweep"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("refs", nargs="+", metavar="RUN_OR_SWEEP",
                   help="run folders, sweep folders, folders of runs, run ids or Slurm job ids")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the report into (created)")
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="steps excluded from statistics (default: each recipe's profiling.warmup_steps)")
    p.add_argument("--scaling", choices=["auto", "strong", "weak", "none"], default=None,
                   help="how to read the runs as a scaling series (default: the sweep's setting, else auto)")
    p.add_argument("--title", default=None, help="report title (default: the sweep or run names)")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.analysis.analyze import analyse
    from hpc_tools.analysis.report import write_report
    from hpc_tools.errors import UserError

    if args.warmup is not None and args.warmup < 0:
        raise UserError(f"--warmup {args.warmup} must be >= 0 (steps excluded from the statistics)")
    result = analyse(args.refs, args.warmup, args.runs_dir, args.scaling)
    title = args.title or f"hpc_tools report: {', '.join(result.sweeps) or ', '.join(result.runs['run_id'][:3])}"
    files = write_report(result, args.out, title)
    if args.json:
        emit_json({"ok": True, **files})
    else:
        say(f"wrote {len(files['plots'])} plot(s) and {len(files['tables'])} table file(s)")
        print(files["report"][1])
    return 0
