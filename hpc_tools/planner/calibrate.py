"""Calibration: predicted vs measured memory and step time of finished runs, and a per-cluster efficiency factor.

A run folder holds the resolved ``recipe.yaml`` and per-rank step records (schema in profiling/schema.py), reduced
to figures by ``profiling.figures`` exactly as the run summary and ``analyze`` reduce them. The fit keeps the
communication and bubble model and solves for the compute efficiency e in

    measured step time = A / e + R,   A = hardware FLOPs per GPU x (1 + bubble fraction) / peak,  R = communication

by least squares over all runs of one cluster and backend kind (x = 1/e: x = sum A (t - R) / sum A^2). The factor is
stored per cluster (GPU type and partition) and backend kind in a JSON file that later plans of that cluster and kind
read (``planner/efficiency.py``): Megatron-core's layers and Hugging Face's reach different shares of the peak.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_tools.errors import UserError
from hpc_tools.planner.efficiency import (
    CALIBRATION_VERSION,
    calibration_key,
    default_efficiency,
    default_path,
    efficiency_key,
    load_store,
)
from hpc_tools.planner.memory import CONTEXT, NCCL_BUFFER_BYTES
from hpc_tools.planner.steptime import BUBBLE, COMPUTE

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe


@dataclass(frozen=True, slots=True)
class Measured:
    """A run's recipe and the figures the calibration fits against (``profiling.figures``: the same reduction as the
    run summary and ``analyze``)."""

    run: str
    recipe: "Recipe"
    steps: int  # measured steps (after warm-up)
    step_time_s: float | None  # step_time_median_s: median over measured steps of the slowest rank's step time
    mem_allocated_max_bytes: int | None  # mem_allocated_peak_bytes: over every step and rank
    mem_reserved_max_bytes: int | None  # mem_reserved_peak_bytes


def read_run(run_dir: str | Path) -> Measured:
    """The recipe and the measured figures of one run folder."""
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.load import resolve
    from hpc_tools.recipe.yamlfile import parse_yaml
    from profiling.figures import reduce_records
    from profiling.records import rank_files

    run = Path(run_dir)
    recipe_file = run / "recipe.yaml"
    if not recipe_file.is_file():
        raise UserError(f"{run} has no recipe.yaml (give run folders, e.g. runs/<run_id>)")
    recipe = resolve(parse_yaml(recipe_file.read_text(), str(recipe_file)), source=str(recipe_file), check=False)
    if not rank_files(run / "records"):
        raise UserError(f"{run}/records has no rank<R>.jsonl or rank<R>.parquet step records (did the run start?)")
    layout = ParallelLayout.from_recipe(recipe)
    fig = reduce_records(run / "records", recipe.profiling.warmup_steps).figures(layout.world_size)
    alloc, reserved = fig["mem_allocated_peak_bytes"], fig["mem_reserved_peak_bytes"]
    return Measured(run=run.name, recipe=recipe, steps=fig["steps_measured"], step_time_s=fig["step_time_median_s"],
                    mem_allocated_max_bytes=None if alloc is None else int(alloc),
                    mem_reserved_max_bytes=None if reserved is None else int(reserved))


@dataclass(frozen=True, slots=True)
class Comparison:
    measured: Measured
    key: str
    predicted_step_s: float | None  # at the efficiency used for the comparison
    predicted_allocated_bytes: float | None  # what torch's allocator sees: total - CUDA context - NCCL buffers
    compute_at_peak_s: float | None  # A in the fit
    rest_s: float | None  # R in the fit

    def as_dict(self) -> dict[str, Any]:
        m = self.measured
        return {"run": m.run, "cluster": self.key, "steps": m.steps, "measured_step_s": m.step_time_s,
                "predicted_step_s": self.predicted_step_s,
                "measured_mem_allocated_max_bytes": m.mem_allocated_max_bytes,
                "measured_mem_reserved_max_bytes": m.mem_reserved_max_bytes,
                "predicted_mem_allocated_bytes": self.predicted_allocated_bytes}


def compare(measured: Measured, efficiency: float) -> Comparison:
    """Prediction for the run's recipe next to what it measured."""
    from hpc_tools.planner.estimate import make_plan

    plan = make_plan(measured.recipe, efficiency=efficiency)
    allocated = None
    if plan.hardware.is_gpu:
        allocated = plan.memory.total - plan.memory.peak.terms[CONTEXT] - NCCL_BUFFER_BYTES
    a = r = None
    if plan.time is not None:
        terms = plan.time.terms
        a = (terms[COMPUTE] + terms[BUBBLE]) * efficiency  # seconds at 100 % of peak
        r = plan.time.total_s - terms[COMPUTE] - terms[BUBBLE]
    return Comparison(measured, calibration_key(measured.recipe.cluster, efficiency_key(measured.recipe)),
                      plan.time.total_s if plan.time else None, allocated, a, r)


def fit_efficiency(comparisons: list[Comparison]) -> float | None:
    """Least-squares efficiency over runs with a peak and a measured step time that exceeds the modelled
    communication; None when no run qualifies."""
    usable = [c for c in comparisons if c.compute_at_peak_s and c.measured.step_time_s is not None
              and c.measured.step_time_s > c.rest_s]
    if not usable:
        return None
    num = sum(c.compute_at_peak_s * (c.measured.step_time_s - c.rest_s) for c in usable)
    den = sum(c.compute_at_peak_s ** 2 for c in usable)
    return den / num  # e = 1/x with x = num/den


def calibrate(run_dirs: list[str | Path], store: Path | None = None, save: bool = True,
              efficiency: float | None = None) -> dict[str, Any]:
    """Compare every run, fit one efficiency per cluster, store it (unless ``save`` is False). Returns a report."""
    return calibrate_runs([read_run(d) for d in run_dirs], store, save, efficiency)


def calibrate_runs(runs: list[Measured], store: Path | None = None, save: bool = True,
                   efficiency: float | None = None) -> dict[str, Any]:
    """``calibrate`` for runs already read (``read_run``): the measured layout search (``sweep/measure.py``) feeds
    its candidates' runs through here, with the planning peak it ranked them by in their recipes."""
    from hpc_tools.planner.steptime import DEFAULT_EFFICIENCY

    base = DEFAULT_EFFICIENCY if efficiency is None else efficiency
    # each run compared at its own backend's default (or the explicit efficiency); the fit does not depend on it
    comparisons = [compare(m, default_efficiency(m.recipe)[0] if efficiency is None else efficiency) for m in runs]
    fitted: dict[str, dict[str, Any]] = {}
    for key in sorted({c.key for c in comparisons}):
        group = [c for c in comparisons if c.key == key]
        eff = fit_efficiency(group)
        if eff is not None:
            fitted[key] = {"efficiency": eff, "runs": [c.measured.run for c in group],
                           "default_efficiency": (default_efficiency(group[0].measured.recipe)[0] if efficiency is None
                                                  else efficiency),
                           "fitted": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    rows = []
    for c in comparisons:
        row = c.as_dict()
        eff = fitted.get(c.key, {}).get("efficiency")
        row["fitted_efficiency"] = eff
        after_fit = c.compute_at_peak_s / eff + c.rest_s if eff and c.compute_at_peak_s else None
        row["predicted_step_s_after_fit"] = after_fit
        rows.append(row)
    path = store or default_path()
    if save and fitted:
        data = load_store(path)
        data["version"] = CALIBRATION_VERSION
        data["clusters"].update(fitted)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, path)
    return {"runs": rows, "fitted": fitted, "store": str(path) if save and fitted else None,
            "default_efficiency": base}
