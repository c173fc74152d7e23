"""list: the runs under the runs root, oldest first."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import COUNT, add_json, add_runs_dir, emit_json

NAME = "list"
ORDER = 70
HELP = "list runs (status, executor, job id, layout, and why a run failed)"
REASON_WIDTH = 100


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=COUNT, default=50, help="show the newest N runs (default 50)")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import list_runs, runs_root
    from hpc_tools.runstate import classify, refresh_all

    runs = list_runs(runs_root(args.runs_dir))[-args.limit:]
    rows = []
    for r, (m, job) in zip(runs, refresh_all(runs)):  # one sacct call for every Slurm run listed
        rows.append({"run_id": r.run_id, "state": m.get("state"), **classify(r, job, m).as_dict(),
                     "executor": m.get("executor"), "job_id": m.get("job_id"), "created": m.get("created"),
                     "layout": m.get("layout")})
    if args.json:
        emit_json(rows)
        return 0
    if not rows:
        print("no runs")
        return 0
    print(f"{'RUN':<44} {'STATUS':<13} {'EXECUTOR':<8} {'JOB':<8} {'LAYOUT':<20} REASON")
    for row in rows:
        reason = row["reason"] if row["status"] not in ("pending", "running", "completed") else ""
        print(f"{row['run_id']:<44} {row['status']:<13} {row['executor'] or '':<8} {str(row['job_id'] or '-'):<8} "
              f"{row['layout'] or '':<20} {reason[:REASON_WIDTH]}".rstrip())
    return 0
