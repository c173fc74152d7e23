"""The batch scripts beside training's: ``serve``'s job and ``eval``'s job array, rendered from the same spec as a
training job (``SlurmSpec``: the recipe's partition, account, qos, constraint, reservation, time limit and extra
``#SBATCH`` lines; ``envsetup``: the recipe's set-up lines and container), with the resources of their own (one
node, one task). The program each runs is its command's (``serving/job.py``, ``evaluate/evaljob.py``); every
``#SBATCH`` line of the package is written under ``render/`` (tests/unit/test_slurm_client.py greps for it).
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from hpc_tools.recipe.cluster import ClusterConfig
from hpc_tools.render.envsetup import checked_setup_lines, is_pyxis, launch_prefix, setup_lines, srun_args
from hpc_tools.render.slurm_params import SlurmSpec


def batch_script(comment: str, spec: SlurmSpec, output: str, body: list[str], setup: list[str] = (),
                 directives: list[str] = ()) -> str:
    """``#!/bin/bash``, a comment line, the spec's ``#SBATCH`` lines (``output``: the batch log's pattern) and
    ``directives`` (``--array=...``), then the set-up lines and the program."""
    lines = ["#!/bin/bash", f"# {comment}", *spec.sbatch_lines(output=output),
             *(f"#SBATCH {d}" for d in directives), *setup, *body]
    return "\n".join(lines) + "\n"


def one_node_spec(cluster: ClusterConfig, name: str, gpus: int | None, **changes) -> SlurmSpec:
    """One node, one task, ``gpus`` GPUs (None: none asked), with the cluster section's partition, account, qos,
    constraint, reservation, CPUs per task, memory, time limit and extra lines; no requeue, no stop signal (neither
    job checkpoints), no spares or switches. ``changes``: other fields (``time_limit``, ``partition``...)."""
    spec = SlurmSpec(job_name=name, nodes=1, ntasks_per_node=1, gpus_per_node=gpus or None,
                     cpus_per_task=cluster.cpus_per_task, mem_gb=cluster.mem_gb, time_limit=cluster.time_limit,
                     time_min=1, partition=cluster.partition, account=cluster.account, qos=cluster.qos,
                     constraint=cluster.constraint, reservation=cluster.reservation, exclusive=False,
                     signal_delay_s=cluster.signal_delay_s, requeue=False, extra=tuple(cluster.sbatch_extra),
                     stop_signal=False)
    return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not None})


def container_python(cluster: ClusterConfig, python: str) -> str:
    """``python`` inside the cluster's apptainer container when it has one (shell words)."""
    return shlex.join(launch_prefix(cluster) + [python])


# -- eval: a job array over a run's checkpoints ------------------------------------------------------------------
def render_eval_array(recipe, run_dir, iterations: list[int], eval_args: list[str], gpus: int = 1) -> str:
    """The array script: ``--array=0-(N-1)``, task i evaluates ``iterations[i]`` with the local executor inside the
    allocation (one node, one task; ``gpus`` of the node's GPUs when the recipe has GPUs). ``eval_args`` are the
    command's own options (tasks, limit, include path, batch size), already absolute where they are paths."""
    c = recipe.cluster
    spec = one_node_spec(c, f"{recipe.name}-eval", gpus if c.uses_gpus else None)
    logs = run_dir / "eval" / "logs"
    body = [f"ITERATIONS=({' '.join(str(i) for i in iterations)})",
            'ITERATION="${ITERATIONS[$SLURM_ARRAY_TASK_ID]}"',
            f"exec {container_python(c, c.python)} -m hpc_tools eval {shlex.quote(str(run_dir))} "
            f"--iterations \"$ITERATION\" --executor local {shlex.join(eval_args)}"]
    return batch_script(f"hpc_tools eval: {len(iterations)} checkpoint(s) of {run_dir.name}, one array task each",
                        spec, str(logs / "%x-%A_%a.out"), body, setup_lines(c),
                        [f"--array=0-{len(iterations) - 1}"])


# -- serve: the server on a node of its own -----------------------------------------------------------------------
def render_serve(cluster: ClusterConfig, run_id: str, run_dir, comment: str, body: list[str], minutes: int,
                 partition: str | None = None, gpus: int = 0, mem_gb: float | None = None,
                 slurm: bool = True) -> str:
    """The serving job's script: a node of its own (``--exclusive``) for ``minutes`` (``mem_gb``: --mem, rounded up
    to whole GB), with the cluster section's account, qos, constraint, reservation, partition (``partition``
    overrides it), extra lines and, for a Slurm job
    (``slurm``), its checked set-up lines; ``body`` is the server's program (``serving.job``). A local start runs
    the same file with bash (the ``#SBATCH`` lines are comments there) and no set-up: the recipe's environment is
    the cluster's."""
    name = "serve-" + re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:60]
    mem = max(1, -(-int(mem_gb * 1000) // 1000)) if mem_gb is not None else None  # whole GB, rounded up
    spec = one_node_spec(cluster, name, gpus, time_limit=f"{minutes // 60}:{minutes % 60:02d}:00",
                         partition=partition, exclusive=True)
    # The node is the job's (--exclusive): the training ranks' CPUs and memory per node are not the server's.
    spec = dataclasses.replace(spec, cpus_per_task=1, mem_gb=mem)
    setup = checked_setup_lines(cluster, shlex.quote(str(run_dir))) if slurm else []
    return batch_script(comment, spec, f"{run_dir}/serve/serve-%j.out", body, setup)


def serve_container(cluster: ClusterConfig, repo: str, run_dir: str) -> list[str]:
    """The words before the server's interpreter in a Slurm serving job: apptainer's ``exec`` over the recipe's
    image (``launch_prefix``), or for pyxis a one-task step in the image (srun starts pyxis containers) with the
    repository and the run folder's parent mounted; none without a container."""
    if is_pyxis(cluster):
        return ["srun", "--ntasks=1", *srun_args(cluster, repo=repo, mount_dir=str(Path(run_dir).parent))]
    return launch_prefix(cluster)
