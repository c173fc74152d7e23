"""The environment set-up a recipe names (modules, conda, venv, container, variables), as shell lines and launcher
arguments. Every user value is shell-quoted: nothing in a recipe can run as code.
"""

from __future__ import annotations

import shlex

from hpc_tools.recipe.cluster import ClusterConfig


def setup_lines(cluster: ClusterConfig) -> list[str]:
    s = cluster.setup
    lines = [f"module load {shlex.quote(m)}" for m in s.modules]
    if s.conda_env:
        lines += ['eval "$(conda shell.bash hook)"', f"conda activate {shlex.quote(s.conda_env)}"]
    if s.venv:
        lines.append(f"source {shlex.quote(s.venv.rstrip('/') + '/bin/activate')}")
    if "OMP_NUM_THREADS" not in s.env:  # one thread pool per rank sized to its CPUs, not to the whole node
        lines.append(f"export OMP_NUM_THREADS={cluster.cpus_per_task}")
    lines += [f"export {name}={shlex.quote(value)}" for name, value in s.env.items()]
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
