"""``python -m hpc_tools.job.open_run --run-dir DIR`` (recipe on stdin): the batch shell's first step.

Creates the run folder for a job started with plain ``sbatch jobs/<recipe>.sbatch``, or, when the folder already
exists (``hpc_tools submit`` made it, Slurm requeued the job, or ``hpc_tools resume`` resubmitted the script with
``HPC_TOOLS_RUN_DIR`` naming the run's own folder), records the (re)start in its manifest.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from hpc_tools.job.batch_log import batch_log_path
from hpc_tools.recipe.load import dump_resolved, resolve
from hpc_tools.recipe.yamlfile import parse_yaml
from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.runtime.distenv import restart_count

_ASK = object()  # no batch log given: ask Slurm here


def open_run(run_dir: Path, recipe_text: str, script: Path | None, batch_log=_ASK) -> RunFolder:
    """``batch_log``: the batch log's path as the batch host found it (``hpc_tools.job.batch_log``; None or "":
    unknown); not given, it is asked of Slurm here."""
    run = RunFolder(run_dir)
    job_id = os.environ.get("SLURM_JOB_ID")
    job = {"job_id": job_id, "restart_count": restart_count(dict(os.environ)),
           "nodelist": os.environ.get("SLURM_JOB_NODELIST"),
           "batch_log": batch_log_path(job_id) if batch_log is _ASK else (batch_log or None)}
    if run.exists():
        run.update(event="batch started", state="STARTING", batch_started=now_iso(), **job)
        return run
    recipe = resolve(parse_yaml(recipe_text, "the recipe in the batch script"), layered=False)  # resolved: judged alone
    text = dump_resolved(recipe)
    script_text = script.read_text() if script and script.is_file() else ""
    return RunFolder.create(run.path.parent, run.path.name, text, script_text,
                            {"executor": "sbatch", "state": "STARTING", "batch_started": now_iso(), "name": recipe.name,
                             **job},
                            check_recipe=lambda t: dump_resolved(resolve(parse_yaml(t), layered=False)),
                            mode=recipe.cluster.run_dir_mode_bits)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.job.open_run", description=__doc__)
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--script", type=Path, default=None, help="the batch script, copied into the run folder")
    parser.add_argument("--batch-log", default=_ASK, help="the batch log's path, found on the batch host "
                        "(python -m hpc_tools.job.batch_log; empty: unknown); without it Slurm is asked here")
    args = parser.parse_args(argv)
    run = open_run(args.run_dir, sys.stdin.read(), args.script, args.batch_log)
    print(f"hpc_tools: run folder {run.path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
