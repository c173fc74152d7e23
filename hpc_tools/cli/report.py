"""report: a report folder (report.md, self-contained report.html, PNG plots, CSV/parquet tables)."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import emit_json, say
from hpc_tools.cli.analyze import add_analysis_arguments, analysed

NAME = "report"
ORDER = 61
HELP = ("write report.md, a self-contained report.html, plots (loss and validation loss, scaling, step-time breakdown, "
        "predicted vs measured, MFU, memory) and tables for runs or a sweep")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_analysis_arguments(p)
    p.add_argument("--out", metavar="DIR", help="folder to write the report into (created; default: report/ inside "
                                                "the one run or sweep folder named)")
    p.add_argument("--title", default=None, help="report title (default: the sweep or run names)")


def default_out(refs: list[str], runs_dir: str | None) -> str:
    """``report/`` inside the one run, sweep or runs folder named (a run id is looked up as ``status`` does)."""
    from pathlib import Path

    from hpc_tools.errors import UserError

    if len(refs) != 1:
        raise UserError(f"report of {len(refs)} runs or sweeps: give --out DIR (a report of one run or sweep goes to "
                        "its folder's report/ by default)")
    folder = Path(refs[0])
    if not folder.is_dir():
        from hpc_tools.registry import find_run, runs_root

        folder = find_run(refs[0], runs_root(runs_dir)).path
    return str(folder / "report")


def run(args: argparse.Namespace) -> int:
    from hpc_tools.analysis.report import write_report

    if args.out is None:  # before the analysis: a refusal costs nothing
        args.out = default_out(args.refs, args.runs_dir)
    result = analysed(args)
    title = args.title or f"hpc_tools report: {', '.join(result.sweeps) or ', '.join(result.runs['run_id'][:3])}"
    files = write_report(result, args.out, title)
    if args.json:
        emit_json({"ok": True, **files})
    else:
        say(f"wrote {len(files['plots'])} plot(s) and {len(files['tables'])} table file(s)")
        print(files["report"][1])
    return 0
