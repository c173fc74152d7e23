"""The Slurm executor: submitit submits one task per GPU, and each task runs the rank program on the run folder.

Resources come from ``SlurmSpec`` (the same flags the rendered sbatch script carries), the environment set-up from
``render.envsetup``. Slurm is "available" when ``sbatch`` is on PATH (and ``HPC_TOOLS_SLURM`` is not ``off``:
``hpc_tools.slurm_client``) and ``scontrol ping`` reports a controller UP.
Job states (sacct) are read by ``hpc_tools.runstate``, not here.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from hpc_tools import slurm_client
from hpc_tools.recipe.schema import Recipe
from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.render import launchers
from hpc_tools.render.envsetup import (
    checked_setup_lines,
    launch_prefix,
    rank_srun_args,
    restart_policy_args,
    srun_args,
    step_count_args,
)
from hpc_tools.render.slurm_params import SlurmSpec
from hpc_tools.slurm_client import absent_reason

REPO = Path(__file__).resolve().parents[2]  # the checkout (or site-packages) that holds hpc_tools


def slurm_installed() -> bool:
    """Slurm's client commands are on PATH and not turned off (``HPC_TOOLS_SLURM=off``), whether or not a controller
    answers."""
    return absent_reason("sbatch") is None


def slurm_available(timeout_s: float = 5.0) -> tuple[bool, str]:
    """(True, "") when a Slurm controller answers; else (False, why) (``slurm_client.ping``)."""
    return slurm_client.ping(timeout_s)


def make_executor(recipe: Recipe, folder: Path, exclude: str | None = None, env: dict[str, str] | None = None,
                  run_dir: Path | None = None):
    """A submitit executor for the recipe's resources; ``exclude`` (sbatch --exclude) keeps the job off those nodes,
    ``env`` is exported in the batch script before the ranks start (after the recipe's own set-up). ``run_dir`` (a
    run folder, or the runs root of an array's runs) gets the script's epilogue as submitit's teardown."""
    import submitit

    python = shlex.join(launch_prefix(recipe.cluster) + [recipe.cluster.python])
    executor = submitit.SlurmExecutor(folder=str(folder), python=python)
    params = SlurmSpec.from_recipe(recipe).submitit_parameters()
    if exclude:
        params["exclude"] = exclude
    # Each set-up line checked (submitit's script has no `set -e`): a failure ends the job, named in log and manifest.
    setup = checked_setup_lines(recipe.cluster, shlex.quote(str(run_dir or folder)))
    setup += [f"export {k}={shlex.quote(v)}" for k, v in (env or {}).items()]
    # pyxis: the repository and the folder submitit writes to (the run folder, or the runs root of an array) mounted
    container = srun_args(recipe.cluster, repo=str(REPO), mount_dir=str(Path(folder).absolute().parent))
    srun = [*rank_srun_args(recipe.cluster), *container]
    teardown = epilogue_lines(recipe.cluster.python, run_dir, recipe.cluster.requeue) if run_dir else None
    if recipe.cluster.restarts and run_dir and RunFolder(run_dir).exists():  # one run (an array's runs: no restarts)
        policy = restart_policy_args(recipe.cluster)
        setup += restart_setup_lines(recipe.cluster.python, run_dir, policy)
        teardown = restart_lines(python, recipe.cluster.python, run_dir, Path(folder).absolute(), srun,
                                 policy, step_count_args(recipe.cluster)) + teardown
    executor.update_parameters(**params, setup=setup, srun_args=srun, **({"teardown": teardown} if teardown else {}))
    return executor


def restart_setup_lines(python: str, run_dir: Path, policy: str) -> list[str]:
    """Before submitit's rank step: this start's number (``hpc_tools.job.restarts begin``); the ranks derive the
    rendezvous from their step's nodes (submitit's srun names none of its own). ``policy``: the controller's options
    (``restart_policy_args``)."""
    run = shlex.quote(str(run_dir))
    return [f'eval "$({shlex.quote(python)} -m hpc_tools.job.restarts begin --run-dir {run} {policy})" || true',
            "unset MASTER_ADDR MASTER_PORT",
            f"{shlex.quote(python)} -m hpc_tools.job.restarts watch --run-dir {run} &",
            "HPC_TOOLS_WATCH=$!"]


def restart_lines(rank_python: str, python: str, run_dir: Path, folder: Path, srun_args: list[str],
                  policy: str, counts: str = "") -> list[str]:
    """In-job restarts (``cluster.restarts``) in submitit's teardown, right after its srun line: while the rank step
    failed and ``hpc_tools.job.restarts next`` decides on a new step, run submitit's task again in a new step of
    this job on the nodes it names (submitit's own command, so the task finds its pickled function and writes its
    result as the first step would); then the epilogue records the end."""
    step = shlex.join(["srun", "--unbuffered", "--open-mode=append", "--output", str(folder / "%j_%t_log.out"),
                       "--error", str(folder / "%j_%t_log.err"), *srun_args])
    decide = (f"{shlex.quote(python)} -m hpc_tools.job.restarts next --run-dir {shlex.quote(str(run_dir))} "
              f'--exit-code "$HPC_TOOLS_SRUN_EXIT" {policy}')
    watch = f"{shlex.quote(python)} -m hpc_tools.job.restarts watch --run-dir {shlex.quote(str(run_dir))} &"
    return ["HPC_TOOLS_SRUN_EXIT=$?",
            'kill "$HPC_TOOLS_WATCH" 2>/dev/null',
            f'while [ "$HPC_TOOLS_SRUN_EXIT" -ne 0 ] && HPC_TOOLS_STEP="$({decide})"; do',
            '    eval "$HPC_TOOLS_STEP"',
            "    HPC_TOOLS_SRUN_EXIT=0",
            f"    {watch}",
            "    HPC_TOOLS_WATCH=$!",
            f'    {step} --overlap "--nodelist=$HPC_TOOLS_NODELIST"{counts} {rank_python} -u -m submitit.core._submit '
            f'{shlex.quote(str(folder))} || HPC_TOOLS_SRUN_EXIT=$?',
            '    kill "$HPC_TOOLS_WATCH" 2>/dev/null',
            "done",
            "(exit $HPC_TOOLS_SRUN_EXIT)"]  # $? for the epilogue lines below: the last step's status


def epilogue_lines(python: str, run_dir: Path, requeue: bool = False) -> list[str]:
    """submitit's teardown: right after its srun line (only blank and comment lines between, so ``$?`` is srun's
    status), record how the ranks ended (``hpc_tools.job.epilogue``); with ``requeue`` (``cluster.requeue``) the
    time-limit stop's requeue on the batch host (``hpc_tools.job.requeue``: a rank in an image has no ``scontrol``),
    last since it ends the shell; then end with srun's status."""
    python, run = shlex.quote(python), shlex.quote(str(run_dir))
    lines = ["HPC_TOOLS_SRUN_EXIT=$?",
             f'{python} -m hpc_tools.job.epilogue --run-dir {run} --exit-code "$HPC_TOOLS_SRUN_EXIT" || true']
    if requeue:
        lines.append(f"{python} -m hpc_tools.job.requeue --run-dir {run} || true")
    return [*lines, 'exit "$HPC_TOOLS_SRUN_EXIT"']


def rank_task(run_dir: str) -> int:
    """What each submitit task runs (a module-level function, so submitit pickles it by reference). A rank that ends
    with a non-zero code without raising (preflight leaving its node out: ``leave_out.EXIT_CODE``; a strict
    preflight failure) exits the task with that code, as the rendered script's rank program does: submitit would
    record a returned code as a success, srun would exit 0, and the restart loop in the teardown would not run."""
    from hpc_tools.runtime.rank import run_rank

    code = run_rank(run_dir)
    if code:
        raise SystemExit(code)  # a BaseException: submitit's process_job lets it end the task with this code
    return code


def preflight_task(run_dir: str) -> int:
    """What each submitit task of ``hpc_tools preflight --executor slurm`` runs: the checks, no training."""
    from hpc_tools.runtime.rank import preflight_only

    return preflight_only(run_dir)


def submit_preflight(run: RunFolder, recipe: Recipe):
    """Submit ``hpc_tools preflight``'s job: the recipe's resources and set-up, every rank running the checks only
    (no in-job restarts: a check that fails is the finding). Returns the submitit job."""
    folder = run.path / "submitit"
    once = recipe.model_copy(update={"cluster": recipe.cluster.model_copy(update={"restarts": 0})})
    job = make_executor(once, folder, run_dir=run.path).submit(preflight_task, str(run.path))
    run.update(event="submitted", executor="slurm", job_id=str(job.job_id), submitted=now_iso(), state="PENDING",
               log_glob=str(folder / f"{job.job_id}_*_log.*"))
    return job


def submit_run(run: RunFolder, recipe: Recipe, exclude: str | None = None, env: dict[str, str] | None = None,
               event: str = "submitted", **fields):
    """Submit one run (a new one, or, from ``hpc_tools resume``, an ended one in its own folder); records the job id
    and log locations in its manifest with ``event`` and ``fields`` (state PENDING unless ``fields`` names one).
    Returns the submitit job (a launcher with a driver of its own, Ray: the rendered script's, ``submit_script``)."""
    if launchers.of(recipe.cluster.launcher).driver:
        return submit_script(run, recipe, exclude, env, event, **fields)
    folder = run.path / "submitit"
    job = make_executor(recipe, folder, exclude, env, run_dir=run.path).submit(rank_task, str(run.path))
    record = {"state": "PENDING", **fields}
    if record["state"] is None:  # the caller set the state before submitting
        del record["state"]
    run.update(event=event, executor="slurm", job_id=str(job.job_id), submitted=now_iso(),
               log_glob=str(folder / f"{job.job_id}_*_log.*"), **record)
    return job


@dataclass(frozen=True, slots=True)
class ScriptJob:
    """A job submitted as the run's rendered batch script (what ``submit`` reads of a submitit job: its id)."""

    job_id: str


def submit_script(run: RunFolder, recipe: Recipe, exclude: str | None = None, env: dict[str, str] | None = None,
                  event: str = "submitted", **fields) -> ScriptJob:
    """A launcher whose driver starts every rank (``render.launchers``' ``driver``; Ray): the run's rendered batch
    script (``job.sbatch``: for Ray a Ray cluster over the allocation, the driver on the batch host; docs/ray.md)
    submitted with sbatch into the run's folder, since submitit starts one task per rank, which the driver does here
    instead."""
    options = [f"--exclude={exclude}"] if exclude else []
    job_id = sbatch_script(run.path / "job.sbatch", {"HPC_TOOLS_RUN_DIR": str(run.path), **(env or {})}, options,
                           cwd=run.path)
    record = {"state": "PENDING", **fields}
    if record["state"] is None:
        del record["state"]
    run.update(event=event, executor="slurm", launcher=recipe.cluster.launcher, job_id=job_id, submitted=now_iso(),
               log_glob=str(run.path / f"{recipe.name}-{job_id}.out"), **record)
    return ScriptJob(job_id)


def sbatch_script(script: Path, env: dict[str, str], options: list[str] = (), cwd: Path | None = None,
                  what: str = "", fix: str = "") -> str:
    """``sbatch --parsable OPTIONS SCRIPT`` with ``env`` added to this process's environment (sbatch exports it to
    the job, and Slurm keeps it for a requeue); returns the job id. Raises ``slurm_client.SlurmError`` in one line
    (``what``: the job in words; ``fix``: what to do when Slurm refuses it)."""
    return slurm_client.sbatch(script, env, options, cwd=cwd, what=what, fix=fix)


def submit_array(runs: list[RunFolder], recipe: Recipe, exclude: str | None = None,
                 parallelism: int | None = None) -> list:
    """Submit runs that share Slurm resources as one job array (one array task per run), off the ``exclude`` nodes,
    at most ``parallelism`` tasks running at once (``--array=0-N%K``; None: no throttle of ours: submitit would
    apply its default %256 without saying so)."""
    folder = runs[0].path.parent / f".array-{runs[0].run_id}"
    # The epilogue finds its run by job id.
    executor = make_executor(recipe, folder, exclude=exclude, run_dir=runs[0].path.parent)
    executor.update_parameters(array_parallelism=parallelism or len(runs))
    jobs = executor.map_array(rank_task, [str(r.path) for r in runs])
    for run, job in zip(runs, jobs):
        run.update(event="submitted", state="PENDING", executor="slurm", job_id=str(job.job_id), submitted=now_iso(),
                   log_glob=str(folder / f"{job.job_id}_*_log.*"))
    return jobs


def cancel(job_id: str) -> None:
    """scancel the job (its state is read back through ``hpc_tools.runstate``); SlurmError in one line."""
    slurm_client.scancel(job_id)
