"""Submitting a Slurm sweep's cells as Slurm's limits allow: the cells due now in arrays no larger than
``MaxArraySize``, no more than the user's queue takes, each array with its share of ``sweep.max_parallel``; the rest
wait in ``sweep.json`` (status pending, no job id) and go in as earlier cells end.

``sweep`` submits the first cells; every ``sweep status`` (``--wait`` keeps polling), ``sweep rerun`` and the
measured search's wait submit what has become due since, from ``sweep.json``, under its lock (two at once never
submit a cell twice). The arithmetic is ``hpc_tools.sweep.chunks``, the limits ``hpc_tools.sweep.limits``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from hpc_tools.errors import UserError
from hpc_tools.recipe.schema import Recipe
from hpc_tools.registry import RunFolder, now_iso
from hpc_tools.runstate import LIVE_STATUSES
from hpc_tools.sweep import chunks as chunking
from hpc_tools.sweep.folder import SweepFolder
from hpc_tools.sweep.limits import SlurmLimits, raise_throttle, read_limits, refusal

Say = Callable[[str], None]


def resource_key(recipe: Recipe) -> str:
    """Cells with equal keys can share one Slurm job array: same sbatch resources and environment set-up."""
    from hpc_tools.render.slurm_params import SlurmSpec

    spec = dataclasses.replace(SlurmSpec.from_recipe(recipe), job_name="")
    return json.dumps([dataclasses.astuple(spec), recipe.cluster.setup.model_dump(mode="json"), recipe.cluster.python],
                      sort_keys=True, default=str)


def submission_group(recipe: Recipe) -> str | None:
    """The key of the cells this one may share job arrays with; None for a cell with in-job restarts
    (``cluster.restarts``), its own job: an array task never restarts. Kept in sweep.json as the cell's ``group``,
    so that submitting later needs no recipe loaded per cell."""
    return None if recipe.cluster.restarts else resource_key(recipe)


def slurm_groups(cells: list[dict], recipes: dict[str, Recipe]) -> dict[str, list[str]]:
    """The cells' ids by Slurm submission: cells with equal resources share a job array, except cells with in-job
    restarts (``cluster.restarts``), each its own job: an array task never restarts."""
    groups: dict[str, list[str]] = {}
    for c in cells:
        groups.setdefault(submission_group(recipes[c["id"]]) or c["id"], []).append(c["id"])
    return groups


def due_cells(data: dict[str, Any]) -> list[dict]:
    """The cells created but not yet submitted (``sweep.json``: status pending, no job id)."""
    return [c for c in data["cells"] if not c.get("job_id") and c.get("status") == "pending"]


def _in(job_id: str | None, job: str) -> bool:
    return bool(job_id) and (str(job_id) == job or str(job_id).startswith(f"{job}_"))


# Slurm job states (sacct) in which a job still holds, or waits for, its place
SLURM_LIVE = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "COMPLETING", "CONFIGURING",
                        "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT"})


def _live(cell: dict) -> bool:
    """Not ended, by the cell's status or by its Slurm job: a run records its end just before its job ends, and
    until then the job still counts against the throttle."""
    return cell["status"] in LIVE_STATUSES or cell.get("slurm_state") in SLURM_LIVE


def live_arrays(data: dict[str, Any]) -> list[chunking.LiveArray]:
    """The sweep's submissions that still hold cells not yet ended, oldest first."""
    out = []
    for chunk in data.get("chunks", []):
        live = sum(1 for c in data["cells"] if _in(c.get("job_id"), chunk["job"]) and _live(c))
        if live:
            out.append(chunking.LiveArray(chunk["job"], chunk["throttle"], live))
    return out


def _groups(folder: SweepFolder, due: list[dict], array_tasks: int) -> list[tuple[list[str], chunking.Group]]:
    """The due cells by submission (equal resources and exclude list; a cell with restarts alone), in sweep order."""
    from hpc_tools.recipe.load import load_resolved

    groups: dict[tuple, list[str]] = {}
    for c in due:
        if "group" not in c:  # a sweep written before cells kept their group
            c["group"] = submission_group(load_resolved(RunFolder(folder.path / c["run_dir"]).recipe_path))
        groups.setdefault((c.get("exclude"), c["group"] or c["id"]), []).append(c["id"])
    # a group of None (restarts) holds one cell, its own job
    return [(ids, chunking.Group(len(ids), array_tasks if key[1] != ids[0] else 1)) for key, ids in groups.items()]


def submit_due(folder: SweepFolder, say: Say, limits: SlurmLimits | None = None) -> list[str]:
    """Submit what is due now and raise live arrays' throttles where cells wait on them; returns the submitted cell
    ids. Raises UserError when Slurm refused a submission (the ones made before it stay recorded)."""
    data = folder.read()
    if data.get("executor") != "slurm":
        return []
    max_parallel = data.get("max_parallel")
    live = live_arrays(data)
    held = max_parallel is not None and any(a.live > a.throttle for a in live)
    if not due_cells(data) and not held:
        return []
    limits = limits or read_limits()
    why = refusal(limits)
    if why:
        raise UserError(f"sweep {folder.sweep_id}: {why}")
    failure, submitted = None, []
    with folder.edit() as data:  # under the lock throughout: a second `sweep status` waits, then sees the job ids
        due = due_cells(data)
        groups = _groups(folder, due, limits.array_tasks)
        plan = chunking.plan([g for _, g in groups], live_arrays(data), limits.queue_room, max_parallel)
        _raise(data, plan.raises, say)
        queues = [list(ids) for ids, _ in groups]
        by_id = {c["id"]: c for c in data["cells"]}
        for chunk in plan.chunks:
            ids, queues[chunk.group] = queues[chunk.group][:chunk.size], queues[chunk.group][chunk.size:]
            try:
                job = _submit(folder.path, [by_id[i] for i in ids], chunk.throttle, say)
            except Exception as exc:  # noqa: BLE001 - sbatch's refusal; what went in before stays recorded
                failure = exc
                break
            data.setdefault("chunks", []).append({"job": job, "cells": ids, "throttle": chunk.throttle,
                                                  "submitted": now_iso()})
            submitted += ids
        data["limits"] = limits.as_dict()
        data["waiting"] = len(due_cells(data))
    if failure is not None:
        raise UserError(f"sweep {folder.sweep_id}: Slurm refused a submission ({_one_line(failure)}); "
                        f"{len(submitted)} cell(s) went in, the rest wait (`sweep status` submits them)")
    if data["waiting"]:
        say(f"{data['waiting']} cell(s) wait for room ({_room(limits, max_parallel)}): `hpc-tools sweep status "
            f"{folder.sweep_id}` submits them as earlier cells end (`--wait` keeps doing so until all have ended)")
    return submitted


def _one_line(exc: Exception) -> str:
    text = getattr(exc, "stderr", None) or str(exc)
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _room(limits: SlurmLimits, max_parallel: int | None) -> str:
    throttle = f"sweep.max_parallel {max_parallel}, " if max_parallel is not None else ""
    return f"{throttle}{limits.describe()}"


def _raise(data: dict[str, Any], raises: list[tuple[str, int]], say: Say) -> None:
    chunks = {c["job"]: c for c in data.get("chunks", [])}
    for job, throttle in raises:
        said = raise_throttle(job, throttle)
        if said is None:
            chunks[job]["throttle"] = throttle
        else:  # e.g. the array ended meanwhile: the next call plans again
            say(f"note: scontrol update JobId={job} ArrayTaskThrottle={throttle}: {said}")


def _submit(sweep: Path, cells: list[dict], throttle: int, say: Say) -> str:
    """One array (or a single job) of ``cells``; records job ids in the cells; returns the array's job id."""
    from hpc_tools.executors.slurm import submit_array, submit_run
    from hpc_tools.recipe.load import load_resolved

    runs = [RunFolder(sweep / c["run_dir"]) for c in cells]
    recipe = load_resolved(runs[0].recipe_path)
    exclude = cells[0].get("exclude")
    if len(cells) > 1:
        jobs = submit_array(runs, recipe, exclude=exclude, parallelism=throttle)
    else:
        jobs = [submit_run(runs[0], recipe, exclude=exclude)]
    for cell, job in zip(cells, jobs):
        cell.update(job_id=str(job.job_id), status="pending", submitted=now_iso())
    kind = f"job array of {len(cells)} (%{throttle})" if len(cells) > 1 else "job"
    off = f" (excluding {exclude})" if exclude else ""
    pairs = ", ".join(f"{c['id']}={j.job_id}" for c, j in zip(cells, jobs))
    say(f"submitted {kind}{off}: {pairs}")
    return str(jobs[0].job_id).split("_")[0]
