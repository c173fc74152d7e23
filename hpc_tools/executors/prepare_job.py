"""``data prepare --executor slurm``: the same ``prepare`` as one CPU job on the recipe's cluster, through submitit.

The job takes the recipe's cluster settings (partition, account, qos, constraint, sbatch_extra, the environment
set-up lines, an apptainer launch prefix) from the one owner of the sbatch flags (``render.slurm_params.SlurmSpec``),
reshaped for a tokenizing job: one node, one task, ``--workers`` CPUs for it, no GPUs, no requeue. The inputs are
checked here before anything is queued (``plan_outputs``: a missing input or an existing output fails at once);
paths are made absolute so the job finds them whatever its working folder. Its logs go to ``OUT/.slurm/``.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe


def prepare_spec(recipe: "Recipe", workers: int, partition: str | None, time_min: int):
    """The recipe's SlurmSpec reshaped for one tokenizing task with ``workers`` CPUs."""
    from hpc_tools.render.slurm_params import SlurmSpec

    spec = SlurmSpec.from_recipe(recipe)
    return dataclasses.replace(spec, job_name=f"{recipe.name}-prepare", nodes=1, ntasks_per_node=1,
                               gpus_per_node=None, cpus_per_task=workers, mem_gb=None, time_min=time_min,
                               time_limit=f"{time_min}", partition=partition or spec.partition, exclusive=False,
                               requeue=False)


def submit_prepare(recipe: "Recipe", inputs: list[str], out: str, *, partition: str | None, time_min: int,
                   **kwargs: Any):
    """Check the inputs, then queue ``prepare(inputs, out, **kwargs)`` as one job; returns the submitit job."""
    import submitit

    from hpc_tools.data.prepare import plan_outputs, prepare
    from hpc_tools.render.envsetup import launch_prefix, setup_lines

    plan_outputs(inputs, out, kwargs.get("text_field", "text"), kwargs.get("overwrite", False))
    inputs = [str(Path(p).expanduser().resolve()) for p in inputs]
    out_dir = Path(out).expanduser().resolve()
    tokenizer = kwargs.get("tokenizer", "byte")
    if tokenizer != "byte":
        kwargs["tokenizer"] = str(Path(tokenizer).expanduser().resolve())
    workers = int(kwargs.get("workers", 1))
    spec = prepare_spec(recipe, workers, partition, time_min)
    python = shlex.join(launch_prefix(recipe.cluster) + [recipe.cluster.python])
    executor = submitit.SlurmExecutor(folder=str(out_dir / ".slurm" / "%j"), python=python)
    params = spec.submitit_parameters()
    params.pop("signal_delay_s", None)  # a prepare job is not requeued: no stop signal to ask for
    executor.update_parameters(**params, setup=setup_lines(recipe.cluster))
    return executor.submit(_run_prepare, prepare, inputs, str(out_dir), kwargs)


def _run_prepare(prepare, inputs: list[str], out: str, kwargs: dict) -> list[dict]:
    """The job's body: prepare, and the datasets as plain dicts (picklable, printed by the CLI)."""
    return [d.as_dict() for d in prepare(inputs, out, **kwargs)]
