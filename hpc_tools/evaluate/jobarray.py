"""Several checkpoints of one run on Slurm: one job array, a task per checkpoint, each running ``eval`` on its own
iteration with the local executor inside the allocation (one node, one task; when the recipe's cluster has GPUs,
as many of the node's GPUs as hold the model in the run's precision). The recipe's cluster settings (partition,
account, qos, constraint, sbatch_extra, the environment set-up lines, an apptainer prefix) come from their one owner,
``render.slurm_params.SlurmSpec`` and ``render.envsetup``.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from hpc_tools.render.envsetup import launch_prefix, setup_lines
from hpc_tools.render.slurm_params import SlurmSpec


def eval_spec(recipe, gpus: int = 1) -> SlurmSpec:
    """One node, one task, ``gpus`` GPUs (those that hold the model: ``evaljob.array_gpus``) when the recipe has
    GPUs."""
    spec = SlurmSpec.from_recipe(recipe)
    return dataclasses.replace(spec, job_name=f"{recipe.name}-eval", nodes=1, spare_nodes=0, ntasks_per_node=1,
                               gpus_per_node=gpus if spec.gpus_per_node else None, exclusive=False, requeue=False,
                               switches=None, switch_wait_min=None)


def render_array(recipe, run_dir: Path, iterations: list[int], eval_args: list[str], gpus: int = 1) -> str:
    """The array script: ``--array=0-(N-1)``, task i evaluates ``iterations[i]``. ``eval_args`` are the command's
    own options (tasks, limit, include path, batch size), already absolute where they are paths."""
    spec = eval_spec(recipe, gpus)
    logs = run_dir / "eval" / "logs"
    lines = ["#!/bin/bash", f"# hpc_tools eval: {len(iterations)} checkpoint(s) of {run_dir.name}, one array task "
             "each", *spec.sbatch_lines(output=str(logs / "%x-%A_%a.out"))]
    lines.append(f"#SBATCH --array=0-{len(iterations) - 1}")
    python = shlex.join(launch_prefix(recipe.cluster) + [recipe.cluster.python])
    lines += setup_lines(recipe.cluster)
    lines += [f"ITERATIONS=({' '.join(str(i) for i in iterations)})",
              'ITERATION="${ITERATIONS[$SLURM_ARRAY_TASK_ID]}"',
              f"exec {python} -m hpc_tools eval {shlex.quote(str(run_dir))} --iterations \"$ITERATION\" "
              f"--executor local {shlex.join(eval_args)}"]
    return "\n".join(lines) + "\n"
