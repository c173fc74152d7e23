"""The environment set-up a recipe names (modules, conda, venv, container, variables), as shell lines and launcher
arguments. Every user value is shell-quoted: nothing in a recipe can run as code.

Both launch paths (the rendered sbatch script and submitit's script) run ``checked_setup_lines``: a set-up line that
fails ends the job at once, naming the line in the batch log and in the run's manifest
(``hpc_tools.runtime.setup_failed``), instead of running the job in the wrong environment. Each line carries its own
check (``LINE || fail``) rather than relying on ``set -e``: submitit's script has no ``set -e``, and Lmod and conda
read unset variables, so neither runs under ``set -u``.
"""

from __future__ import annotations

import shlex

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
    (``python -m hpc_tools.runtime.setup_failed``) and exits 1, then every line as ``LINE || <function> $? 'LINE'``
    (``export`` lines cannot fail and stay as they are). ``run_dir`` is a shell word naming the run folder
    (``"$RUN_DIR"`` or a quoted path)."""
    plain = setup_lines(cluster)
    if all(line.startswith("export ") for line in plain):
        return plain
    python = shlex.quote(cluster.python)
    lines = [f"{SETUP_FAILED}() {{  # $1: the exit status of the line that failed, $2: the line",
             '    echo "hpc_tools: environment set-up failed (exit $1): $2" >&2',
             f'    {python} -m hpc_tools.runtime.setup_failed --run-dir {run_dir} --exit-code "$1" --line "$2" '
             '--script "$0" \\',
             '        || echo "hpc_tools: could not record the set-up failure in the run folder" >&2',
             "    exit 1",
             "}"]
    for line in plain:
        lines.append(line if line.startswith("export ") else f"{line} || {SETUP_FAILED} $? {shlex.quote(line)}")
    return lines


def srun_args(cluster: ClusterConfig) -> list[str]:
    """Extra srun arguments: pyxis containers are started by srun itself."""
    c = cluster.setup.container
    if c is None or c.kind != "pyxis":
        return []
    args = [f"--container-image={c.image}"]
    if c.mounts:
        args.append(f"--container-mounts={','.join(c.mounts)}")
    return args


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
