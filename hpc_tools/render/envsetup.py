"""The environment set-up a recipe names (modules, conda, venv, container, variables), as shell lines and launcher
arguments. Every user value is shell-quoted: nothing in a recipe can run as code.

Both launch paths (the rendered sbatch script and submitit's script) run ``checked_setup_lines``: a set-up line that
fails ends the job at once, naming the line in the batch log and in the run's manifest
(``hpc_tools.job.setup_failed``), instead of running the job in the wrong environment. Each line carries its own
check (``LINE || fail``) rather than relying on ``set -e``: submitit's script has no ``set -e``, and Lmod and conda
read unset variables, so neither runs under ``set -u``.
"""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the launcher table (render/launchers.py) imports this without pydantic
    from hpc_tools.recipe.cluster import ClusterConfig


def setup_lines(cluster: ClusterConfig) -> list[str]:
    s = cluster.setup
    lines = [f"module load {shlex.quote(m)}" for m in s.modules]
    if s.conda_env:  # the hook in a variable first: `eval "$(missing)"` would succeed on an empty string
        lines += ['HPC_TOOLS_CONDA_HOOK="$(conda shell.bash hook)"', 'eval "$HPC_TOOLS_CONDA_HOOK"',
                  f"conda activate {shlex.quote(s.conda_env)}"]
    if s.venv:
        lines.append(f"source {shlex.quote(s.venv.rstrip('/') + '/bin/activate')}")
    if s.container is not None and s.container.kind == "apptainer":  # the ranks start inside `apptainer exec`
        lines.append("command -v apptainer >/dev/null")
    if "OMP_NUM_THREADS" not in s.env:  # one thread pool per rank sized to its CPUs, not to the whole node
        lines.append(f"export OMP_NUM_THREADS={cluster.cpus_per_task}")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in s.env.items()]
    return lines


SETUP_FAILED = "hpc_tools_setup_failed"  # the shell function every checked set-up line calls when it fails


def checked_setup_lines(cluster: ClusterConfig, run_dir: str) -> list[str]:
    """``setup_lines`` for a batch script, each one fatal and told when it fails: a shell function that prints
    ``hpc_tools: environment set-up failed (exit N): LINE`` to the batch log, records it in the run's manifest
    (``python -m hpc_tools.job.setup_failed``) and exits 1, then every line as ``LINE || <function> $? 'LINE'``
    (``export`` lines cannot fail and stay as they are). ``run_dir`` is a shell word naming the run folder
    (``"$RUN_DIR"`` or a quoted path)."""
    plain = setup_lines(cluster)
    if all(line.startswith("export ") for line in plain):
        return plain
    python = shlex.quote(cluster.python)
    lines = [f"{SETUP_FAILED}() {{  # $1: the exit status of the line that failed, $2: the line",
             '    echo "hpc_tools: environment set-up failed (exit $1): $2" >&2',
             f'    {python} -m hpc_tools.job.setup_failed --run-dir {run_dir} --exit-code "$1" --line "$2" '
             '--script "$0" \\',
             '        || echo "hpc_tools: could not record the set-up failure in the run folder" >&2',
             "    exit 1",
             "}"]
    for line in plain:
        lines.append(line if line.startswith("export ") else f"{line} || {SETUP_FAILED} $? {shlex.quote(line)}")
    return lines


def rank_srun_args(cluster: ClusterConfig, step_nodes: bool = True) -> list[str]:
    """srun options of the rank step on both launch paths (before any container options).

    ``--cpus-per-task``: Slurm 22.05's srun no longer inherits it from sbatch (each rank would get one CPU while its
    OpenMP pool is sized to ``cluster.cpus_per_task``). ``--mem=0``: for a job step it means "all the job's memory on
    each node" (srun(1)), never more than the job holds, so a site's DefMemPerCPU cannot shrink a step below the job.
    ``--kill-on-bad-exit``: one failed rank ends the step. With ``cluster.spare_nodes`` the allocation is larger than
    the layout: the step names its own node and task counts (srun would otherwise start a rank on every node);
    ``step_nodes=False`` leaves them out (``step_node_args``: the rendered script's placement step decides them)."""
    step = step_node_args(cluster) if step_nodes else []
    return ["--kill-on-bad-exit=1", f"--cpus-per-task={cluster.cpus_per_task}", "--mem=0", *step]


def step_node_args(cluster: ClusterConfig) -> list[str]:
    """The rank step's node and task counts when the job holds spares (else none: the step takes the allocation)."""
    return [f"--nodes={cluster.nodes}", f"--ntasks={cluster.nodes * cluster.gpus_per_node}"] \
        if cluster.spare_nodes else []


# An elastic job's rank step (``cluster.min_nodes``): the node and task counts the restart controller decided
# (``hpc_tools.job.restarts`` exports them for every step; fewer after a node is lost), after any fixed ones.
STEP_COUNTS = '${HPC_TOOLS_STEP_NODES:+"--nodes=$HPC_TOOLS_STEP_NODES" "--ntasks=$HPC_TOOLS_STEP_TASKS"}'


def step_count_args(cluster: ClusterConfig) -> str:
    """Shell text (unquoted: it expands the controller's exports) of the rank step's counts of an elastic job."""
    return f" {STEP_COUNTS}" if cluster.elastic else ""


def is_pyxis(cluster: ClusterConfig) -> bool:
    c = cluster.setup.container
    return c is not None and c.kind == "pyxis"


def srun_args(cluster: ClusterConfig, repo: str | None = None, mount_dir: str | None = None) -> list[str]:
    """srun's pyxis options (pyxis containers are started by srun itself): the image, the repository and the run
    folder's parent mounted at their own paths (plus the recipe's mounts), and the repository as the working folder,
    so ``python -m hpc_tools...`` finds the package inside a stock image. Empty without a pyxis container."""
    if not is_pyxis(cluster):
        return []
    c = cluster.setup.container
    args = [f"--container-image={c.image}"]
    mounts = [f"{p}:{p}" for p in (repo, mount_dir) if p] + list(c.mounts)
    if mounts:
        args.append(f"--container-mounts={','.join(mounts)}")
    if repo:
        args.append(f"--container-workdir={repo}")
    return args


CONTAINER_NAME = "hpc_tools_${SLURM_JOB_ID}"
"""pyxis ``--container-name`` of a rendered job: one per job, so the image is imported once per node for all of the
job's steps (unnamed, every step imports it again on every node) and no other job's container is ever joined."""


def pyxis_script_lines(cluster: ClusterConfig) -> list[str]:
    """For the rendered batch script with a pyxis container: two bash arrays of srun's container options, both naming
    one container (``CONTAINER_NAME``) with the repository (``$HPC_TOOLS_REPO``, default the submit folder) as the
    working folder and mounted with the runs folder (made first: pyxis refuses a mount source that does not exist):
    ``HPC_TOOLS_CONTAINER`` for the rank step, which spans every node, and ``HPC_TOOLS_BATCH_CONTAINER`` for the
    steps that run on the batch host (``script_python``), which also mounts the script itself (``$0``, read by the
    open_run step): Slurm spools it on the batch host only, so the rank step must not mount it. Empty otherwise."""
    if not is_pyxis(cluster):
        return []
    c = cluster.setup.container
    user = shlex.quote("," + ",".join(c.mounts)) if c.mounts else ""
    image = shlex.quote("--container-image=" + c.image)
    mounts = '"$HPC_TOOLS_REPO:$HPC_TOOLS_REPO,${RUN_DIR%/*}:${RUN_DIR%/*}"' + user
    return ['HPC_TOOLS_REPO="${HPC_TOOLS_REPO:-$SLURM_SUBMIT_DIR}"',
            'mkdir -p "${RUN_DIR%/*}"',
            f"HPC_TOOLS_MOUNTS={mounts}",
            f'HPC_TOOLS_CONTAINER=({image} "--container-name={CONTAINER_NAME}" '
            '"--container-mounts=$HPC_TOOLS_MOUNTS" "--container-workdir=$HPC_TOOLS_REPO")',
            f'HPC_TOOLS_BATCH_CONTAINER=({image} "--container-name={CONTAINER_NAME}" '
            '"--container-mounts=$HPC_TOOLS_MOUNTS,$0:$0:ro" "--container-workdir=$HPC_TOOLS_REPO")']


def pyxis_cleanup_lines(cluster: ClusterConfig) -> list[str]:
    """After the job's last container step: remove the named container on every node. pyxis keeps named containers
    after the job unless the site sets ``container_scope=job`` (its default is global, where the container is
    ``pyxis_<name>`` and stays, tens of GB per node); with job scope pyxis removes its own (``pyxis_<job>_<name>``)
    and this finds nothing. Never fails the job. Empty without a pyxis container."""
    if not is_pyxis(cluster):
        return []
    return ['srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
            f'enroot remove --force "pyxis_{CONTAINER_NAME}" >/dev/null 2>&1 || true']


def script_python(cluster: ClusterConfig) -> str:
    """The shell words that run the batch script's own hpc_tools steps (open_run, rendezvous, epilogue): the recipe's
    interpreter, inside the pyxis container when there is one (one task on the batch host, where the script is), so a
    host without hpc_tools or its packages can run the job."""
    python = shlex.quote(cluster.python)
    if is_pyxis(cluster):
        return f'srun --nodes=1 --ntasks=1 --nodelist="$SLURMD_NODENAME" "${{HPC_TOOLS_BATCH_CONTAINER[@]}}" {python}'
    return python


HOST_PYTHON_ENV = "HPC_TOOLS_HOST_PYTHON"  # the batch host's interpreter for the steps that need Slurm's client


def host_python(cluster: ClusterConfig) -> str | None:
    """The shell words that run a batch script's steps that call Slurm's client (the restart controller, the batch
    log's lookup) on the batch host itself, for a job with a pyxis container: an image has no ``scontrol``, ``srun``,
    ``squeue`` or ``scancel`` (no Slurm client, configuration or munge socket), so these steps cannot run inside it.
    The host's ``python3`` (``$HPC_TOOLS_HOST_PYTHON`` names another) with the repository on ``PYTHONPATH``: these
    steps import the standard library and ``hpc_tools``' job side only (tests/unit/test_restarts_pyxis.py checks it).
    None without a pyxis container: the recipe's interpreter runs on the host already."""
    if not is_pyxis(cluster):
        return None
    return f'PYTHONPATH="$HPC_TOOLS_REPO${{PYTHONPATH:+:$PYTHONPATH}}" "${{{HOST_PYTHON_ENV}:-python3}}"'


def restart_policy_args(cluster: ClusterConfig) -> str:
    """The restart controller's options (``hpc_tools.job.restarts``' ``Policy``): the recipe's ``cluster.nodes``,
    ``cluster.restarts`` and ``cluster.requeue``, so it reads no recipe (no pydantic or yaml on a batch host)."""
    elastic = f" --min-nodes {cluster.fewest_nodes} --ranks-per-node {cluster.gpus_per_node}" if cluster.elastic else ""
    return (f"--nodes {cluster.nodes} --budget {cluster.restarts} {'--requeue' if cluster.requeue else '--no-requeue'}"
            + elastic)


def launch_prefix(cluster: ClusterConfig) -> list[str]:
    """Words placed before the Python interpreter: apptainer wraps the rank process."""
    c = cluster.setup.container
    if c is None or c.kind != "apptainer":
        return []
    words = ["apptainer", "exec"] + (["--nv"] if cluster.uses_gpus else [])
    for mount in c.mounts:
        words += ["--bind", mount]
    return words + [c.image]


def rank_argv(cluster: ClusterConfig) -> list[str]:
    """The interpreter (inside its container, if any) that runs a rank: ``<prefix> python3``."""
    return launch_prefix(cluster) + [cluster.python]
