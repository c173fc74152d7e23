"""What `submit` does, step by step: resolve -> check -> render -> run folder -> executor.

Kept apart from the CLI so that sweeps and tests take exactly the same path.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from hpc_tools.errors import RecipeError, UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.base import printable
from hpc_tools.recipe.load import dump_resolved, read_yaml, resolve
from hpc_tools.recipe.schema import Recipe
from hpc_tools.recipe.site import site_path
from hpc_tools.recipe.yamlfile import parse_yaml
from hpc_tools.registry import RunFolder, new_run_id, runs_root
from hpc_tools.render.sbatch import render_sbatch

EXECUTORS = ("auto", "slurm", "local")


@dataclass(frozen=True, slots=True)
class Plan:
    """A recipe resolved for one executor, ready to become a run."""

    recipe: Recipe
    executor: str  # "slurm" | "local"
    profile: str | None
    source: str
    note: str = ""


def choose_executor(requested: str, dry_run: bool = False,
                    local: str = "with the recipe's local profile") -> tuple[str, str]:
    """(executor, note): the one executor rule of every command that starts work (submit, sweep, preflight, resume,
    serve, eval). `auto`: no Slurm installed (no `sbatch` on PATH) -> the local executor, with a note saying so
    (``local``: how it runs locally); Slurm installed -> Slurm, and a controller that does not answer is an error in
    one line (``slurm_client.RETRY``), never a silent local run (a login node during a controller restart must not
    quietly become the job's machine). A ``dry_run`` submits nothing, so it never asks a controller: `--executor
    slurm --dry-run` works on a laptop or during an outage."""
    from hpc_tools.executors.slurm import slurm_available, slurm_installed
    from hpc_tools.slurm_client import NO_CONTROLLER, NOT_INSTALLED, RETRY, SlurmError, absent_reason, off_reason

    if requested not in EXECUTORS:
        raise UserError(f"--executor {requested} is unknown (use one of {', '.join(EXECUTORS)})")
    if requested == "local":
        return "local", ""
    if dry_run and (requested == "slurm" or slurm_installed()):
        return "slurm", ""
    if requested == "auto" and not slurm_installed():
        return "local", (f"no Slurm here ({absent_reason('sbatch')}): running locally on this machine"
                         f"{' ' + local if local else ''}; use --executor slurm to require Slurm")
    ok, why = slurm_available()
    if ok:
        return "slurm", ""
    if requested == "slurm" and off_reason():
        raise SlurmError(f"--executor slurm asks for Slurm, which {off_reason()} turns off here (unset it, or use "
                         "--executor local)", NOT_INSTALLED)
    if requested == "slurm" and not slurm_installed():
        raise SlurmError(f"no Slurm here ({why}): --executor slurm cannot run (start a cluster, e.g. `bash "
                         "environment/slurm-dev/up.sh`, or use --executor local)", NOT_INSTALLED)
    raise SlurmError(f"Slurm is installed but its controller does not answer ({why}); {RETRY}", NO_CONTROLLER)


def checked_runs_root(root: str | Path | None = None) -> Path:
    """The runs root a submission will write into (``--runs-dir``, $HPC_TOOLS_RUNS_DIR or ./runs), checked before
    anything is written: one line (UserError) when its name holds control characters (it ends up on #SBATCH lines of
    submitit's script), or when the nearest existing folder on its path is not a writable directory."""
    path = runs_root(root)
    shown = printable(str(path))
    if shown != str(path):
        raise UserError(f"runs folder {shown!r} holds control characters, which would end a line of the job script "
                        "(choose another --runs-dir)")
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"runs folder {shown}: {printable(str(probe))} is not a directory (choose another --runs-dir)")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"runs folder {shown}: {printable(str(probe))} is not writable (choose another --runs-dir)")
    return path


def plan_submission(recipe_path: str | Path, overrides: Iterable[str] = (), profile: str | None = None,
                    executor: str = "auto", check_fit: bool = True, auto: bool = False, dry_run: bool = False) -> Plan:
    """Resolve and check a recipe for the executor that will run it. Raises RecipeError/UserError; writes nothing.

    With ``auto`` the planner's search picks the layout (TP/PP/VPP/DP, micro batch, recompute, ZeRO / distributed
    optimizer) for the recipe's cluster; its choice is applied as overrides on top of the user's. A ``dry_run``
    never asks Slurm's controller (``choose_executor``).
    """
    raw = read_yaml(recipe_path)
    chosen, note = choose_executor(executor, dry_run)
    if profile is None and chosen == "local" and raw.get("local") is not None:
        profile = "local"
    recipe = resolve(raw, overrides, profile, str(recipe_path))
    if auto:
        from hpc_tools.planner import auto_configure

        recipe, chosen_overrides, _ = auto_configure(recipe)
        note = "; ".join(x for x in (note, "planner chose: " + " ".join(chosen_overrides)) if x)
    if check_fit:
        violations = fit_violations(recipe)
        if violations:
            raise RecipeError(violations, str(recipe_path))
        from hpc_tools.world import world_violations  # files it names; the live cluster (not for a dry run)

        violations = world_violations(recipe, slurm=chosen == "slurm" and not dry_run)
        if violations:
            raise RecipeError(violations, str(recipe_path))
    return Plan(recipe=recipe, executor=chosen, profile=profile, source=str(recipe_path), note=note)


def fit_violations(recipe: Recipe) -> list:
    """The planner's memory-fit verdict (empty when it fits, or when no planner is installed)."""
    try:
        from hpc_tools.planner import fit_violations as planner_fit
    except ImportError:
        return []
    return planner_fit(recipe)


def new_run(recipe: Recipe, root: str | Path | None = None, executor: str = "local", source: str = "recipe",
                extra_manifest: dict | None = None) -> RunFolder:
    """A new run folder holding the resolved recipe (round-trip checked), the rendered script and a manifest."""
    text = dump_resolved(recipe)
    layout = ParallelLayout.from_recipe(recipe)
    site = site_path()  # the site file whose defaults the recipe took (it is already merged into `text`)
    manifest = {"name": recipe.name, "executor": executor, "source": source, "layout": layout.describe(),
                "world_size": layout.world_size, "backend": recipe.backend.kind, "site_file": site and str(site),
                "preflight_expected_busbw_gbps": preflight_expectation(recipe), **(extra_manifest or {})}
    run = RunFolder.create(runs_root(root), new_run_id(recipe.name), text, render_sbatch(recipe, source), manifest,
                           check_recipe=lambda t: dump_resolved(resolve(parse_yaml(t), layered=False)),
                           mode=recipe.cluster.run_dir_mode_bits)
    if recipe.cluster.elastic:  # the layouts on fewer nodes (docs/elastic.md), for every
        from hpc_tools.planner.elastic import plan_elastic, write  # launcher (the rendered script writes its own too)

        write(run.path, plan_elastic(recipe))
    return run


def preflight_expectation(recipe: Recipe) -> dict | None:
    """The bus bandwidth (GB/s) the planner expects of the recipe's links, for preflight to judge the job's
    collectives by (``hpc_tools.runtime.preflight``, which may not import the planner): ``inter`` and ``intra`` node
    and their ``source``; None for CPU ranks or a GPU the planner's table lacks (without the recipe's overrides)."""
    if not recipe.cluster.uses_gpus:
        return None
    try:
        from hpc_tools.planner.hardware import hardware_for
    except ImportError:
        return None
    hw = hardware_for(recipe.cluster, recipe.training.precision, need_peak=False)
    if hw.sources.get("inter_node_bw_gbps") == "assumed":
        return None
    return {"inter": hw.inter_node_bw / 1e9, "intra": hw.intra_node_bw / 1e9,
            "source": "planner/hardware.py" if hw.sources.get("inter_node_bw_gbps") == "table" else "the recipe"}


def launch(plan: Plan, root: str | Path | None = None, echo=None) -> tuple[RunFolder, object]:
    """Make the run folder and start the job: (run, submitit job) on Slurm, (run, exit code) locally."""
    run = new_run(plan.recipe, root, plan.executor, plan.source, {"profile": plan.profile})
    if plan.executor == "slurm":
        from hpc_tools.executors.slurm import submit_run

        try:
            return run, submit_run(run, plan.recipe)
        except Exception as exc:  # sbatch refused: leave no run folder behind for a job that never existed
            shutil.rmtree(run.path, ignore_errors=True)
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise UserError(f"Slurm refused the job: {message} (check the recipe's cluster section against "
                            f"`sinfo`; `sbatch --test-only` on the rendered script shows the same error)") from None
    from hpc_tools.executors.local import run_local

    return run, run_local(run, ParallelLayout.from_recipe(plan.recipe).world_size, echo=echo)
