"""Creating a sweep's runs, submitting them (Slurm job arrays per resource shape, or locally one after another),
refreshing each cell's status, and resubmitting failed cells.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from hpc_tools.errors import UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_resolved
from hpc_tools.recipe.schema import Recipe
from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.runstate import FAILURE_STATUSES, READER, SlurmJob, Verdict, classify
from hpc_tools.runstate import refresh as refresh_run
from hpc_tools.runtime.process_end import pid_alive
from hpc_tools.sweep.folder import SweepFolder
from hpc_tools.sweep.grid import SweepPlan
from hpc_tools.sweep.limits import SlurmLimits
from hpc_tools.sweep.submit import resource_key, slurm_groups, submission_group, submit_due  # noqa: F401 - re-exported

Say = Callable[[str], None]


def create_sweep(plan: SweepPlan, source: str, executor: str, root: str | Path | None) -> SweepFolder:
    """The sweep folder with one run folder per valid cell x repeat, all in state CREATED."""
    from hpc_tools.submission import new_run

    data = {"name": plan.name, "source": source, "profile": plan.profile, "base_overrides": plan.base_overrides,
            "executor": executor, "grid": plan.config.grid, "repeats": plan.config.repeats,
            "scaling": plan.config.scaling, "max_parallel": plan.config.max_parallel, "cells": [],
            "invalid": [{"cell": c.index, "label": c.label(), "params": c.params, "overrides": c.overrides,
                         "reasons": c.reasons} for c in plan.invalid]}
    folder = SweepFolder.create(root, plan.name, data)
    entries = []
    slurm = executor == "slurm"
    for cell in plan.valid:
        for repeat in range(plan.config.repeats):
            run = new_run(cell.recipe, folder.path, executor, source,
                              {"profile": plan.profile, "sweep": folder.sweep_id, "cell": cell.index, "repeat": repeat,
                               "overrides": plan.base_overrides + cell.overrides})
            entries.append({"id": f"c{cell.index:03d}-r{repeat}", "cell": cell.index, "repeat": repeat,
                            "label": cell.label(), "params": cell.params, "overrides": cell.overrides,
                            "run_dir": run.run_id, "run_id": run.run_id, "job_id": None, "status": "pending",
                            "attempts": [], **({"group": submission_group(cell.recipe)} if slurm else {})})
    with folder.edit() as d:
        d["cells"] = entries
    return folder


def _recipe_of(run: RunFolder) -> Recipe:
    return load_resolved(run.recipe_path)


def submit_cells(folder: SweepFolder, cell_ids: list[str], executor: str, say: Say, exclude: str | None = None,
                 limits: SlurmLimits | None = None) -> None:
    """Submit the given cells (created, not yet submitted). On Slurm: cells with equal resources share job arrays,
    as many as Slurm's limits and ``sweep.max_parallel`` allow now, the rest when earlier ones end
    (``hpc_tools.sweep.submit``); ``exclude``: Slurm nodes the jobs must not run on (sbatch --exclude). Locally: one
    after another."""
    if executor == "slurm":
        with folder.edit() as data:  # kept with the cells: they may go in later, from `sweep status`
            for c in data["cells"]:
                if c["id"] in cell_ids:
                    c["exclude"] = exclude
        submit_due(folder, say, limits)
        return
    cells = [c for c in folder.read()["cells"] if c["id"] in cell_ids]
    runs = {c["id"]: RunFolder(folder.path / c["run_dir"]) for c in cells}
    recipes = {cid: _recipe_of(run) for cid, run in runs.items()}
    _run_local(folder, cells, runs, recipes, say)


def _run_local(folder, cells, runs, recipes, say: Say) -> None:
    from hpc_tools.executors.local import run_local

    with folder.edit() as data:
        data["local_pid"] = os.getpid()  # `sweep status` tells an interrupted local sweep from a live one
    for c in cells:
        cid = c["id"]
        folder.update_cell(cid, status="running", started=now_iso())
        world = ParallelLayout.from_recipe(recipes[cid]).world_size
        say(f"[{cid}] {c['label']}: {world} local rank(s) -> {runs[cid].path}")
        code = run_local(runs[cid], world)
        verdict = classify_run(runs[cid], None, None)
        folder.update_cell(cid, status=verdict.status, reason=verdict.reason, exit_code=code, ended=now_iso())
        why = "" if verdict.status == "completed" else f": {verdict.reason}"
        say(f"[{cid}] {verdict.status} (exit {code}){why}")


def classify_run(run: RunFolder | None, job: SlurmJob | None, local_pid: int | None, executor: str = "local",
                 manifest: dict | None = None) -> Verdict:
    """One cell's status and reason: the run's classification (``hpc_tools.runstate.classify``), except that a local
    cell still running after its sweep process died has failed: nobody will ever finish its ranks."""
    verdict = classify(run, job, manifest)
    if verdict.status == "running" and executor == "local" and local_pid is not None and not pid_alive(local_pid):
        return Verdict("failed", f"the local sweep process {local_pid} died while this cell ran")
    return verdict


def refresh(folder: SweepFolder) -> dict[str, Any]:
    """Re-classify every cell (one sacct call for all job ids, merged into each run's manifest) and store the
    statuses and reasons in sweep.json."""
    data = folder.read()
    ids = [str(c["job_id"]) for c in data["cells"] if c.get("job_id")] if data.get("executor") == "slurm" else []
    # An array task cancelled before it started is unknown to `sacct -j 49_6`; its array's line `49_[6-9%4]`
    # (asked with the array's id) names it, so that the cell ends instead of staying pending for ever.
    jobs = READER.jobs(ids + sorted({i.split("_")[0] for i in ids if "_" in i})) if ids else {}
    with folder.edit() as data:
        for c in data["cells"]:
            run = RunFolder(folder.path / c["run_dir"]) if c.get("run_dir") else None
            job = jobs.get(str(c.get("job_id")))
            manifest = refresh_run(run, job) if run is not None and run.exists() and job else None
            verdict = classify_run(run, job, data.get("local_pid"), data.get("executor", "local"), manifest)
            # Slurm's own state beside the verdict: a cell's run records its end a moment before its job ends, and
            # the throttle counts the job (hpc_tools.sweep.submit.live_arrays)
            c.update(status=verdict.status, reason=verdict.reason, slurm_state=job.slurm_state if job else None)
        return data


def rerun(folder: SweepFolder, statuses: tuple[str, ...], executor: str, say: Say, dry_run: bool = False,
          exclude: str | None = None) -> list[str]:
    """New run folders for the cells in ``statuses`` (default: every failure kind), then submit them (off the
    ``exclude`` nodes: e.g. a straggler's node that ``analyze`` named)."""
    from hpc_tools.submission import new_run

    data = refresh(folder)
    chosen = [c for c in data["cells"] if c["status"] in (statuses or FAILURE_STATUSES)]
    if dry_run or not chosen:
        return [c["id"] for c in chosen]
    with folder.edit() as d:
        by_id = {c["id"]: c for c in d["cells"]}
        for c in chosen:
            entry = by_id[c["id"]]
            old = RunFolder(folder.path / entry["run_dir"])
            recipe = _recipe_of(old)
            manifest = old.manifest()
            new = new_run(recipe, folder.path, executor, data.get("source", "sweep"),
                              {k: manifest.get(k) for k in ("profile", "sweep", "cell", "repeat", "overrides")}
                              | {"rerun_of": old.run_id} | ({"exclude": exclude} if exclude else {}))
            entry["attempts"].append({"run_id": entry["run_id"], "job_id": entry.get("job_id"),
                                      "status": entry["status"]})
            entry.update(run_dir=new.run_id, run_id=new.run_id, job_id=None, status="pending")
        d["executor"] = executor
    submit_cells(folder, [c["id"] for c in chosen], executor, say, exclude)
    return [c["id"] for c in chosen]


def summary(data: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in data["cells"]:
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    return counts


def require_cells(plan: SweepPlan) -> None:
    if not plan.valid:
        first = plan.invalid[0].reasons[0] if plan.invalid and plan.invalid[0].reasons else "no cells"
        raise UserError(f"every cell of the sweep breaks a rule, e.g. {plan.invalid[0].label()}: {first}"
                        if plan.invalid else "the sweep has no cells (give sweep.grid values)")
