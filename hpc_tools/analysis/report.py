"""Writing a report folder: report.md, one self-contained report.html (images inlined), PNGs, CSV + parquet tables."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path

import pandas as pd

from hpc_tools.analysis import breakdown_report, evaluation
from hpc_tools.analysis.analyze import Analysis
from hpc_tools.analysis.metrics import GOODPUT_COLUMNS, POST_SAVE_COLUMNS, STRAGGLER_COLUMNS
from hpc_tools.analysis.scaling import __doc__ as SCALING_METHOD
from hpc_tools.analysis.step_plots import all_plots
from hpc_tools.analysis.summary import summary_lines
from profiling.figures import definitions_text
from profiling.units import cell

# The per-run table, split into narrower tables that fit a page; "#" and "config" (the short label, only what varies
# across the runs: analysis.labels) start each, so a row can be followed across them and into the plots.
RUN_TABLES = (
    ("Runs", ("#", "config", "run_id", "status", "layout", "world_size", "repeat", "steps_measured")),
    ("Step time and throughput", ("#", "config", "step_time_median_s", "step_time_p10_s", "step_time_p90_s",
                                  "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu",
                                  "predicted_step_time_s", "predicted_vs_measured")),
    ("Memory, shares, loss", ("#", "config", "peak_mem_gb", "predicted_mem_gb", "bubble_share",
                              "bubble_share_theory", "comm_share", "data_share", "rank_skew", "stragglers",
                              "last_loss", "last_val_loss")),
)
MOE_COLUMNS = ("#", "config", "moe_load_imbalance_median", "moe_load_imbalance_max", "moe_aux_loss",
               "all_to_all_share")
MOE_TEXT = ("Mixture of experts: router load imbalance per step (the busiest expert's tokens / the mean, worst MoE "
            "layer; 1 = even), the router's load-balancing loss, and the share of the step spent in all-to-all "
            "(Method: moe_load_imbalance, all_to_all_share).")
OUTSIDE_COLUMNS = ("#", "config", "world_size", "nodes", "step_time_median_s", "tokens_per_s", "tokens_per_s_per_gpu")
SCALING_COLUMNS = ("scaling", "world_size", "nodes", "repeats", "global_batch_size", "step_time_s", "step_time_std_s",
                   "spread", "tokens_per_s", "speedup", "ideal_speedup", "efficiency", "efficiency_lo", "efficiency_hi",
                   "karp_flatt")


STRAGGLER_TEXT = ("Ranks compared with the peers of their pipeline stage by busy time (step time less the time waited "
                  "in collectives), split into data and compute; the slow rank of a synchronous job is the one that "
                  "waits least (Method: stragglers).")
GOODPUT_TEXT = ("Where each run's allocation went: hours = wall time x ranks (GPU-hours, or rank-hours on CPU); "
                "lost work = steps recomputed after a failure; requeue wait lies outside the allocation "
                "(Method: goodput). Where a run saved checkpoints, the steps right after each save against the "
                "steady median: saves followed by slower steps, how many steps and by how much (Method: post_save).")


def _verdict_lines(a: Analysis, template: str, escape=str) -> str:
    """One line per straggler verdict (``profiling.stragglers``), naming its runs (by id when one run has it, by their
    "#" in the run tables when several share it: a sweep's runs mostly do)."""
    if a.runs.empty or "straggler_verdict" not in a.runs:
        return ""
    by_verdict: dict[str, list[tuple[int, str]]] = {}
    for i, r in enumerate(a.runs.itertuples(), start=1):
        by_verdict.setdefault(str(r.straggler_verdict), []).append((i, r.run_id))
    lines = []
    for verdict, runs in by_verdict.items():
        who = runs[0][1] if len(runs) == 1 else f"runs #{', #'.join(str(i) for i, _ in runs)}"
        lines.append(template.format(escape(f"{who}: {verdict}")))
    return "".join(lines)


def moe_runs(runs: pd.DataFrame) -> pd.DataFrame | None:
    """The runs with router figures (mixture-of-experts runs), None when there are none: the section is left out."""
    if runs.empty or "moe_load_imbalance_median" not in runs:
        return None
    moe = runs[runs["moe_load_imbalance_median"].notna()]
    return None if moe.empty else moe


def moe_lines(moe: pd.DataFrame) -> list[str]:
    """One line per MoE run: its router imbalance and all-to-all share, in words."""
    lines = []
    for r in moe.to_dict("records"):
        a2a = r.get("all_to_all_share")
        a2a_text = "not timed" if a2a is None or (isinstance(a2a, float) and math.isnan(a2a)) else f"{100 * a2a:.1f} %"
        lines.append(f"#{r.get('#', '')} {r['run_id']}: router load imbalance median "
                     f"{r['moe_load_imbalance_median']:.3g} (max {r['moe_load_imbalance_max']:.3g}), load-balancing "
                     f"loss {_fmt(r.get('moe_aux_loss'))}, all-to-all {a2a_text} of the step")
    return lines


def _goodput_total_line(a: Analysis) -> str:
    t = a.goodput_total
    if not t:
        return ""
    return (f"All {t['runs']} run(s): {t['allocation_hours']:.4g} {t['unit']}-hours allocated, goodput "
            f"{100 * (t['goodput'] or 0):.1f} %, productive {t['productive_hours']:.4g} h"
            + (f", on fewer nodes {t['degraded_hours']:.4g} h" if t.get("degraded_hours") else "") + ", start-up "
            f"{t['startup_hours']:.4g} h, preflight {t.get('preflight_hours') or 0:.4g} h, checkpoint load "
            f"{t['checkpoint_load_hours']:.4g} h, checkpoint blocked "
            f"{t['checkpoint_blocked_hours']:.4g} h, recovery {t['recovery_hours']:.4g} h, "
            f"lost work {t['lost_work_hours']:.4g} h ({t['recomputed_steps']} recomputed steps), requeue wait "
            f"{t['requeue_wait_hours']:.4g} h.")


def _hang_lines(a: Analysis) -> list[str]:
    """One line per run the hang watchdog stopped: each hang's detection time (``profiling.goodput``: from the
    phase's last progress to the verdict)."""
    g = numbered_goodput(a)
    if g is None or g.empty or "hangs" not in g:
        return []
    lines = []
    for _, r in g[g["hangs"].fillna(0) > 0].iterrows():
        times = ", ".join(f"{s:.0f} s" for s in (r["hang_detection_s"] or []) if s is not None)
        lines.append(f"- #{r.get('#', '')} {r['run_id']}: {int(r['hangs'])} hang(s), each named {times} after its "
                     "last progress\n")
    return (["Hangs (the watchdog's detection time, within the phase's calibrated bound):\n\n", *lines, "\n"]
            if lines else [])


def _health_check_lines(a: Analysis) -> list[str]:
    """One line per run whose checks while training ran (``hpc_tools.runtime.health``): their number and cost, and
    each node they named with its step, figure and what was done."""
    if a.runs.empty or "health_checks" not in a.runs:
        return []
    return [f"#{i} {r.run_id}: {r.health_checks}" for i, r in enumerate(a.runs.itertuples(), start=1)
            if isinstance(r.health_checks, str) and r.health_checks]


def _fmt(value, column: str = "") -> str:
    """A table cell: a figure in its one unit (``profiling.units.cell``: shares and goodput in percent, memory in GB),
    empty when missing."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return cell(column, value)


def markdown_table(df: pd.DataFrame, columns=None) -> str:
    cols = [c for c in (columns or df.columns) if c in df.columns]
    if df.empty or not cols:
        return "_none_\n"
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df[cols].itertuples(index=False):
        lines.append("| " + " | ".join(_fmt(v, c).replace("|", "/") for c, v in zip(cols, row)) + " |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """A table cell: kept on one line, unless long text that would widen its column past reading (class w wraps)."""
    return f"<td class='w'>{html.escape(text)}</td>" if len(text) > WRAP_AT else f"<td>{html.escape(text)}</td>"


WRAP_AT = 32  # characters of a cell kept on one line


def html_table(df: pd.DataFrame, columns=None) -> str:
    cols = [c for c in (columns or df.columns) if c in df.columns]
    if df.empty or not cols:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(_cell(_fmt(v, c)) for c, v in zip(cols, row)) + "</tr>"
                   for row in df[cols].itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def numbered_runs(a: Analysis) -> pd.DataFrame:
    """The runs table with "#" (1-based) and "config" (the short label) in front, as the report's tables show it."""
    runs = a.runs.copy()
    if runs.empty:
        return runs
    runs.insert(0, "#", range(1, len(runs) + 1))
    runs.insert(1, "config", runs["short_label"] if "short_label" in runs else runs.get("label", ""))
    return runs


def outside_series(a: Analysis) -> tuple[str, pd.DataFrame | None]:
    """(sentence, table) on the runs no scaling series holds: they differ from the others in more than scale (nodes,
    GPUs, global batch), so they are compared in a table, never drawn as a scaling curve."""
    runs = numbered_runs(a)
    if runs.empty or len(runs) < 2:
        return "", None
    inside = {r for s in a.scaling for r in s.run_ids}
    rest = runs[~runs["run_id"].isin(inside)]
    if rest.empty:
        return "", None
    if not a.scaling:
        return ("No scaling series: no runs differ in scale alone (nodes, GPUs per node, global batch) with the rest "
                "of their configuration equal, so none is drawn against the GPU count; the tables above compare "
                "them."), None
    return (f"{len(rest)} run(s) belong to no scaling series (they differ from the others in more than scale, or "
            "their configuration ran at one GPU count only):"), rest


def numbered_goodput(a: Analysis) -> pd.DataFrame:
    """The goodput table with the run tables' "#" and "config" in place of the long run id."""
    g = a.goodput
    if g is None or g.empty or a.runs.empty:
        return g
    runs = numbered_runs(a)[["#", "config", "run_id"]]
    return runs.merge(g.drop(columns=[c for c in ("label",) if c in g]), on="run_id", how="right")


# The goodput table in two narrower parts: the allocation and its goodput, then where the rest went; a third with
# the time trained on fewer nodes (elastic runs, docs/elastic.md) only where a run has some.
_GOODPUT_HEAD = ("unit", "lives", "allocation_hours", "goodput", "productive_hours", "requeue_wait_s")
_GOODPUT_DEGRADED = ("degraded_hours", "degraded_ratio")
GOODPUT_SHOWN = (("#", "config", *(c for c in GOODPUT_COLUMNS if c in _GOODPUT_HEAD)),
                 ("#", "config", *(c for c in GOODPUT_COLUMNS
                                   if c not in _GOODPUT_HEAD and c not in _GOODPUT_DEGRADED and c != "run_id")))


def goodput_parts(goodput: pd.DataFrame | None) -> tuple[tuple[str, ...], ...]:
    """The column sets of the goodput tables to show (``GOODPUT_SHOWN``, the degraded part when a run has any, and the
    steps after checkpoint saves, ``profiling.post_save``, when a run saved)."""
    degraded = goodput is not None and "degraded_hours" in goodput and bool((goodput["degraded_hours"] > 0).any())
    saved = goodput is not None and "post_save_saves" in goodput and bool((goodput["post_save_saves"] > 0).any())
    return (GOODPUT_SHOWN + ((("#", "config", *_GOODPUT_DEGRADED),) if degraded else ())
            + ((("#", "config", *POST_SAVE_COLUMNS),) if saved else ()))


def write_tables(a: Analysis, out: Path) -> list[Path]:
    """Every table as CSV and parquet (the tidy per-run table is the one to load elsewhere)."""
    tables = {"runs": a.runs, "ranks": a.ranks, "steps": a.steps, "goodput": a.goodput}
    for i, s in enumerate(a.scaling):
        tables[f"scaling_{i}"] = s.table
        if s.projection is not None:
            tables[f"projection_{i}"] = s.projection
    files = []
    for name, df in tables.items():
        if df is None or df.empty:
            continue
        df = df.copy()
        for col in df.columns[df.dtypes == "object"]:  # mixed-type parameter columns: parquet needs one type
            df[col] = df[col].map(lambda v: None if v is None else str(v))
        df.to_csv(out / f"{name}.csv", index=False)
        df.to_parquet(out / f"{name}.parquet", index=False)
        files += [out / f"{name}.csv", out / f"{name}.parquet"]
    return files


def _scaling_sections(a: Analysis) -> list[tuple[str, str, pd.DataFrame | None, pd.DataFrame | None]]:
    """(title, text, table, projection) per scaling series: the fit's verdict (its numbers with their 95 % intervals
    and R^2, or "no fit" and why) and a projection only where the fit stands (``analysis.scaling``)."""
    out = []
    for s in a.scaling:
        series = ", ".join(f"{k}={v}" for k, v in s.series.items())
        text = f"{s.kind} scaling over {len(s.table)} GPU counts ({series}); "
        if (s.table["repeats"] > 1).any():
            text += (f"run-to-run spread up to {s.table['spread'].max():.0%} (the plots' error bars: fastest and "
                     "slowest repeat).")
        else:
            text += "one run per GPU count, so no run-to-run spread was measured."
        if s.fit is not None:
            text += " " + s.fit.verdict()
            if s.projection is None:
                text += " No projection beyond the measured GPU counts."
            elif s.amdahl is not None:
                text += (" The projection below extends the fit beyond the measured GPU counts, with the range the "
                         "interval of f gives; it also gives Gustafson's scaled speedup n - f(n-1): what the same "
                         "serial fraction allows when work per GPU is held fixed.")
            else:
                text += " The projection below extends the fit beyond the measured GPU counts, with the range the "
                text += "interval of s gives."
        out.append((f"Scaling: {s.kind} ({series})", text, s.table, s.projection))
    return out


def method_text() -> str:
    """The report's method section: every figure's definition (``profiling.figures.DEFINITIONS``, the same text the
    code that computes them states) and how scaling is read."""
    return ("Figures (the run summary, analyze and the calibration compute them the same way, in profiling.figures):\n"
            + definitions_text() + "\n\nScaling:\n" + (SCALING_METHOD or "").strip())


def render_markdown(a: Analysis, images: list[Path], title: str) -> str:
    runs = numbered_runs(a)
    parts = [f"# {title}\n", "## Summary\n", "".join(f"- {line}\n" for line in summary_lines(a))]
    for heading, cols in RUN_TABLES:
        parts += [f"## {heading}\n", markdown_table(runs, cols)]
    for heading, text, table, proj in _scaling_sections(a):
        parts += [f"## {heading}\n", text + "\n", markdown_table(table, SCALING_COLUMNS)]
        if proj is not None:
            parts += ["\nProjection (beyond the measured GPU counts):\n", markdown_table(proj)]
    text, rest = outside_series(a)
    if text:
        parts += ["## Outside any scaling series\n", text + "\n"]
        if rest is not None:
            parts.append(markdown_table(rest, OUTSIDE_COLUMNS))
    moe = moe_runs(runs)
    if moe is not None:
        parts += ["## Mixture of experts\n", MOE_TEXT + "\n", "".join(f"- {line}\n" for line in moe_lines(moe)),
                  markdown_table(moe, MOE_COLUMNS)]
    parts += ["## Stragglers\n", STRAGGLER_TEXT + "\n", _verdict_lines(a, "- {}\n"),
              markdown_table(a.stragglers, STRAGGLER_COLUMNS)]
    goodput = numbered_goodput(a)
    parts += ["## Goodput\n", GOODPUT_TEXT + "\n", *(markdown_table(goodput, cols) for cols in goodput_parts(goodput)),
              _goodput_total_line(a) + "\n", *_hang_lines(a)]
    if _health_check_lines(a):
        parts += ["Health while training (preflight's checks every profiling.health_interval_min):\n\n",
                  "".join(f"- {line}\n" for line in _health_check_lines(a)), "\n"]
    parts += evaluation.markdown(a, markdown_table)
    parts += breakdown_report.markdown(a, markdown_table)  # issue 44: where the step went (its own module)
    parts += ["## Plots\n"] + [f"![{p.stem}]({p.name})\n\n_{caption(p)}_\n" for p in images]
    parts += ["## Method\n", "```\n" + method_text() + "\n```\n"]
    return "\n".join(parts)


CSS = """body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:12px;
margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;vertical-align:top}th{background:#eee}
td{white-space:nowrap}td.w{white-space:normal;min-width:14em;max-width:28em;overflow-wrap:break-word}.scroll{max-width:100%;overflow-x:auto}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}figcaption{font-size:13px;color:#444}
pre{background:#f6f6f6;padding:1em;font-size:12px;white-space:pre-wrap}"""

CAPTIONS = {
    "loss_curves": "Training loss per step (validation loss dashed, at the evaluation steps); one line per "
                   "configuration, band: min-max over its repeats.",
    "val_loss_vs_tokens": "Validation loss against tokens consumed, one line per configuration (band: repeats).",
    "throughput_vs_gpus": "Tokens/s per scaling series against GPUs, with the ideal linear line; bars: fastest to "
                          "slowest repeat.",
    "efficiency_vs_gpus": "Parallel efficiency per scaling series with the fitted law and its 95 % band, or the "
                          "reason for no fit.",
    "step_time_breakdown": "Median step time per configuration split into data loading, communication, pipeline "
                           "bubble and the rest; error bar: fastest to slowest repeat.",
    "predicted_vs_measured": "The planner's prediction next to the measurement: step time (measured median, bar "
                             "p10-p90; the numbers above the bars: measured / predicted, up to 8 configurations) "
                             "and allocated memory per GPU.",
    "mfu_over_steps": "Model FLOPs utilisation per step (mean over ranks); band: repeats.",
    "memory_timeline": "Memory per step: maximum over ranks, band: the range over ranks (and repeats).",
    "memory_per_rank": "Peak memory per rank (bars; per configuration, the largest over its repeats).",
    "heatmap": "Step time per rank and step (binned); a slow rank or a slow phase shows as a stripe. The colour "
               "scale spans the steps after warm-up; the warm-up steps show at its top colour.",
    "throughput_over_steps": "Tokens/s per GPU of each step after warm-up (tokens per step / the slowest rank's step "
                             "time / ranks); one line per configuration, band: its repeats.",
    "learning_rate": "Learning rate per step (the schedule as the trainer applied it); one line per configuration.",
    "grad_norm": "Gradient norm before clipping, per step (mean over the ranks that report it); one line per "
                 "configuration, band: its repeats.",
    "eval_score_vs_tokens": evaluation.CAPTION,
    "step_waterfall": breakdown_report.CAPTION,
}


def caption(path: Path) -> str:
    """What a plot shows, in one sentence."""
    stem = path.stem
    return CAPTIONS.get(stem) or CAPTIONS.get(stem.rsplit("_", 1)[0], stem)


def _scroll(table: str) -> str:
    """A table in a box that scrolls sideways when it is wider than the page."""
    return f"<div class='scroll'>{table}</div>"


def render_html(a: Analysis, images: list[Path], title: str) -> str:
    """One file: CSS inline, every image a base64 data URI, no scripts, no external resources."""
    parts = [f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
             f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>",
             "<h2>Summary</h2><ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in summary_lines(a))
             + "</ul>"]
    runs = numbered_runs(a)
    for heading, cols in RUN_TABLES:
        parts += [f"<h2>{html.escape(heading)}</h2>", _scroll(html_table(runs, cols))]
    for heading, text, table, proj in _scaling_sections(a):
        parts += [f"<h2>{html.escape(heading)}</h2><p>{html.escape(text)}</p>",
                  _scroll(html_table(table, SCALING_COLUMNS))]
        if proj is not None:
            parts += ["<p>Projection (beyond the measured GPU counts):</p>", _scroll(html_table(proj))]
    text, rest = outside_series(a)
    if text:
        parts += ["<h2>Outside any scaling series</h2>", f"<p>{html.escape(text)}</p>"]
        if rest is not None:
            parts.append(_scroll(html_table(rest, OUTSIDE_COLUMNS)))
    moe = moe_runs(numbered_runs(a))
    if moe is not None:
        parts += ["<h2>Mixture of experts</h2>", f"<p>{html.escape(MOE_TEXT)}</p>",
                  "<ul>" + "".join(f"<li>{html.escape(line)}</li>" for line in moe_lines(moe)) + "</ul>",
                  _scroll(html_table(moe, MOE_COLUMNS))]
    parts += ["<h2>Stragglers</h2>", f"<p>{html.escape(STRAGGLER_TEXT)}</p>",
              "<ul>" + _verdict_lines(a, "<li>{}</li>", html.escape) + "</ul>",
              _scroll(html_table(a.stragglers, STRAGGLER_COLUMNS))]
    parts += ["<h2>Goodput</h2>", f"<p>{html.escape(GOODPUT_TEXT)}</p>",
              *(_scroll(html_table(numbered_goodput(a), cols)) for cols in goodput_parts(a.goodput)),
              f"<p>{html.escape(_goodput_total_line(a))}</p>",
              *(["<p>Health while training (preflight's checks every profiling.health_interval_min):</p><ul>"
                 + "".join(f"<li>{html.escape(line)}</li>" for line in _health_check_lines(a)) + "</ul>"]
                if _health_check_lines(a) else []),
              *evaluation.html_parts(a, lambda df, cols: _scroll(html_table(df, cols))),
              *breakdown_report.html_parts(a, lambda df: _scroll(html_table(df))),
              "<h2>Plots</h2>"]
    for p in images:
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        parts.append(f"<figure><img alt='{html.escape(p.stem)}' src='data:image/png;base64,{data}'>"
                     f"<figcaption><b>{html.escape(p.stem)}</b>: {html.escape(caption(p))}</figcaption></figure>")
    parts += ["<h2>Method</h2>", f"<pre>{html.escape(method_text())}</pre></body></html>"]
    return "\n".join(parts)


def write_report(a: Analysis, out: str | Path, title: str = "hpc_tools report") -> dict[str, list[str]]:
    """Write every artefact into ``out``; returns {kind: [paths]}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    images = all_plots(a, out) + evaluation.score_vs_tokens(a, out) + breakdown_report.plots(a, out)
    tables = write_tables(a, out)
    (out / "report.md").write_text(render_markdown(a, images, title))
    (out / "report.html").write_text(render_html(a, images, title))
    return {"report": [str(out / "report.md"), str(out / "report.html")], "plots": [str(p) for p in images],
            "tables": [str(p) for p in tables]}
