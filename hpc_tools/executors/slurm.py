"""The Slurm executor: submitit submits one task per GPU, and each task runs the rank program on the run folder.

Resources come from ``SlurmSpec`` (the same flags the rendered sbatch script carries), the environment set-up from
``render.envsetup``. Slurm is "available" when ``sbatch`` is on PATH and ``scontrol ping`` reports a controller UP.
Job states (sacct) are read by ``hpc_tools.runstate``, not here.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from hpc_tools.recipe.schema import Recipe
from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.render.envsetup import launch_prefix, setup_lines, srun_args
from hpc_tools.render.slurm_params import SlurmSpec


def slurm_available(timeout_s: float = 5.0) -> tuple[bool, str]:
    """(True, "") when a Slurm controller answers; else (False, why)."""
    if shutil.which("sbatch") is None:
        return False, "sbatch is not on PATH"
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol ping failed ({exc})"
    if out.returncode != 0 or " is UP" not in out.stdout:
        said = (out.stdout or out.stderr).strip()
        return False, f"scontrol ping: {said.splitlines()[0] if said else 'no answer'}"
    return True, ""


def make_executor(recipe: Recipe, folder: Path):
    import submitit

    python = shlex.join(launch_prefix(recipe.cluster) + [recipe.cluster.python])
    executor = submitit.SlurmExecutor(folder=str(folder), python=python)
    params = SlurmSpec.from_recipe(recipe).submitit_parameters()
    executor.update_parameters(**params, setup=setup_lines(recipe.cluster), srun_args=["--kill-on-bad-exit=1",
                                                                                          *srun_args(recipe.cluster)])
    return executor


def rank_task(run_dir: str) -> int:
    """What each submitit task runs (a module-level function, so submitit pickles it by reference)."""
    from hpc_tools.runtime.rank import run_rank

    return run_rank(run_dir)


def submit_run(run: RunFolder, recipe: Recipe):
    """Submit one run; records the job id and log locations in its manifest. Returns the submitit job."""
    folder = run.path / "submitit"
    job = make_executor(recipe, folder).submit(rank_task, str(run.path))
    run.update(event="submitted", state="PENDING", executor="slurm", job_id=str(job.job_id), submitted=now_iso(),
               log_glob=str(folder / f"{job.job_id}_*_log.*"))
    return job


def submit_array(runs: list[RunFolder], recipe: Recipe) -> list:
    """Submit runs that share Slurm resources as one job array (one array task per run)."""
    folder = runs[0].path.parent / f".array-{runs[0].run_id}"
    executor = make_executor(recipe, folder)
    jobs = executor.map_array(rank_task, [str(r.path) for r in runs])
    for run, job in zip(runs, jobs):
        run.update(event="submitted", state="PENDING", executor="slurm", job_id=str(job.job_id), submitted=now_iso(),
                   log_glob=str(folder / f"{job.job_id}_*_log.*"))
    return jobs


def cancel(job_id: str) -> None:
    """scancel the job (its state is read back through ``hpc_tools.runstate``)."""
    subprocess.run(["scancel", job_id], check=True, capture_output=True, text=True, timeout=15)
