"""resume: continue an ended run (failed, cancelled, timed out, hung) in its own folder from its newest checkpoint."""

from __future__ import annotations

import argparse
import sys

from hpc_tools.cli._common import add_json, add_overrides, add_run_ref, add_runs_dir, emit_json, say

NAME = "resume"
ORDER = 32
HELP = "continue a failed, cancelled, timed-out or hung run in its own folder from its newest checkpoint"
DESCRIPTION = HELP + """

The run keeps its folder, recipe and run id: the same executor it ran on starts a new life of it (submitit, or
`sbatch` of the run's own job.sbatch with the folder reused, or the local ranks), the trainer loads the newest complete
checkpoint, and the records are appended with the next `restart` number (analyze keeps the newest start's record of a
step that ran twice). On Slurm the new job id goes into the manifest with a `resumed` event; `resumes` keeps every
earlier life (job id, state, reason, checkpoint).

Refused (exit 2, nothing written): a run that is still live (cancel it first), a run that completed all its steps,
a run without a complete checkpoint of its own (submit it afresh), a run whose data files or tokenizer are gone or
whose partition no longer holds what it asks for (the same checks as `submit`).
--set changes only supervision fields: cluster.time_limit, cluster.signal_delay_s, cluster.hang_timeout_min."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_run_ref(p)
    p.add_argument("--executor", choices=["auto", "local", "slurm", "sbatch"], default="auto",
                   help="where the new life runs (default auto: as the run ran, from its manifest)")
    p.add_argument("--exclude", metavar="NODES", default=None,
                   help="Slurm nodes the new job must not use (sbatch --exclude, e.g. n2 or n[3-4])")
    add_overrides(p, "change a supervision field for the new life, e.g. --set cluster.time_limit=02:00:00")
    p.add_argument("--wait", action="store_true", help="on Slurm, wait for the job to end (local runs always wait)")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.resume import launch, plan_resume

    plan = plan_resume(args.run, args.runs_dir, args.executor, args.exclude, args.overrides)
    base = {"run_dir": str(plan.run.path), "run_id": plan.run.run_id, "executor": plan.executor,
            "from_step": plan.from_step, "checkpoint": plan.checkpoint.name, "restart": plan.restart,
            "previous_job_id": plan.previous["job_id"], "previous_state": plan.previous["state"],
            "skipped_checkpoints": plan.skipped}
    if not args.json:
        for line in plan.skipped:
            say(f"skipping a checkpoint that fails its size check: {line}")
        say(f"resuming {plan.run.run_id} ({plan.previous['status']}: {plan.previous['reason']}) from "
            f"{plan.checkpoint.name} (step {plan.from_step}) as restart {plan.restart} on {plan.executor}")
    job_id, result = launch(plan, echo=None if args.json else sys.stdout.buffer)
    if plan.executor == "local":
        state = plan.run.manifest()["state"]
        if args.json:
            emit_json({"ok": result == 0, **base, "job_id": None, "state": state, "exit_code": result})
        else:
            say(f"run {plan.run.run_id}: {state} (exit {result}); folder {plan.run.path}")
        return 0 if result == 0 else 1
    if not args.json:
        say(f"submitted Slurm job {job_id} (was {plan.previous['job_id']}); run folder {plan.run.path}")
        say(f"follow it with: python -m hpc_tools logs {plan.run.run_id} -f")
    state = "PENDING"
    if args.wait:
        from hpc_tools.runstate import wait

        state = wait(plan.run)["slurm_state"]
    if args.json:
        emit_json({"ok": state in ("PENDING", "COMPLETED"), **base, "job_id": job_id, "state": state})
    elif args.wait:
        say(f"job {job_id}: {state}")
    return 0 if state in ("PENDING", "COMPLETED") else 1
