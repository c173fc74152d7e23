"""list: the runs under the runs root, oldest first."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import COUNT, add_json, add_runs_dir, emit_json

NAME = "list"
ORDER = 70
HELP = "list runs (status, executor, job id, layout, and why a run failed)"


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
    from hpc_tools.cli._screen import table

    for row in rows:  # why a run is where it is matters for the ones that ended badly (or hang)
        row["why"] = row["reason"] if row["status"] not in ("pending", "running", "completed") else ""
        row["job_id"] = row["job_id"] or "-"
    print("\n".join(table(rows, ("run_id", "status", "job_id", "executor", "layout", "why"), keep=2,
                           headers=HEADERS, last_wraps=True, priority=("why", "job_id", "layout", "executor"))))
    return 0


# A narrow terminal drops the executor first, then the layout, then the job id; the reason wraps instead.
HEADERS = {"run_id": "RUN", "status": "STATUS", "job_id": "JOB", "layout": "LAYOUT", "executor": "EXECUTOR",
           "why": "REASON"}
