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
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write the report into (created)")
    p.add_argument("--title", default=None, help="report title (default: the sweep or run names)")


def run(args: argparse.Namespace) -> int:
    from hpc_tools.analysis.report import write_report

    result = analysed(args)
    title = args.title or f"hpc_tools report: {', '.join(result.sweeps) or ', '.join(result.runs['run_id'][:3])}"
    files = write_report(result, args.out, title)
    if args.json:
        emit_json({"ok": True, **files})
    else:
        say(f"wrote {len(files['plots'])} plot(s) and {len(files['tables'])} table file(s)")
        print(files["report"][1])
    return 0
