"""Strong and weak scaling over a sweep, Amdahl and Gustafson fits, and a projection to larger GPU counts.

Runs are grouped into series that differ only in the number of GPUs (same tensor/pipeline sizes, micro batch,
backend). In a series, global batch fixed = strong scaling; global batch / GPUs fixed = weak scaling.

- Strong: speedup(n) = T(n0) / T(n) with T the median step time (mean over repeats), ideal n / n0,
  efficiency = speedup / ideal. Amdahl: T(n) = T1 (f + (1 - f) / n) is linear in 1/n, so f comes from a weighted
  least-squares line T = a + b / n (weights 1/T^2: equal relative errors), f = a / (a + b).
- Weak: efficiency(n) = T(n0) / T(n); scaled speedup S(n) = n T(n0) / T(n) (work grows with n; exact Gustafson
  speedup when n0 = 1). Gustafson: S(n) = n - s (n - 1); s from least squares on (n - S) = s (n - 1).
- Karp-Flatt (strong): e(n) = (1/S - 1/n) / (1 - 1/n), the experimentally determined serial fraction per point.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

SERIES_KEYS = ("backend", "tensor_size", "pipeline_size", "virtual_pipeline_size", "micro_batch_size", "seq_length")


@dataclass(frozen=True, slots=True)
class AmdahlFit:
    serial_fraction: float
    t1_s: float  # extrapolated step time on one GPU
    r2: float

    def step_time_s(self, n: np.ndarray | float) -> np.ndarray | float:
        return self.t1_s * (self.serial_fraction + (1 - self.serial_fraction) / np.asarray(n, dtype=float))

    def speedup(self, n, n0: float = 1.0):
        """Speedup over n0 GPUs."""
        return self.step_time_s(n0) / self.step_time_s(n)


def fit_amdahl(gpus: np.ndarray, step_time_s: np.ndarray) -> AmdahlFit:
    """Serial fraction f of T(n) = T1 (f + (1-f)/n) by weighted least squares (needs 2+ distinct GPU counts)."""
    n, t = np.asarray(gpus, dtype=float), np.asarray(step_time_s, dtype=float)
    if np.unique(n).size < 2:
        raise ValueError("an Amdahl fit needs runs at two or more GPU counts")
    x = np.column_stack([np.ones_like(n), 1.0 / n])
    w = 1.0 / t
    (a, b), *_ = np.linalg.lstsq(x * w[:, None], t * w, rcond=None)
    pred = a + b / n
    ss_res = float(((t - pred) ** 2).sum())
    ss_tot = float(((t - t.mean()) ** 2).sum())
    return AmdahlFit(serial_fraction=float(a / (a + b)), t1_s=float(a + b),
                     r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


def fit_gustafson(gpus: np.ndarray, scaled_speedup: np.ndarray) -> float:
    """Serial fraction s of S(n) = n - s (n - 1) by least squares through the origin of (n-1, n-S)."""
    n, s = np.asarray(gpus, dtype=float), np.asarray(scaled_speedup, dtype=float)
    x = n - 1
    if not (x > 0).any():
        raise ValueError("a Gustafson fit needs runs on more than one GPU")
    return float((x * (n - s)).sum() / (x * x).sum())


def series_of(runs: pd.DataFrame) -> list[tuple[dict, pd.DataFrame]]:
    """Runs grouped by everything but the GPU count; each with 2+ GPU counts is a scaling series.

    When one GPU count was reached with different shapes (2 nodes x 1 vs 1 node x 2), the series is split by ranks
    per node: scaling over nodes is then read at a fixed node shape.
    """
    usable = runs[runs["step_time_median_s"].notna()].copy()
    keys = [k for k in SERIES_KEYS if k in usable]
    out = []
    # As text, with one spelling for "not set" (pandas keeps NaN through astype(str)).
    labels = [usable[k].map(lambda v: "none" if pd.isna(v) else str(v)) for k in keys]
    for key, group in usable.groupby(labels, sort=True):
        named = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        named = {k: v for k, v in named.items() if v != "none"}
        shapes = group.groupby("world_size")["ranks_per_node"].nunique()
        parts = group.groupby("ranks_per_node") if (shapes > 1).any() else [(None, group)]
        for rpn, part in parts:
            if part["world_size"].nunique() >= 2:
                out.append(((named | {"ranks_per_node": int(rpn)}) if rpn is not None else named, part))
    return out


def scaling_kind(group: pd.DataFrame, requested: str = "auto") -> str:
    if requested in ("strong", "weak"):
        return requested
    if requested == "none":
        return "none"
    if group["global_batch_size"].nunique() == 1:
        return "strong"
    per_gpu = group["global_batch_size"] / group["world_size"]
    return "weak" if per_gpu.nunique() == 1 else "none"


def scaling_table(group: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Per GPU count: mean step time over repeats with its spread, throughput, speedup and efficiency."""
    agg = group.groupby("world_size").agg(
        nodes=("nodes", "first"), repeats=("run_id", "count"), global_batch_size=("global_batch_size", "first"),
        step_time_s=("step_time_median_s", "mean"), step_time_std_s=("step_time_median_s", "std"),
        step_time_min_s=("step_time_median_s", "min"), step_time_max_s=("step_time_median_s", "max"),
        tokens_per_s=("tokens_per_s", "mean"), tokens_per_s_per_gpu=("tokens_per_s_per_gpu", "mean"),
    ).reset_index().sort_values("world_size")
    agg["step_time_std_s"] = agg["step_time_std_s"].fillna(0.0)
    agg["spread"] = (agg["step_time_max_s"] - agg["step_time_min_s"]) / agg["step_time_s"]
    n0, t0 = float(agg["world_size"].iloc[0]), float(agg["step_time_s"].iloc[0])
    n, t = agg["world_size"].astype(float), agg["step_time_s"]
    agg["ideal_speedup"] = n / n0
    if kind == "strong":
        agg["speedup"] = t0 / t
        agg["efficiency"] = agg["speedup"] / agg["ideal_speedup"]
        s_abs = agg["speedup"] * n0  # speedup over one GPU assuming the base point scales ideally
        with np.errstate(divide="ignore", invalid="ignore"):
            agg["karp_flatt"] = np.where(n > 1, (1 / s_abs - 1 / n) / (1 - 1 / n), np.nan)
    else:
        agg["efficiency"] = t0 / t
        agg["speedup"] = agg["efficiency"] * n / n0  # scaled speedup over the base point
    agg.insert(0, "scaling", kind)
    return agg


def projection(fit_f: float, t1_s: float, base_n: float, tokens_per_step: float | None, gpus: list[int],
               ranks_per_node: int | None) -> pd.DataFrame:
    """Amdahl's prediction at larger GPU counts, beside Gustafson's scaled speedup for the same serial fraction."""
    n = np.asarray(gpus, dtype=float)
    t = t1_s * (fit_f + (1 - fit_f) / n)
    t_base = t1_s * (fit_f + (1 - fit_f) / base_n)
    df = pd.DataFrame({"world_size": n.astype(int), "step_time_s": t, "speedup": t_base / t,
                       "efficiency": (t_base / t) / (n / base_n), "amdahl_limit": 1.0 / fit_f if fit_f > 0 else np.inf,
                       "gustafson_scaled_speedup": n - fit_f * (n - 1)})
    if ranks_per_node:
        df.insert(1, "nodes", df["world_size"] / ranks_per_node)
    if tokens_per_step:
        df["tokens_per_s"] = tokens_per_step / t
    return df


@dataclass
class ScalingResult:
    series: dict
    kind: str
    table: pd.DataFrame
    amdahl: AmdahlFit | None = None
    gustafson_serial: float | None = None
    projection: pd.DataFrame | None = None

    def summary(self) -> dict:
        out = {"series": self.series, "scaling": self.kind, "points": self.table.to_dict(orient="records")}
        if self.amdahl:
            out["amdahl"] = {"serial_fraction": self.amdahl.serial_fraction, "t1_s": self.amdahl.t1_s,
                             "r2": self.amdahl.r2, "max_speedup": 1 / self.amdahl.serial_fraction
                             if self.amdahl.serial_fraction > 0 else None}
        if self.gustafson_serial is not None:
            out["gustafson"] = {"serial_fraction": self.gustafson_serial}
        if self.projection is not None:
            out["projection"] = self.projection.to_dict(orient="records")
        return out


def analyse_scaling(runs: pd.DataFrame, requested: str = "auto", project_factors=(2, 4, 8, 16)) -> list[ScalingResult]:
    """Every scaling series in a table of runs (one row per run, from metrics.run_metrics)."""
    results = []
    for key, group in series_of(runs):
        kind = scaling_kind(group, requested)
        if kind == "none":
            continue
        table = scaling_table(group, kind)
        res = ScalingResult(series=key, kind=kind, table=table)
        nmax = int(table["world_size"].max())
        targets = [nmax * f for f in project_factors]
        rpn = group["ranks_per_node"].dropna()
        rpn = int(rpn.iloc[0]) if len(rpn) and rpn.nunique() == 1 else None
        if kind == "strong":
            # Fit on every repeat (not the means): the spread weighs in, and one repeat per point still works.
            res.amdahl = fit_amdahl(group["world_size"].to_numpy(), group["step_time_median_s"].to_numpy())
            tokens = group["tokens_per_step"].dropna()
            res.projection = projection(res.amdahl.serial_fraction, res.amdahl.t1_s, float(table["world_size"].iloc[0]),
                                        float(tokens.iloc[0]) if len(tokens) else None, targets, rpn)
        else:
            res.gustafson_serial = fit_gustafson(table["world_size"].to_numpy() / table["world_size"].iloc[0],
                                                 table["speedup"].to_numpy())
            s = res.gustafson_serial
            if 0.0 <= s <= 1.0:  # outside it Gustafson's model does not describe the runs: no projection
                n = np.asarray(targets, dtype=float) / float(table["world_size"].iloc[0])
                res.projection = pd.DataFrame({"world_size": targets, "scaled_speedup": n - s * (n - 1),
                                               "efficiency": (n - s * (n - 1)) / n})
        results.append(res)
    return results
