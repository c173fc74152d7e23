"""The report's "Where the step went" section: each traced run's breakdown (``analysis.breakdown``) as a table, its
verdict, and a waterfall of one step planned vs measured. ``analysis.report`` calls ``markdown``, ``html_parts`` and
``plots``; the runs come from the references the analysis was made from (``remember``, called by
``cli.analyze.analysed``)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any, Callable

import pandas as pd

TEXT = ("Each traced step of each rank cut into buckets that add up to the step (docs/breakdown.md): compute, "
        "communication the compute did not hide per parallel group, the pipeline bubble, data, host gaps, "
        "checkpoint, other; mean over the traced steps. The plan row: the planner's terms for the same layout.")
CAPTION = ("One step, bucket by bucket, planned (the planner's terms) beside measured (mean over ranks and traced "
           "steps); each bar starts where the buckets before it end.")
MAX_RUNS = 8


def remember(analysis: Any, refs: list[str], runs_dir: str | None) -> None:
    """Keep what the analysis was made from, so that the report can find the runs' traces."""
    analysis.breakdown_refs = (list(refs), runs_dir)


def collect(analysis: Any) -> list:
    """The breakdowns of the analysed runs that hold traces (first ``MAX_RUNS``), computed once per analysis."""
    cached = getattr(analysis, "_breakdowns", None)
    if cached is not None:
        return cached
    from hpc_tools.analysis.breakdown import breakdown
    from hpc_tools.analysis.inputs import discover
    from profiling.trace import trace_paths

    refs = getattr(analysis, "breakdown_refs", None)
    found = []
    if refs is not None:
        inputs, _ = discover(*refs)
        for inp in inputs:
            if len(found) < MAX_RUNS and trace_paths(inp.run.path):
                b = breakdown(inp)
                if b.ranks:
                    found.append(b)
    analysis._breakdowns = found
    return found


def _table(b) -> pd.DataFrame:
    js = b.to_json()
    rows = [{"rank": str(r["rank"]), "step_s": r["step_s"], **r["buckets"]} for r in js["ranks"]]
    rows.append({"rank": "mean", "step_s": None, **js["mean"]})
    if b.planned:
        rows.append({"rank": "plan", "step_s": None, **b.planned})
    cols = ["rank", "step_s"] + [k for k in js["mean"] if js["mean"][k] > 0 or k in b.planned]
    return pd.DataFrame(rows)[cols]


def _after(b) -> str | None:
    """The post-save inflation line (``profiling.post_save``) of a breakdown, None without saves."""
    from profiling.post_save import text

    return text(b.post_save)


def markdown(analysis: Any, table: Callable[[pd.DataFrame], str]) -> list[str]:
    parts: list[str] = []
    for b in collect(analysis):
        parts += [f"### {b.run_id}\n", table(_table(b)), f"\nPlan: {b.planned_source}.\n",
                  f"\nVerdict: {b.verdict}\n", *([f"\nAfter saves: {after}\n"] if (after := _after(b)) else [])]
    return ["## Where the step went\n", TEXT + "\n", *parts] if parts else []


def html_parts(analysis: Any, table: Callable[[pd.DataFrame], str]) -> list[str]:
    parts: list[str] = []
    for b in collect(analysis):
        parts += [f"<h3>{html.escape(b.run_id)}</h3>", table(_table(b)),
                  f"<p>Plan: {html.escape(b.planned_source)}.</p>", f"<p>Verdict: {html.escape(b.verdict)}</p>",
                  *([f"<p>After saves: {html.escape(after)}</p>"] if (after := _after(b)) else [])]
    return ["<h2>Where the step went</h2>", f"<p>{html.escape(TEXT)}</p>", *parts] if parts else []


def plots(analysis: Any, out: Path) -> list[Path]:
    """One waterfall per traced run (``step_waterfall.png``, then ``step_waterfall_2.png`` ...)."""
    from hpc_tools.analysis.plots import step_waterfall

    files: list[Path] = []
    for i, b in enumerate(collect(analysis)):
        js = b.to_json()
        name = "step_waterfall.png" if i == 0 else f"step_waterfall_{i + 1}.png"
        files += step_waterfall(js["mean"], b.planned, f"{b.run_id}: one step, planned vs measured",
                                Path(out) / name)
    return files
