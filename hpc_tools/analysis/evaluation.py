"""The report's "Evaluation" section: the scores ``eval`` wrote under each run's ``eval/`` folder (read by
``hpc_tools.evaluate.results``), quantized models' sizes and score deltas, and each task's score against training
tokens when a run has several evaluated checkpoints."""

from __future__ import annotations

import html
from pathlib import Path

from hpc_tools.analysis.analyze import Analysis
from hpc_tools.analysis.plots import _colors, _figure, _finish

SCORE_COLUMNS = ("run_id", "iteration", "tokens", "model", "task", "metric", "value", "stderr", "limit")
QUANTIZED_COLUMNS = ("run_id", "scheme", "iteration", "linear_bytes_bf16", "linear_bytes_after", "ratio_vs_bf16",
                     "folder_bytes_before", "folder_bytes_after", "task", "metric", "unquantized", "quantized",
                     "delta")
TEXT = ("Scores from lm-evaluation-harness (`python -m hpc_tools eval`), one row per checkpoint, model and metric; "
        "quantized models (`quantize`) with the bytes of their linear weights against the same weights as bf16, and "
        "their score beside the unquantized one of the same checkpoint.")
CAPTION = "Each evaluated task's score against the training tokens of its checkpoint, one line per run and metric."


def markdown(a: Analysis, table) -> list[str]:
    if a.evaluation.empty and a.quantized.empty:
        return []
    parts = ["## Evaluation\n", TEXT + "\n"]
    if not a.evaluation.empty:
        parts.append(table(a.evaluation, [c for c in SCORE_COLUMNS if c in a.evaluation]))
    if not a.quantized.empty:
        parts += ["\nQuantized models:\n", table(a.quantized, [c for c in QUANTIZED_COLUMNS if c in a.quantized])]
    return parts


def html_parts(a: Analysis, table) -> list[str]:
    if a.evaluation.empty and a.quantized.empty:
        return []
    parts = ["<h2>Evaluation</h2>", f"<p>{html.escape(TEXT)}</p>"]
    if not a.evaluation.empty:
        parts.append(table(a.evaluation, [c for c in SCORE_COLUMNS if c in a.evaluation]))
    if not a.quantized.empty:
        parts += ["<p>Quantized models:</p>", table(a.quantized, [c for c in QUANTIZED_COLUMNS if c in a.quantized])]
    return parts


def score_vs_tokens(a: Analysis, out: Path) -> list[Path]:
    """Score against training tokens, for the unquantized models of runs with two or more evaluated checkpoints."""
    df = a.evaluation
    if df.empty:
        return []
    df = df[(df["model"] == "unquantized") & df["tokens"].notna()]
    series = [(key, part.sort_values("tokens")) for key, part in df.groupby(["run_id", "task", "metric"])
              if part["tokens"].nunique() > 1]
    if not series:
        return []
    fig, ax = _figure()
    for color, ((run_id, task, metric), part) in zip(_colors(len(series)), series):
        ax.errorbar(part["tokens"], part["value"], yerr=part["stderr"].fillna(0), color=color, marker="o", ms=4,
                    lw=1, capsize=2, label=f"{run_id[-6:]} {task} {metric}")
    return _finish(fig, ax, out / "eval_score_vs_tokens.png", "training tokens", "score",
                   "Evaluation score vs training tokens")
