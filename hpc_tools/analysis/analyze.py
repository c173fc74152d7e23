"""One call from folders to every table: ``analyse(refs)`` -> ``Analysis``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd

from hpc_tools.analysis.inputs import RunInput, discover
from hpc_tools.analysis.labels import describe
from hpc_tools.analysis.metrics import goodput_table, rank_table, run_goodput, run_metrics, step_table, straggler_table
from hpc_tools.analysis.records import RunRecords, read_run
from hpc_tools.analysis.scaling import ScalingResult, analyse_scaling
from profiling import goodput as goodput_mod
from profiling.figures import GB, JOB_FIGURES, node_reader


@dataclass
class Analysis:
    runs: pd.DataFrame  # one row per run
    ranks: pd.DataFrame  # one row per (run, rank)
    steps: pd.DataFrame  # one row per (run, step)
    scaling: list[ScalingResult]
    heatmaps: dict[str, tuple[np.ndarray, np.ndarray, list[int]]] = field(default_factory=dict)
    sweeps: list[str] = field(default_factory=list)
    goodput: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per run (profiling.goodput)
    goodput_total: dict[str, Any] = field(default_factory=dict)  # summed over the runs (a sweep's goodput)
    goodput_buckets: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # run id -> bucket rows
    evaluation: pd.DataFrame = field(default_factory=pd.DataFrame)  # eval's scores (analysis.evaluation)
    quantized: pd.DataFrame = field(default_factory=pd.DataFrame)  # quantize's sizes and score deltas

    @property
    def stragglers(self) -> pd.DataFrame:
        """The named stragglers of every run (rank, node, cause, how sure)."""
        return straggler_table(self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {"sweeps": self.sweeps, "runs": _records(self.runs), "ranks": _records(self.ranks),
                "stragglers": _records(self.stragglers), "goodput": _records(self.goodput),
                "goodput_total": {k: _clean(v) for k, v in self.goodput_total.items()},
                "scaling": [s.summary() for s in self.scaling]}


def _clean(value: Any) -> Any:
    if isinstance(value, (np.floating, float)):
        return None if math.isnan(value) or math.isinf(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{k: _clean(v) for k, v in row.items()} for row in df.to_dict(orient="records")]


def warmup_for(inp: RunInput, warmup: int | None) -> int:
    """--warmup, else the recipe's profiling.warmup_steps."""
    if warmup is not None:
        return warmup
    return inp.recipe.profiling.warmup_steps if inp.recipe is not None else 0


def planner_prediction(recipe, row: dict | None = None) -> tuple[float | None, float | None]:
    """(step time s, allocated bytes) the planner predicts for this recipe, as its calibration compares them with a
    run (``planner.calibrate.compare``: the stored efficiency of the recipe's cluster, else the default; memory as
    torch's allocator sees it, GPUs only); (None, None) without a planner or a model for the recipe."""
    try:
        from hpc_tools.planner.calibrate import Measured, compare
        from hpc_tools.planner.efficiency import resolve_efficiency
        from hpc_tools.planner.steptime import DEFAULT_EFFICIENCY
    except ImportError:
        return None, None
    row = row or {}
    try:
        eff, _ = resolve_efficiency(recipe)
        c = compare(Measured(run=str(row.get("run_id", "")), recipe=recipe, steps=int(row.get("steps_measured") or 0),
                             step_time_s=row.get("step_time_median_s"),
                             mem_allocated_max_bytes=row.get("mem_allocated_peak_bytes"),
                             mem_reserved_max_bytes=row.get("mem_reserved_peak_bytes")),
                    DEFAULT_EFFICIENCY if eff is None else eff)
    except Exception:  # the planner cannot model this recipe (e.g. comm_check): the columns stay empty
        return None, None
    return c.predicted_step_s, c.predicted_allocated_bytes


def read_records(inp: RunInput, warmup: int | None = None) -> RunRecords:
    """A run's records reduced (``read_run``) under its warm-up (``warmup`` overrides the recipe's)."""
    max_step = inp.recipe.training.train_iters if inp.recipe is not None else None
    return read_run(inp.run.records_dir, warmup_for(inp, warmup), max_step)


def records_ahead(inputs: list[RunInput], warmup: int | None = None) -> Iterator[RunRecords]:
    """``read_records`` of each input in turn, the next run read in a background thread while the caller works on
    this one (its figures, straggler verdict and goodput leave the readers idle otherwise); two runs at most held."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-reader") as pool:
        ahead = pool.submit(read_records, inputs[0], warmup) if inputs else None
        for i in range(len(inputs)):
            rec = ahead.result()
            ahead = pool.submit(read_records, inputs[i + 1], warmup) if i + 1 < len(inputs) else None
            yield rec


def analyse_run(inp: RunInput, warmup: int | None = None, rec: RunRecords | None = None
                ) -> tuple[dict, pd.DataFrame, pd.DataFrame, RunRecords]:
    """One run's figures row, rank table and step table (``rec``: its records when already read)."""
    rec = rec if rec is not None else read_records(inp, warmup)
    rec.reducer.node_of = node_reader(inp.run.records_dir)  # names the node of a straggler
    row = run_metrics(inp, rec)
    ranks = rank_table(rec, inp.run_id)
    predicted, predicted_mem = planner_prediction(inp.recipe, row) if inp.recipe is not None else (None, None)
    row["predicted_step_time_s"] = predicted
    row["predicted_mem_allocated_bytes"] = predicted_mem
    row["predicted_mem_gb"] = predicted_mem / GB if predicted_mem else None  # beside peak_mem_gb
    measured = row["step_time_median_s"]
    row["predicted_vs_measured"] = predicted / measured if predicted and measured else None
    return row, ranks, step_table(rec, inp.run_id, row.get("tokens_per_step")), rec


def analyse(refs: list[str], warmup: int | None = None, root: str | Path | None = None,
            scaling: str | None = None) -> Analysis:
    """Analyse runs and sweeps; ``scaling`` overrides the sweep's `scaling:` choice (auto/strong/weak/none)."""
    inputs, sweeps = discover(refs, root)
    rows, rank_frames, step_frames, heatmaps, goodputs = [], [], [], {}, []
    for inp, name, read in zip(inputs, describe(inputs), records_ahead(inputs, warmup)):
        row, ranks, steps, rec = analyse_run(inp, warmup, read)
        row.update(short_label=name.label, group=name.group, config_key=name.config_key)
        goodputs.append(run_goodput(inp))
        row.update(goodput=goodputs[-1].goodput, allocation_hours=goodputs[-1].summary()["allocation_hours"])
        rows.append(row)
        rank_frames.append(ranks)
        step_frames.append(steps)
        if rec.heatmap.size:
            heatmaps[inp.run_id] = (rec.heatmap, rec.heatmap_edges, rec.heatmap_ranks)
    runs = _numeric(pd.DataFrame(rows))
    if not runs.empty:
        runs = runs.sort_values(["world_size", "cell", "repeat", "run_id"], na_position="last", kind="stable")
        runs = runs.reset_index(drop=True)
    requested = scaling or _sweep_scaling(refs) or "auto"
    from hpc_tools.analysis.eval_tables import tables as evaluation_tables

    evaluation, quantized = evaluation_tables([inp.run for inp in inputs])
    return Analysis(runs=runs, ranks=_concat(rank_frames), steps=_concat(step_frames),
                    scaling=analyse_scaling(runs, requested) if len(runs) > 1 else [], heatmaps=heatmaps,
                    sweeps=sweeps, goodput=goodput_table(inputs, goodputs), goodput_total=goodput_mod.total(goodputs),
                    goodput_buckets={inp.run_id: g.table() for inp, g in zip(inputs, goodputs)},
                    evaluation=evaluation, quantized=quantized)


# The figures that are floats (counts, labels and text stay as they are).
NUMERIC = tuple(f for f in JOB_FIGURES if f not in ("ranks_measured", "steps_measured", "warmup_steps", "slowest_rank",
                                                    "peak_mem_kind", "stragglers", "straggler_nodes",
                                                    "straggler_verdict", "bubble_share_per_stage")) + (
    "predicted_step_time_s", "predicted_mem_allocated_bytes", "predicted_mem_gb", "predicted_vs_measured", "goodput",
    "allocation_hours", "last_val_loss", "all_to_all_share")


def _numeric(runs: pd.DataFrame) -> pd.DataFrame:
    """Metric columns as floats (a metric nobody measured is None in every row, which pandas keeps as object)."""
    for col in NUMERIC:
        if col in runs:
            runs[col] = pd.to_numeric(runs[col], errors="coerce").astype(float)
    return runs


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _sweep_scaling(refs: list[str]) -> str | None:
    for ref in refs:
        path = Path(ref) / "sweep.json"
        if path.is_file():
            return json.loads(path.read_text()).get("scaling")
    return None

