"""The evaluation files of a run folder, and their reading (status and the report; json only, nothing heavy).

Layout under ``<run>/eval/`` (or ``<folder>/eval/`` for a Hugging Face folder that names no run)::

    iter_0000020.json            lm-eval's results JSON for the checkpoint of iteration 20, plus an "hpc_tools" key
    iter_0000020-int8.json       the same checkpoint quantized with --scheme int8
    quantize-int8-iter_0000020.json   what quantize measured (linear-weight bytes before/after, folder sizes)
    models/iter_0000020/         the checkpoint exported as a Hugging Face folder (reused by later evaluations)
    eval-<stamp>.sbatch, logs/   a Slurm job array's script and logs
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

EVAL_DIR = "eval"
META_KEY = "hpc_tools"  # what hpc_tools adds to lm-eval's results JSON: iteration, tokens, model, scheme
QUANTIZE_META = "hpc_tools_quantize.json"  # inside a quantized folder: the scheme, its source and the sizes


def results_name(iteration: int | None, scheme: str | None = None) -> str:
    """``iter_0000020.json`` (``-int8`` for a quantized model; ``model`` when the iteration is not known)."""
    stem = f"iter_{iteration:07d}" if iteration is not None else "model"
    return f"{stem}{'-' + scheme if scheme else ''}.json"


def quantize_name(scheme: str, iteration: int | None) -> str:
    return f"quantize-{scheme}-{results_name(iteration)}"


PER_TASK = ("results", "configs", "versions", "n-shot", "higher_is_better", "n-samples")


def keep_other_tasks(path: Path, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` (lm-eval's results for one checkpoint) with the tasks an earlier file of the same checkpoint scored
    and ``new`` did not (each per-task table of lm-eval's JSON); a task scored again is replaced."""
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return new
    for key in PER_TASK:
        if isinstance(old.get(key), dict) and isinstance(new.get(key), dict):
            new[key] = {**{t: v for t, v in old[key].items() if t not in new[key]}, **new[key]}
    return new


def eval_rows(folder: str | Path) -> list[dict[str, Any]]:
    """One row per (results file, task, metric) under ``folder/eval``: iteration, tokens, model ("bf16/fp32 export"
    or the scheme), task, metric, value, stderr, file; sorted by model, task, metric, iteration. Unreadable files
    are left out."""
    rows = []
    for path in sorted((Path(folder) / EVAL_DIR).glob("*.json")):
        if path.name.startswith("quantize-"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        meta = data.get(META_KEY) or {}
        for task, metrics in (data.get("results") or {}).items():
            for key, value in metrics.items():
                name, comma, _filter = key.partition(",")  # lm-eval's "metric,filter" keys (not sample_len)
                if not comma or name.endswith("_stderr") or _number(value) is None:
                    continue
                err = metrics.get(f"{name}_stderr,{_filter}")
                rows.append({"iteration": meta.get("iteration"), "tokens": meta.get("tokens"),
                             "model": meta.get("scheme") or "unquantized", "task": task, "metric": name,
                             "value": float(value), "stderr": _number(err), "limit": meta.get("limit"),
                             "file": path.name})
    return sorted(rows, key=lambda r: (r["model"] != "unquantized", r["model"], r["task"], r["metric"],
                                       r["iteration"] if r["iteration"] is not None else -1))


def quantized_models(folder: str | Path) -> list[dict[str, Any]]:
    """What quantize recorded for this run (``quantize-*.json``): scheme, iteration, linear-weight bytes."""
    found = []
    for path in sorted((Path(folder) / EVAL_DIR).glob("quantize-*.json")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return found


def summary(folder: str | Path) -> dict[str, Any]:
    """``status --json``'s ``eval`` key: the score rows, the quantized models and, per quantized model and
    task/metric, its score beside the unquantized one of the same iteration."""
    rows = eval_rows(folder)
    plain = {(r["iteration"], r["task"], r["metric"]): r["value"] for r in rows if r["model"] == "unquantized"}
    deltas = []
    for r in rows:
        base = plain.get((r["iteration"], r["task"], r["metric"]))
        if r["model"] != "unquantized" and base is not None:
            deltas.append({"model": r["model"], "iteration": r["iteration"], "task": r["task"],
                           "metric": r["metric"], "unquantized": base, "quantized": r["value"],
                           "delta": r["value"] - base})
    return {"results": rows, "quantized": quantized_models(folder), "score_deltas": deltas}


def table_lines(folder: str | Path) -> list[str]:
    """The lines ``status`` prints: one per score, then one per quantized model (sizes and score delta)."""
    info = summary(folder)
    lines = []
    for r in info["results"]:
        err = f" ± {r['stderr']:.4f}" if r["stderr"] is not None else ""
        it = r["iteration"] if r["iteration"] is not None else "-"
        lim = f" (limit {r['limit']})" if r.get("limit") else ""
        lines.append(f"eval     iter {it} {r['model']} {r['task']} {r['metric']} {r['value']:.4f}{err}{lim}")
    for q in info["quantized"]:
        lines.append(f"quantize {q['scheme']} iter {q.get('iteration')}: linear weights "
                     f"{q['linear_bytes_after']:,} B = {100 * q['ratio_vs_bf16']:.1f} % of bf16's "
                     f"{q['linear_bytes_bf16']:,} B; folder {q['folder_bytes_before']:,} -> "
                     f"{q['folder_bytes_after']:,} B")
    for d in info["score_deltas"]:
        lines.append(f"quantize {d['model']} iter {d['iteration']} {d['task']} {d['metric']}: "
                     f"{d['unquantized']:.4f} -> {d['quantized']:.4f} ({d['delta']:+.4f})")
    return lines


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None
