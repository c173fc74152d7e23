"""submit: validate, render and run a recipe on Slurm (through submitit) or, with no Slurm, locally."""

from __future__ import annotations

import argparse
import sys

from hpc_tools.cli._common import COUNT, add_json, add_recipe_args, add_runs_dir, emit_json, say

NAME = "submit"
ORDER = 30
HELP = "validate, render and submit a recipe (Slurm via submitit; locally on CPU when no Slurm is installed)"
DESCRIPTION = HELP + """

--executor auto (default) uses Slurm when `sbatch` is on PATH; without it, it runs the job on this machine (one
process per rank, gloo) with the recipe's `local:` profile, and says so in one line. Slurm installed but its
controller not answering (`scontrol ping` not UP) is an error (exit 2) suggesting a retry or --executor local: a
login node never silently becomes the job's machine. Every submission gets a
run folder (runs/<name>-<time>-<id>/) with the resolved recipe, the script, a manifest, logs and records.
A submitted recipe without overrides or profile also refreshes jobs/<recipe>.sbatch.

A local run shows rank 0's output as it trains: the start-up phases with their times, then one progress line per
training.log_interval (step N/total, loss, validation loss, tok/s, TFLOP/s, MFU, memory, elapsed, ETA). Library
warnings go to each rank's log once each, and one line counts them; `status` shows the newest progress line.

Failures: with --set cluster.restarts=N a rank that dies or hangs (or a crashed node) is recovered inside the same
Slurm job (a new srun step from the newest complete checkpoint, no trip through the queue; locally the ranks start
again), N times over the run; --set cluster.spare_nodes=K allocates K extra nodes so a failed node is left out.
Each restart is listed by `status` (docs/fault-tolerance.md)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_args(p)
    p.add_argument("--executor", choices=["auto", "slurm", "local"], default="auto",
                   help="where to run (default auto: Slurm if installed, else local)")
    p.add_argument("--wait", action="store_true", help="on Slurm, wait for the job to end (local runs always wait)")
    p.add_argument("--force", action="store_true",
                   help="submit even if the planner predicts it does not fit, and without the checks against the "
                        "world (files the recipe names, the live partition)")
    p.add_argument("--auto", action="store_true",
                   help="let the planner choose the layout (see `python -m hpc_tools plan --search`)")
    p.add_argument("--measure", type=COUNT, default=None, metavar="K",
                   help="with --auto: run the planner's top K for a few steps first (as `plan --search --measure K`) "
                        "and submit the one with the fastest measured step time")
    p.add_argument("--measure-steps", type=COUNT, default=None, metavar="N",
                   help="measured steps per candidate with --measure, after the warm-up steps (default 5)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the script; write and submit nothing")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.submission import checked_runs_root, launch, plan_submission

    checked_runs_root(args.runs_dir)  # a bad --runs-dir is told before anything runs (a dry run included)

    overrides, executor, profile, extra = args.overrides, args.executor, args.profile, {}
    if args.measure is not None or args.measure_steps is not None:
        measured = _measure(args)
        if measured is None:
            return 1
        overrides, executor, profile, extra = measured
    plan = plan_submission(args.recipe, overrides, profile, executor, check_fit=not args.force,
                           auto=args.auto and not extra, dry_run=args.dry_run)
    if plan.note and not args.json:
        say(plan.note)
    if not args.json:
        from hpc_tools.recipe.rules import recipe_notes

        for line in recipe_notes(plan.recipe):  # valid but unusual choices, one line each
            say(line)
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
                       "exit_code": result, **extra})
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
                   "job_id": job_id, "state": state, **extra})
    elif args.wait:
        say(f"job {job_id}: {state}")
    return 0 if state in ("PENDING", "COMPLETED") else 1


def _measure(args: argparse.Namespace) -> tuple[list[str], str, str | None, dict] | None:
    """``--auto --measure K``: the measured layout search (hpc_tools/sweep/measure.py); returns the overrides that
    give its winner, the executor and profile it measured with, and its report for --json; None (after saying why)
    when no candidate measured a step."""
    from hpc_tools.errors import UserError
    from hpc_tools.sweep.measure import DEFAULT_MEASURE_STEPS, measured_search, print_measure

    if args.measure is None or not args.auto:
        raise UserError("--measure K measures the planner's top K layouts: use it with --auto "
                        "(e.g. submit RECIPE --auto --measure 3)")
    if args.dry_run:
        raise UserError("--measure runs jobs, which --dry-run never does (measure without submitting with "
                        "`python -m hpc_tools plan RECIPE --search --measure K`)")
    steps = DEFAULT_MEASURE_STEPS if args.measure_steps is None else args.measure_steps
    report = measured_search(args.recipe, args.measure, args.overrides, args.profile, args.executor, steps,
                             args.runs_dir, say=say)
    if not args.json:
        print_measure(report)
    if report.winner is None:
        if args.json:
            emit_json({"ok": False, "measure": report.as_dict()})
        say(f"none of the {len(report.outcomes)} measured candidates completed a measured step: nothing submitted "
            f"({report.sweep or 'see the reasons above'})")
        return None
    say("measured search chose: " + " ".join(report.winner.overrides))
    return ([*args.overrides, *report.winner.overrides], report.executor, report.profile,
            {"measure": report.as_dict()})


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
