"""status: the state of a run (the latest by default), refreshed from Slurm for Slurm runs, and why it is in it."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import add_json, add_runs_dir, emit_json

NAME = "status"
ORDER = 40
HELP = "show a run's state and why, job id, layout, times and last step (default: the latest run)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run folder, run id (or unique prefix) or Slurm job id; default the latest")
    add_runs_dir(p)
    add_json(p)


def run(args: argparse.Namespace) -> int:
    from hpc_tools.registry import resolve_run
    from hpc_tools.runstate import classify, last_step, refresh_all

    r = resolve_run(args.run, args.runs_dir)
    ((manifest, job),) = refresh_all([r])
    verdict = classify(r, job, manifest)
    step = last_step(r)
    if args.json:
        emit_json({"run_dir": str(r.path), **manifest, **verdict.as_dict(), "last_step": step})
        return 0
    keys = ("state", "slurm_state", "executor", "job_id", "layout", "nodelist", "created", "started", "ended",
            "restart_count")
    print(f"run      {r.run_id}\nfolder   {r.path}\nstatus   {verdict.status}: {verdict.reason}")
    for key in keys:
        if manifest.get(key) not in (None, ""):
            print(f"{key:<8} {manifest[key]}" if len(key) <= 8 else f"{key} {manifest[key]}")
    if step:
        loss = f", loss {step['loss']:.4f}" if step.get("loss") is not None else ""
        print(f"last step {step['step']}{loss}, {step['step_time_s']:.3f} s/step, {step['tokens_per_s']:.0f} tok/s")
    if manifest.get("error"):
        print(f"error    {manifest['error']}")
    return 0
