"""sweep: run a recipe's grid, show each cell's status, resubmit failed cells."""

from __future__ import annotations

import argparse
import time

from hpc_tools.cli._common import add_json, add_overrides, add_runs_dir, emit_json, say

NAME = "sweep"
ORDER = 35
HELP = "run a recipe's sweep grid (Slurm job arrays, or locally), show cell status, rerun failed cells"
DESCRIPTION = """\
Three forms:
  python -m hpc_tools sweep RECIPE [--profile local] [--set K=V] [--executor auto|slurm|local] [--dry-run] [--json]
      expand the recipe's sweep: grid, drop cells that break a rule, do not fit in memory, name missing files or
      do not fit the live partition (listed with the reason, as `submit` would refuse them), create
      <runs root>/sweeps/<name>-<stamp>/ with sweep.json and one run folder per cell x repeat, and submit them
      (cells with equal Slurm resources as one job array, but a cell with cluster.restarts as its own job: an
      array task never restarts; without Slurm, locally one after another). On Slurm, arrays hold at most
      MaxArraySize tasks, the queue takes what the user's MaxSubmitJobs and MaxJobCount leave room for, and
      sweep.max_parallel caps the cells running at once (%K); cells that do not go in now wait in sweep.json.
  python -m hpc_tools sweep status SWEEP [--wait] [--json]
      classify every cell, with a one-line reason: pending, running, completed, failed, out_of_memory, timeout,
      hang, node_failure, preempted, cancelled (from sacct, the run manifest, HANG markers and logs); on Slurm,
      submit the cells that have become due since (see above). --wait: keep doing so every few seconds until every
      cell has ended (run it in a terminal multiplexer, or as a small job, for a sweep larger than the limits).
  python -m hpc_tools sweep rerun SWEEP --failed [--status S ...] [--exclude NODES] [--executor ...] [--dry-run]
      resubmit only the failed cells (failed, out_of_memory, timeout, hang, node_failure; add cancelled with
      --status cancelled) as new run folders; earlier attempts stay listed in sweep.json. --exclude keeps them
      off Slurm nodes, e.g. the straggler node `analyze` names.
SWEEP is a sweep folder or a sweep id (prefix) under <runs root>/sweeps. Analyse with
`python -m hpc_tools analyze SWEEP` and `python -m hpc_tools report SWEEP --out DIR`.
"""
ACTIONS = ("status", "rerun")
WAIT_POLL_S = 5.0  # `sweep status --wait`: one sacct call (and, when cells are due, one submission) per poll


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = ("python -m hpc_tools sweep RECIPE [options]\n"
               "       python -m hpc_tools sweep status SWEEP [--wait] [--json]\n"
               "       python -m hpc_tools sweep rerun SWEEP --failed [options]")
    p.add_argument("target", nargs="+", metavar="RECIPE | status SWEEP | rerun SWEEP",
                   help="a recipe with a sweep: section, or `status`/`rerun` followed by a sweep folder or id")
    add_overrides(p, "override a recipe value for every cell (before the cell's own values)")
    p.add_argument("--profile", choices=["local"], default=None,
                   help="apply the recipe's local profile (default: when the sweep runs locally)")
    p.add_argument("--executor", choices=["auto", "slurm", "local"], default="auto",
                   help="auto = Slurm when a controller answers, else local (default auto)")
    p.add_argument("--dry-run", action="store_true", help="list the cells (and dropped cells) without creating runs")
    p.add_argument("--wait", action="store_true",
                   help="status: poll until every cell has ended, submitting due cells as earlier ones end")
    p.add_argument("--failed", action="store_true", help="rerun: resubmit the cells that failed in any way")
    p.add_argument("--status", dest="statuses", action="append", default=[], metavar="STATUS",
                   help="rerun: resubmit cells in this status (repeatable), e.g. --status cancelled")
    p.add_argument("--exclude", default=None, metavar="NODES",
                   help="rerun: Slurm nodes to keep the resubmitted cells off (sbatch --exclude, e.g. n2 or n[1-2]), "
                        "such as the straggler node `analyze` names")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.errors import UserError

    head, rest = args.target[0], args.target[1:]
    if head in ACTIONS:
        if len(rest) != 1:
            raise UserError(f"sweep {head} needs exactly one SWEEP (a sweep folder or id), got {len(rest)}")
        return _status(args, rest[0]) if head == "status" else _rerun(args, rest[0])
    if rest:
        raise UserError(f"sweep takes one RECIPE, got {len(args.target)} arguments (did you mean `sweep status`?)")
    return _start(args, head)


def _plan_rows(plan) -> list[dict]:
    rows = [{"cell": c.index, "label": c.label(), "overrides": c.overrides, "valid": c.valid, "reasons": c.reasons}
            for c in plan.cells]
    for row, cell in zip(rows, plan.cells):
        if cell.valid:
            from hpc_tools.layout import ParallelLayout

            row["layout"] = ParallelLayout.from_recipe(cell.recipe).describe()
    return rows


def _start(args, recipe_path: str) -> int:
    from hpc_tools.recipe.load import read_yaml
    from hpc_tools.submission import choose_executor
    from hpc_tools.sweep.grid import check_world, expand
    from hpc_tools.sweep.runner import create_sweep, require_cells, submit_cells, summary

    raw = read_yaml(recipe_path)
    # A dry run submits nothing, so it never asks a controller (plan on a laptop, or during a controller outage).
    executor, note = choose_executor(args.executor, dry_run=args.dry_run)
    profile = args.profile or ("local" if executor == "local" and raw.get("local") is not None else None)
    plan = expand(raw, args.overrides, profile, recipe_path)
    check_world(plan, slurm=executor == "slurm" and not args.dry_run)  # the files it names; the live partition
    if note and not args.json:
        say(note)
    for c in plan.invalid:
        say(f"dropped cell {c.index} ({c.label()}): {'; '.join(c.reasons)}")
    require_cells(plan)
    if args.dry_run:
        result = {"ok": True, "dry_run": True, "executor": executor, "profile": profile,
                  "repeats": plan.config.repeats, "cells": _plan_rows(plan)}
        if args.json:
            emit_json(result)
        else:
            for row in result["cells"]:
                if row["valid"]:
                    print(f"cell {row['cell']:3d}  {row['label']:40s} {row['layout']}  x{plan.config.repeats}")
        return 0
    limits = _limits(plan, executor)  # before anything is written: a sweep that cannot run at all is refused
    folder = create_sweep(plan, recipe_path, executor, args.runs_dir)
    say(f"sweep {folder.path}: {len(plan.valid)} cell(s) x {plan.config.repeats} repeat(s), "
        f"{len(plan.invalid)} dropped, executor {executor}")
    submit_cells(folder, [c["id"] for c in folder.read()["cells"]], executor, say, limits=limits)
    data = folder.read()
    if args.json:
        emit_json({"ok": True, "sweep": str(folder.path), "executor": executor, "summary": summary(data),
                   "cells": data["cells"], "invalid": data["invalid"]})
    else:
        print(folder.path)
    failed = executor == "local" and any(c["status"] != "completed" for c in data["cells"])
    return 1 if failed else 0


def _limits(plan, executor: str):
    """Slurm's limits for a sweep about to be submitted; refuses in one line one that cannot run at all."""
    if executor != "slurm":
        return None
    from hpc_tools.errors import UserError
    from hpc_tools.sweep.limits import read_limits, refusal

    limits = read_limits()
    why = refusal(limits)
    if why:
        raise UserError(f"sweep {plan.name}: {why}")
    cells = len(plan.valid) * plan.config.repeats
    throttle = plan.config.max_parallel
    if throttle is not None and limits.queue_limit is not None and throttle > limits.queue_limit:
        say(f"note: sweep.max_parallel={throttle} exceeds what Slurm lets this user queue ({limits.describe()}): "
            f"at most {limits.queue_limit} cell(s) run at once")
    if cells > limits.array_tasks or (limits.queue_room is not None and cells > limits.queue_room):
        say(f"note: {cells} cells exceed Slurm's limits ({limits.describe()}): submitted in arrays of at most "
            f"{limits.array_tasks}, the rest as earlier cells end (`sweep status SWEEP` submits them)")
    return limits


def _status(args, ref: str) -> int:
    from hpc_tools.sweep.folder import SweepFolder

    folder = SweepFolder.find(ref, args.runs_dir)
    data = _refresh_and_submit(folder, quiet=args.json)
    while args.wait and _unfinished(data):
        time.sleep(WAIT_POLL_S)
        data = _refresh_and_submit(folder, quiet=args.json)
    from hpc_tools.sweep.runner import summary

    waiting = sum(1 for c in data["cells"] if not c.get("job_id") and c["status"] == "pending") \
        if data.get("executor") == "slurm" else 0
    if args.json:
        emit_json({"ok": True, "sweep": str(folder.path), "summary": summary(data), "cells": data["cells"],
                   "invalid": data.get("invalid", []), "waiting": waiting, "max_parallel": data.get("max_parallel"),
                   "chunks": data.get("chunks", [])})
        return 0
    print(f"sweep {folder.sweep_id} ({data.get('executor')}): "
          + ", ".join(f"{k} {v}" for k, v in sorted(summary(data).items()))
          + (f"; {waiting} not yet submitted (Slurm's limits or sweep.max_parallel)" if waiting else ""))
    for c in data["cells"]:
        explain = c["status"] not in ("completed", "running", "pending") and c.get("reason")
        reason = f"  ({c['reason']})" if explain else ""
        print(f"  {c['id']:10s} {c['status']:13s} job {str(c.get('job_id') or '-'):10s} {c['label']}{reason}")
    for c in data.get("invalid", []):
        print(f"  dropped    cell {c['cell']} ({c['label']}): {'; '.join(c['reasons'])}")
    return 0


def _rerun(args, ref: str) -> int:
    from hpc_tools.errors import UserError
    from hpc_tools.runstate import FAILURE_STATUSES, STATUSES
    from hpc_tools.submission import choose_executor
    from hpc_tools.sweep.folder import SweepFolder
    from hpc_tools.sweep.runner import rerun

    if not args.failed and not args.statuses:
        raise UserError("sweep rerun needs --failed or --status STATUS (e.g. `sweep rerun SWEEP --failed`)")
    bad = [s for s in args.statuses if s not in STATUSES]
    if bad:
        raise UserError(f"--status {bad[0]} is not a cell status (use one of {', '.join(STATUSES)})")
    statuses = tuple(dict.fromkeys((FAILURE_STATUSES if args.failed else ()) + tuple(args.statuses)))
    folder = SweepFolder.find(ref, args.runs_dir)
    executor, note = choose_executor(args.executor) if not args.dry_run else (folder.read().get("executor"), "")
    if args.exclude is not None and (executor != "slurm" or not args.exclude.strip() or " " in args.exclude):
        raise UserError(f"--exclude {args.exclude!r}: " + ("give Slurm node names, e.g. --exclude n2 or n[1-2]"
                        if executor == "slurm" else f"only Slurm places jobs on nodes; this rerun runs {executor}ly "
                        "(drop --exclude, or use --executor slurm)"))
    if note and not args.json:
        say(note)
    ids = rerun(folder, statuses, executor, say, dry_run=args.dry_run, exclude=args.exclude)
    if args.json:
        emit_json({"ok": True, "sweep": str(folder.path), "rerun": ids, "dry_run": args.dry_run})
    else:
        say(f"{'would rerun' if args.dry_run else 'resubmitted'} {len(ids)} cell(s): {', '.join(ids) or 'none'}")
    return 0


def _refresh_and_submit(folder, quiet: bool) -> dict:
    """Cells' statuses now; on Slurm, submit those that have become due, then the statuses again if any went in."""
    from hpc_tools.sweep.runner import refresh
    from hpc_tools.sweep.submit import submit_due

    data = refresh(folder)
    if submit_due(folder, (lambda line: None) if quiet else say):
        data = folder.read()
    return data


def _unfinished(data: dict) -> bool:
    from hpc_tools.runstate import LIVE_STATUSES

    return any(c["status"] in LIVE_STATUSES for c in data["cells"])
