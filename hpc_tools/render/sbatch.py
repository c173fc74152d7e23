"""Render a recipe into a complete sbatch script (jobs/<recipe>.sbatch) that runs with plain `sbatch`."""

from __future__ import annotations

import hashlib
from pathlib import Path

import jinja2

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.base import printable
from hpc_tools.recipe.load import dump_resolved
from hpc_tools.recipe.schema import Recipe
from hpc_tools.render import launchers
from hpc_tools.render.envsetup import (
    checked_setup_lines,
    host_python,
    pyxis_cleanup_lines,
    pyxis_script_lines,
    script_python,
)
from hpc_tools.render.slurm_params import SlurmSpec

_ENV = jinja2.Environment(loader=jinja2.PackageLoader("hpc_tools.render", "templates"), trim_blocks=True,
                          lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined,
                          autoescape=False)


def render_sbatch(recipe: Recipe, source: str = "a recipe") -> str:
    """The batch script for this resolved recipe; the recipe travels inside it (a quoted here-document), and its
    launcher (``cluster.launcher``, ``render.launchers``) fills the one rank-step loop.

    Nothing from the recipe or ``source`` (the recipe's path) reaches a line unquoted: shell words are shlex-quoted,
    #SBATCH values are validated Slurm names, and the path in the header comment has its control characters escaped
    (a newline there would start a line of its own, which bash runs)."""
    recipe_yaml = dump_resolved(recipe).rstrip("\n")
    # A quoted here-document never expands anything; its delimiter carries a hash of the text it encloses, so the
    # text cannot end it early.
    delimiter = "HPC_TOOLS_RECIPE_" + hashlib.sha256(recipe_yaml.encode()).hexdigest()[:12]
    c, launcher = recipe.cluster, launchers.of(recipe.cluster.launcher)
    return _ENV.get_template("job.sbatch.j2").render(
        name=recipe.name, source=printable(source), layout=ParallelLayout.from_recipe(recipe).describe(),
        sbatch_lines=SlurmSpec.from_recipe(recipe).sbatch_lines(),
        setup=checked_setup_lines(c, '"$RUN_DIR"'), container=pyxis_script_lines(c),
        container_cleanup=pyxis_cleanup_lines(c), python=script_python(c), batch_log=batch_log_lines(c),
        open_run_args=' --batch-log "$HPC_TOOLS_BATCH_LOG"' if host_python(c) else "",
        controller=host_python(c) or script_python(c), recipe_yaml=recipe_yaml, delimiter=delimiter,
        elastic=c.elastic, steps=launcher.steps(recipe), requeue=c.requeue and launcher.time_limit_stop)


def batch_log_lines(cluster) -> list[str]:
    """With a pyxis container, the batch log's path looked up on the batch host before open_run (which runs in the
    image) records it; none otherwise (open_run asks Slurm itself)."""
    host = host_python(cluster)
    if host is None:
        return []
    return ["# Slurm's client exists on this host only (an image has none): the batch log's path is looked up here, "
            "and the restart",
            "# controller runs here too, with the host's python3 and the repository's hpc_tools (standard library "
            "only).",
            f'HPC_TOOLS_BATCH_LOG="$({host} -m hpc_tools.job.batch_log)" || HPC_TOOLS_BATCH_LOG=""']


def job_script_path(recipe_path: str | Path, jobs_dir: str | Path = "jobs") -> Path:
    return Path(jobs_dir) / f"{Path(recipe_path).stem}.sbatch"
