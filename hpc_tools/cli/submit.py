"""submit: validate, render and run a recipe on Slurm (through submitit) or, with no Slurm, locally."""

from __future__ import annotations

import argparse
import sys

from hpc_tools.cli._common import add_json, add_recipe_args, add_runs_dir, emit_json, say

NAME = "submit"
ORDER = 30
HELP = "validate, render and submit a recipe (Slurm via submitit; locally on CPU when no Slurm answers)"
DESCRIPTION = HELP + """

--executor auto (default) uses Slurm when `sbatch` is on PATH and `scontrol ping` answers; otherwise it runs the job
on this machine (one process per rank, gloo) with the recipe's `local:` profile, and says so. Every submission gets a
run folder (runs/<name>-<time>-<id>/) with the resolved recipe, the script, a manifest, logs and records.
A submitted recipe without overrides or profile also refreshes jobs/<recipe>.sbatch."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p)
    p.add_argument("--executor", choices=["auto", "slurm", "local"], default="auto",
                   help="where to run (default auto: Slurm if it answers, else local)")
    p.add_argument("--wait", action="store_true", help="on Slurm, wait for the job to end (local runs always wait)")
    p.add_argument("--force", action="store_true", help="submit even if the planner predicts it does not fit")
    p.add_argument("--auto", action="store_true",
                   help="let the planner choose the layout (see `python -m hpc_tools plan --search`)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the script; write and submit nothing")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.submission import launch, plan_submission

    plan = plan_submission(args.recipe, args.overrides, args.profile, args.executor, check_fit=not args.force,
                           auto=args.auto)
    if plan.note and not args.json:
        say(plan.note)
    if args.dry_run:
        from hpc_tools.render.sbatch import render_sbatch

        if args.json:
            emit_json({"ok": True, "executor": plan.executor, "profile": plan.profile,
                       "script": render_sbatch(plan.recipe, plan.source)})
        else:
            sys.stdout.write(render_sbatch(plan.recipe, plan.source))
        return 0
    if not args.overrides and plan.profile is None and not args.auto:
        _refresh_jobs_script(args.recipe, plan)
    echo = None if args.json else sys.stdout.buffer
    run, result = launch(plan, args.runs_dir, echo=echo)
    if plan.executor == "local":
        manifest = run.manifest()
        if args.json:
            emit_json({"ok": result == 0, "run_dir": str(run.path), "executor": "local", "state": manifest["state"],
                       "exit_code": result})
        else:
            say(f"run {run.run_id}: {manifest['state']} (exit {result}); folder {run.path}")
        return 0 if result == 0 else 1
    job_id = str(result.job_id)
    if not args.json:
        say(f"submitted Slurm job {job_id}; run folder {run.path}")
        say(f"follow it with: python -m hpc_tools logs {run.run_id} -f")
    state = _wait(run) if args.wait else "PENDING"
    if args.json:
        emit_json({"ok": state in ("PENDING", "COMPLETED"), "run_dir": str(run.path), "executor": "slurm",
                   "job_id": job_id, "state": state})
    elif args.wait:
        say(f"job {job_id}: {state}")
    return 0 if state in ("PENDING", "COMPLETED") else 1


def _refresh_jobs_script(recipe_path: str, plan) -> None:
    from hpc_tools.registry import atomic_write
    from hpc_tools.render.sbatch import job_script_path, render_sbatch

    out = job_script_path(recipe_path)
    if out.parent.is_dir():
        atomic_write(out, render_sbatch(plan.recipe, plan.source))


def _wait(run, poll_s: float = 2.0) -> str:
    """Poll sacct until the job ends (submitit's own wait can hang without accounting); returns Slurm's final state."""
    from hpc_tools.runstate import wait

    return wait(run, poll_s)["slurm_state"]
