"""Render a recipe into a complete sbatch script (jobs/<recipe>.sbatch) that runs with plain `sbatch`."""

from __future__ import annotations

import hashlib
import shlex
from pathlib import Path

import jinja2

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.base import printable
from hpc_tools.recipe.load import dump_resolved
from hpc_tools.recipe.schema import Recipe
from hpc_tools.render.envsetup import (
    checked_setup_lines,
    host_python,
    is_pyxis,
    pyxis_cleanup_lines,
    pyxis_script_lines,
    rank_argv,
    rank_srun_args,
    restart_policy_args,
    script_python,
    step_count_args,
    step_node_args,
)
from hpc_tools.render.slurm_params import STOP_SIGNAL, SlurmSpec, time_limit_stop

_ENV = jinja2.Environment(loader=jinja2.PackageLoader("hpc_tools.render", "templates"), trim_blocks=True,
                          lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined,
                          autoescape=False)


def render_sbatch(recipe: Recipe, source: str = "a recipe") -> str:
    """The batch script for this resolved recipe; the recipe travels inside it (a quoted here-document).

    Nothing from the recipe or ``source`` (the recipe's path) reaches a line unquoted: shell words are shlex-quoted,
    #SBATCH values are validated Slurm names, and the path in the header comment has its control characters escaped
    (a newline there would start a line of its own, which bash runs)."""
    recipe_yaml = dump_resolved(recipe).rstrip("\n")
    # A quoted here-document never expands anything; its delimiter carries a hash of the text it encloses, so the
    # text cannot end it early.
    delimiter = "HPC_TOOLS_RECIPE_" + hashlib.sha256(recipe_yaml.encode()).hexdigest()[:12]
    # --label: every line of the one batch log starts with its rank ("3: ..."), which `logs --rank` filters on.
    placed = recipe.cluster.place_by_topology
    launch = shlex.join(rank_srun_args(recipe.cluster, step_nodes=not placed))
    if recipe.cluster.restarts:  # each step's nodes, decided by hpc_tools.job.restarts
        launch += " --overlap" + ("" if placed else " " + STEP_NODELIST) + step_count_args(recipe.cluster)
    if placed:  # the step's nodes and order, decided by hpc_tools.job.placement
        launch += ' "${HPC_TOOLS_PLACE[@]}"'
    launch += " --label"
    if is_pyxis(recipe.cluster):
        launch += ' "${HPC_TOOLS_CONTAINER[@]}"'
    launch += " " + shlex.join(rank_argv(recipe.cluster))
    return _ENV.get_template("job.sbatch.j2").render(
        name=recipe.name, source=printable(source), layout=ParallelLayout.from_recipe(recipe).describe(),
        sbatch_lines=SlurmSpec.from_recipe(recipe).sbatch_lines(),
        setup=checked_setup_lines(recipe.cluster, '"$RUN_DIR"'), container=pyxis_script_lines(recipe.cluster),
        container_cleanup=pyxis_cleanup_lines(recipe.cluster),
        python=script_python(recipe.cluster), host_python=host_python(recipe.cluster),
        controller=host_python(recipe.cluster) or script_python(recipe.cluster),
        policy=restart_policy_args(recipe.cluster), recipe_yaml=recipe_yaml, delimiter=delimiter,
        signal_delay_s=recipe.cluster.signal_delay_s, stop_signal=STOP_SIGNAL, launch=launch,
        restarts=recipe.cluster.restarts, elastic=recipe.cluster.elastic,
        placement=placement_lines(recipe) if placed else [],
        srun=PLACED_SRUN if placed else "srun", ray=ray_nodes_step(recipe),
        requeue=recipe.cluster.requeue and time_limit_stop(recipe.cluster))


def ray_nodes_step(recipe: Recipe) -> dict | None:
    """``cluster.launcher: ray``: the step that runs one Ray node per node of the allocation (``hpc_tools.job.
    ray_launch node``: ``ray start --block``, the head on the first node) with every CPU and GPU of the node's ranks,
    and the driver's node count; None for srun."""
    c = recipe.cluster
    if c.launcher != "ray":
        return None
    cpus = c.gpus_per_node * c.cpus_per_task
    # --ntasks too: the step would otherwise take the allocation's task count (a rank per GPU) over --ntasks-per-node
    step = ["--overlap", f"--nodes={c.nodes}", f"--ntasks={c.nodes}", "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
            "--mem=0"]
    if c.elastic:  # a failed node must not end the other nodes' Ray: Ray Train continues on them (num_workers range)
        step.append("--no-kill")
    node = ["--num-cpus", str(cpus), "--num-gpus", str(c.gpus_per_node if c.uses_gpus else 0)]
    return {"srun": shlex.join(step), "node": shlex.join(node), "nodes": c.nodes}


STEP_NODELIST = '${HPC_TOOLS_NODELIST:+"--nodelist=$HPC_TOOLS_NODELIST"}'
# The rank step's srun with the placement's hostfile in its environment only: srun takes SLURM_HOSTFILE as its node
# list whenever it is set, so an exported one would lay out the script's other steps (epilogue, clean-up) too.
PLACED_SRUN = 'env ${HPC_TOOLS_HOSTFILE:+"SLURM_HOSTFILE=$HPC_TOOLS_HOSTFILE"} srun'


def placement_lines(recipe: Recipe) -> list[str]:
    """The batch shell's placement step before a rank step (``cluster.place_by_topology``): the step's own node
    options as the default ``HPC_TOOLS_PLACE``, then ``hpc_tools.job.placement``'s lines (a hostfile in topology
    order as ``HPC_TOOLS_HOSTFILE``, srun's arbitrary distribution and the rendezvous on rank 0's node) when the
    topology lists every node."""
    c, lay = recipe.cluster, ParallelLayout.from_recipe(recipe)
    default = ([STEP_NODELIST] if c.restarts else []) + [shlex.quote(a) for a in step_node_args(c)]
    sizes = (f"tensor={lay.tensor_size},context={lay.context_size},expert={lay.expert_size},"
             f"expert_tensor={lay.expert_tensor_size},pipeline={lay.pipeline_size},data={lay.data_size}")
    controller = host_python(c) or script_python(c)
    nodes = ' ${HPC_TOOLS_NODELIST:+--nodes "$HPC_TOOLS_NODELIST"}' if c.restarts else ""
    return ["unset HPC_TOOLS_HOSTFILE",
            f"HPC_TOOLS_PLACE=({' '.join(default)})",
            f'HPC_TOOLS_PLACED="$({controller} -m hpc_tools.job.placement --run-dir "$RUN_DIR" --ranks-per-node '
            f'{lay.ranks_per_node} --sizes {sizes}{nodes})" || HPC_TOOLS_PLACED=""',
            'eval "$HPC_TOOLS_PLACED"']


def job_script_path(recipe_path: str | Path, jobs_dir: str | Path = "jobs") -> Path:
    return Path(jobs_dir) / f"{Path(recipe_path).stem}.sbatch"
