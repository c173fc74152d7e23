"""The scores ``eval`` and the sizes ``quantize`` wrote under runs' ``eval/`` folders, as the analysis's tables
(read by ``hpc_tools.evaluate.results``; the report's section is ``analysis.evaluation``)."""

from __future__ import annotations

import pandas as pd


def tables(runs: list) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(scores, quantized) over the run folders ``runs`` (``RunFolder``s)."""
    from hpc_tools.evaluate.results import summary

    scores, quantized = [], []
    for run in runs:
        info = summary(run.path)
        scores += [{"run_id": run.run_id, **r} for r in info["results"]]
        deltas = {(d["model"], d["iteration"]): d for d in info["score_deltas"]}
        for q in info["quantized"]:
            d = deltas.get((q["scheme"], q.get("iteration")), {})
            quantized.append({"run_id": run.run_id, **q, **{k: d.get(k) for k in
                                                             ("task", "metric", "unquantized", "quantized", "delta")}})
    return pd.DataFrame(scores), pd.DataFrame(quantized)
