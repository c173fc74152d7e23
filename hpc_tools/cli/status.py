"""status: the state of a run (the latest by default), refreshed from Slurm for Slurm runs."""

from __future__ import annotations

import argparse

from hpc_tools.cli._common import add_json, add_runs_dir, emit_json

NAME = "status"
ORDER = 40
HELP = "show a run's state, job id, layout, times and last step (default: the latest run)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", help="run folder, run id (or unique prefix) or Slurm job id; default the latest")
    add_runs_dir(p)
    add_json(p)


def refresh(run) -> dict:
    """The manifest, with Slurm's view (sacct) merged in for Slurm runs."""
    from hpc_tools.executors.slurm import sacct_state

    manifest = run.manifest()
    job_id = manifest.get("job_id")
    if manifest.get("executor") in ("slurm", "sbatch") and job_id:
        info = sacct_state(str(job_id))
        if info and info["state"] and info["state"] != manifest.get("slurm_state"):
            fields = {"slurm_state": info["state"], "slurm_exit_code": info["exit_code"], "elapsed": info["elapsed"]}
            if info["state"] in ("FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"):
                fields["state"] = info["state"]  # the manifest keeps its first terminal state (RunFolder.update)
            manifest = run.update(event=f"slurm {info['state']}", **fields)
    return manifest


def last_step(run) -> dict | None:
    """The newest step record of rank 0 (the tail of its JSON-lines file, not the whole file)."""
    import json

    path = run.records_dir / "rank00000.jsonl"
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(f.tell() - 8192, 0))
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def resolve_run(ref: str | None, runs_dir: str | None):
    from hpc_tools.errors import UserError
    from hpc_tools.registry import find_run, list_runs, runs_root

    root = runs_root(runs_dir)
    if ref:
        return find_run(ref, root)
    runs = list_runs(root)
    if not runs:
        raise UserError(f"no runs under {root} (submit one with `python -m hpc_tools submit RECIPE`)")
    return runs[-1]


def run(args: argparse.Namespace) -> int:
    r = resolve_run(args.run, args.runs_dir)
    manifest = refresh(r)
    step = last_step(r)
    if args.json:
        emit_json({"run_dir": str(r.path), **manifest, "last_step": step})
        return 0
    keys = ("state", "slurm_state", "executor", "job_id", "layout", "nodelist", "created", "started", "ended",
            "restart_count")
    print(f"run      {r.run_id}\nfolder   {r.path}")
    for key in keys:
        if manifest.get(key) not in (None, ""):
            print(f"{key:<8} {manifest[key]}" if len(key) <= 8 else f"{key} {manifest[key]}")
    if step:
        loss = f", loss {step['loss']:.4f}" if step.get("loss") is not None else ""
        print(f"last step {step['step']}{loss}, {step['step_time_s']:.3f} s/step, {step['tokens_per_s']:.0f} tok/s")
    if manifest.get("error"):
        print(f"error    {manifest['error']}")
    return 0
