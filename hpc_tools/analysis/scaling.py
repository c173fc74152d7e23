"""Strong and weak scaling over a sweep; Amdahl and Gustafson fits reported only where they mean something.

Runs are grouped into series that differ only in the number of GPUs (same tensor/pipeline sizes, micro batch,
backend, and the rest of the configuration: ``analysis.labels``); the other runs form no series. In a series,
global batch fixed = strong scaling; global batch / GPUs fixed = weak scaling.

- Strong: speedup(n) = T(n0) / T(n) with T the median step time (mean over repeats), ideal n / n0,
  efficiency = speedup / ideal. Amdahl: T(n) = T1 (f + (1 - f) / n) is linear in 1/n: a weighted least-squares line
  T = a + b / n through every repeat (weights 1 / mean T at that GPU count: equal relative errors), f = a / (a + b).
- Weak: efficiency(n) = T(n0) / T(n); scaled speedup S(n) = n T(n0) / T(n) (work grows with n; exact Gustafson
  speedup when n0 = 1). Gustafson: S(n) = n - s (n - 1); s by weighted least squares (weights 1 / n) through the
  origin of (n - 1, n - S), one point per repeat.
- Karp-Flatt (strong): e(n) = (1/S - 1/n) / (1 - 1/n), the serial fraction each point implies; empty where it falls
  outside [0, 1] (super-linear or slower than one GPU: no serial fraction describes it).
- Run-to-run spread at a GPU count: (slowest - fastest repeat) / mean step time.

When a fit stands. Every fitted number comes with its 95 % confidence interval (from the covariance of the
least-squares fit, Student t with the fit's degrees of freedom, the delta method for f) and the fit's R^2 (weighted,
over every repeat, so run-to-run spread counts against it). A fit is reported, and projected beyond the measured GPU
counts, only when all of these hold; otherwise the report says "no fit" and why, and projects nothing:
- more distinct GPU counts than the law has parameters (Amdahl: T1 and f, so 3 or more; Gustafson: s, read from the
  GPU counts beyond the base one, so 3 or more);
- the serial fraction inside its physical range 0 <= f <= 1: a step time that does not fall as GPUs are added, or an
  efficiency above 1 by more than the run-to-run spread (at least SUPERLINEAR_TOL; super-linear), is outside what the
  law describes. Above ideal only within the spread is read as f = 0 (Amdahl: the one-parameter fit T = T1 / n), its
  interval [0, the fit's own t x standard error or more];
- R^2 >= MIN_R2 and the interval of f no wider than MAX_INTERVAL: otherwise the spread between runs swamps the trend.
The projection's speedup and step-time ranges follow the interval of f.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

SERIES_KEYS = ("backend", "tensor_size", "pipeline_size", "virtual_pipeline_size", "micro_batch_size", "seq_length")
MIN_R2 = 0.9  # below this the law explains too little of the measured variation to carry a projection
SUPERLINEAR_TOL = 0.02  # efficiency above 1 by less than this (or the run-to-run spread) is read as ideal
MAX_INTERVAL = 0.25  # the widest 95 % interval of a serial fraction still worth a projection (f in [0, 1])
CONFIDENCE = 0.95
# Two-sided 95 % quantiles of Student's t by degrees of freedom (a table: no scipy dependency); between entries the
# next lower dof is used (a slightly wider, conservative interval), beyond the last the normal 1.96.
_T95 = ((1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (5, 2.571), (6, 2.447), (7, 2.365), (8, 2.306), (9, 2.262),
        (10, 2.228), (12, 2.179), (15, 2.131), (20, 2.086), (25, 2.060), (30, 2.042), (40, 2.021), (60, 2.000),
        (120, 1.980))


def t95(dof: int) -> float:
    """The two-sided 95 % Student t quantile for ``dof`` degrees of freedom (conservative between table entries)."""
    if dof < 1:
        return float("inf")
    if dof > _T95[-1][0]:
        return 1.96
    return next(t for d, t in reversed(_T95) if d <= dof)


@dataclass(frozen=True, slots=True)
class Fit:
    """A scaling law fitted to a series, or why it was not: ``reason`` is None exactly when the fit stands.

    ``serial_fraction`` (Amdahl's f or Gustafson's s) and its 95 % ``interval`` are always inside [0, 1] when set;
    ``t1_s`` (Amdahl only) is the extrapolated one-GPU step time with its interval.
    """

    model: str  # "amdahl" or "gustafson"
    gpu_counts: int  # distinct GPU counts in the series
    runs: int  # points fitted: every repeat at every GPU count
    spread: float | None  # the largest run-to-run spread over the GPU counts; None without repeats
    serial_fraction: float | None = None
    interval: tuple[float, float] | None = None
    r2: float | None = None
    t1_s: float | None = None
    t1_interval: tuple[float, float] | None = None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def step_time_s(self, n, f: float | None = None):
        """Amdahl's step time on n GPUs (``f`` overrides the fitted serial fraction, e.g. an interval end)."""
        f = self.serial_fraction if f is None else f
        return self.t1_s * (f + (1 - f) / np.asarray(n, dtype=float))

    def speedup(self, n, n0: float = 1.0, f: float | None = None):
        """Amdahl's speedup over n0 GPUs."""
        return self.step_time_s(n0, f) / self.step_time_s(n, f)

    def scaled_speedup(self, n, s: float | None = None):
        """Gustafson's scaled speedup over the base GPU count, n in multiples of it."""
        s = self.serial_fraction if s is None else s
        n = np.asarray(n, dtype=float)
        return n - s * (n - 1)

    def verdict(self) -> str:
        """One sentence: the fitted numbers with their intervals and goodness of fit, or "no fit" and why."""
        name = {"amdahl": "Amdahl", "gustafson": "Gustafson"}[self.model]
        if not self.ok:
            return f"{name}: {self.reason}."
        lo, hi = self.interval
        sym = "f" if self.model == "amdahl" else "s"
        text = f"{name}: serial fraction {sym} = {self.serial_fraction:.3f} (95 % interval {lo:.3f}-{hi:.3f})"
        if self.model == "amdahl":
            t_lo, t_hi = self.t1_interval
            text += f", one-GPU step {self.t1_s:.4g} s ({t_lo:.4g}-{t_hi:.4g} s)"
            text += f", speedup limit 1/f = {_limit(self.serial_fraction)} ({_limit(hi)}-{_limit(lo)})"
        return text + f"; R^2 {self.r2:.3f} over {self.runs} runs at {self.gpu_counts} GPU counts{self._spread()}."

    def _spread(self) -> str:
        return f", run-to-run spread up to {self.spread:.0%}" if self.spread is not None else ", no repeats"

    def as_dict(self) -> dict:
        out = asdict(self)
        out["ok"] = self.ok
        out["verdict"] = self.verdict()
        return out


def _limit(f: float) -> str:
    return f"{1 / f:.3g}x" if f > 0 else "unbounded"


def _spread(n: np.ndarray, t: np.ndarray) -> float | None:
    """The largest (max - min) / mean of the repeats at one GPU count; None when no GPU count was repeated."""
    groups = [t[n == k] for k in np.unique(n)]
    spreads = [float((g.max() - g.min()) / g.mean()) for g in groups if g.size > 1]
    return max(spreads) if spreads else None


def _head(k: int, spread: float | None) -> str:
    return f"{k} GPU counts, " + (f"spread {spread:.0%}" if spread is not None else "no repeats")


def _ci(value: float, se: float, dof: int) -> tuple[float, float]:
    half = t95(dof) * se
    return value - half, value + half


def _clip01(lo: float, hi: float) -> tuple[float, float]:
    return max(0.0, lo), min(1.0, hi)


def _weighted_r2(y: np.ndarray, pred: np.ndarray, w: np.ndarray) -> float:
    ybar = float((w * w * y).sum() / (w * w).sum())
    ss_tot = float((w * w * (y - ybar) ** 2).sum())
    ss_res = float((w * w * (y - pred) ** 2).sum())
    return 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)


def _clean(gpus, values) -> tuple[np.ndarray, np.ndarray]:
    n, v = np.asarray(gpus, dtype=float), np.asarray(values, dtype=float)
    ok = np.isfinite(n) & np.isfinite(v) & (n > 0) & (v > 0)
    return n[ok], v[ok]


def fit_amdahl(gpus, step_time_s) -> Fit:
    """Amdahl's T(n) = T1 (f + (1 - f) / n) fitted to every repeat (see the module text for when it stands)."""
    n, t = _clean(gpus, step_time_s)
    scales = np.unique(n)
    k, spread = scales.size, _spread(n, t)
    base = {"model": "amdahl", "gpu_counts": int(k), "runs": int(n.size), "spread": spread}

    def no_fit(why: str) -> Fit:
        return Fit(**base, reason=f"{_head(k, spread)}: no fit ({why})")

    if k < 3:
        return no_fit("Amdahl's law has 2 parameters, T1 and f: fitting them needs 3 or more GPU counts")
    means = {s: t[n == s].mean() for s in scales}
    w = 1.0 / np.array([means[s] for s in n])  # equal relative errors
    x = np.column_stack([np.ones_like(n), 1.0 / n])
    xw = x * w[:, None]
    (a, b), *_ = np.linalg.lstsq(xw, t * w, rcond=None)
    dof = n.size - 2
    first, last = means[scales[0]], means[scales[-1]]
    if b <= 0:
        return no_fit(f"the step time does not fall as GPUs are added, {last / first:.2f}x the {scales[0]:g}-GPU step "
                      f"at {scales[-1]:g} GPUs: no speedup for Amdahl's law to describe")
    eff = np.array([(first / means[c]) / (c / scales[0]) for c in scales])
    if eff.max() > 1 + max(spread or 0.0, SUPERLINEAR_TOL) or a + b <= 0:
        c = scales[int(np.argmax(eff))]
        return no_fit(f"super-linear: efficiency {eff.max():.2f} at {c:g} GPUs, above ideal by more than the "
                      "run-to-run spread, which Amdahl's law cannot describe")
    resid = (t - (a + b / n)) * w
    s2 = float((resid**2).sum()) / dof if dof > 0 else float("inf")
    cov = s2 * np.linalg.inv(xw.T @ xw)
    f = a / (a + b)
    grad = np.array([b, -a]) / (a + b) ** 2  # d f / d (a, b)
    f_se = float(np.sqrt(grad @ cov @ grad))
    f_lo, f_hi = _ci(f, f_se, dof)
    t1, t1_se = a + b, float(np.sqrt(cov.sum()))  # var(a + b)
    pred = a + b / n
    if f < 0:  # above ideal only within the spread: read as f = 0, the one-parameter law T = T1 / n
        f_lo, f_hi = 0.0, max(f_hi, t95(dof) * f_se)  # the interval keeps the fit's uncertainty, anchored at 0
        xw1 = w / n
        t1 = float((xw1 * t * w).sum() / (xw1 * xw1).sum())
        pred = t1 / n
        resid1 = (t - pred) * w
        t1_se = float(np.sqrt((resid1**2).sum() / (n.size - 1) / (xw1 * xw1).sum()))
        f, dof = 0.0, n.size - 1
    lo, hi = _clip01(f_lo, f_hi)
    r2 = _weighted_r2(t, pred, w)
    problems = _quality_problems(r2, "f", lo, hi)
    if problems:
        return no_fit(problems)
    return Fit(**base, serial_fraction=float(f), interval=(lo, hi), r2=r2, t1_s=float(t1),
               t1_interval=_ci(float(t1), t1_se, dof))


def _quality_problems(r2: float, name: str, lo: float, hi: float) -> str:
    """Why a fit that converged still does not stand ("" when it does): it explains too little, or its interval is too
    wide."""
    problems = []
    if r2 < MIN_R2:
        problems.append(f"R^2 {r2:.2f} < {MIN_R2}: the law explains too little of the runs' variation")
    if hi - lo > MAX_INTERVAL:
        problems.append(f"95 % interval of {name} {lo:.2f}-{hi:.2f} is wider than {MAX_INTERVAL}")
    return "; ".join(problems)


def fit_gustafson(gpus, scaled_speedup) -> Fit:
    """Gustafson's S(n) = n - s (n - 1) fitted to every repeat; ``gpus`` in multiples of the base GPU count."""
    n, s_meas = _clean(gpus, scaled_speedup)
    k = np.unique(n).size
    spread = _spread(n, n / s_meas)  # S = n T0 / T: the spread of the step times T / T0 = n / S
    base = {"model": "gustafson", "gpu_counts": int(k), "runs": int(n.size), "spread": spread}

    def no_fit(why: str) -> Fit:
        return Fit(**base, reason=f"{_head(k, spread)}: no fit ({why})")

    beyond = np.unique(n[n > 1]).size
    if beyond < 2:
        return no_fit("Gustafson's s is read from the GPU counts beyond the base one: it needs 3 or more GPU counts")
    x, y, w = n - 1, n - s_meas, 1.0 / n  # S's errors grow with S ~ n: equal relative errors
    sxx = float((w * w * x * x).sum())
    s = float((w * w * x * y).sum()) / sxx
    dof = n.size - 1
    resid = (y - s * x) * w
    s_se = float(np.sqrt((resid**2).sum() / dof / sxx))
    s_lo, s_hi = _ci(s, s_se, dof)
    eff = {c: float((s_meas[n == c] / c).mean()) for c in np.unique(n)}
    c_max = max(eff, key=eff.get)
    if eff[c_max] > 1 + max(spread or 0.0, SUPERLINEAR_TOL):
        return no_fit(f"super-linear: efficiency {eff[c_max]:.2f} at {c_max:g}x the base GPUs, above ideal by more "
                      "than the run-to-run spread, which Gustafson's law cannot describe")
    if s > 1:
        return no_fit(f"the scaled speedup falls below 1, {s_meas[n == n.max()].mean():.2f} at {n.max():g}x the base "
                      "GPUs: adding GPUs loses throughput even at fixed work per GPU")
    if s < 0:  # above ideal only within the spread: read as s = 0 (perfect weak scaling)
        s, s_lo, s_hi = 0.0, 0.0, max(s_hi, t95(dof) * s_se)
    lo, hi = _clip01(s_lo, s_hi)
    r2 = _weighted_r2(s_meas, n - s * x, w)
    problems = _quality_problems(r2, "s", lo, hi)
    if problems:
        return no_fit(problems)
    return Fit(**base, serial_fraction=s, interval=(lo, hi), r2=r2)


def series_of(runs: pd.DataFrame) -> list[tuple[dict, pd.DataFrame]]:
    """Runs grouped by everything but the GPU count; each with 2+ GPU counts is a scaling series.

    When one GPU count was reached with different shapes (2 nodes x 1 vs 1 node x 2), the series is split by ranks
    per node: scaling over nodes is then read at a fixed node shape.
    """
    usable = runs[runs["step_time_median_s"].notna()].copy()
    # config_key (analysis.labels): the whole configuration less its scale, so runs that differ in anything else
    # (model, data, optimiser...) never join one series.
    keys = [k for k in (*SERIES_KEYS, "config_key") if k in usable]
    out = []
    # As text, with one spelling for "not set" (pandas keeps NaN through astype(str)).
    labels = [usable[k].map(lambda v: "none" if pd.isna(v) else str(v)) for k in keys]
    for key, group in usable.groupby(labels, sort=True):
        named = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        named = {k: v for k, v in named.items() if v != "none" and k != "config_key"}
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
    """Per GPU count: mean step time over repeats with its spread, throughput, speedup and efficiency, each with the
    range its fastest and slowest repeat give (``*_lo``, ``*_hi``: the error bars of the plots)."""
    agg = group.groupby("world_size").agg(
        nodes=("nodes", "first"), repeats=("run_id", "count"), global_batch_size=("global_batch_size", "first"),
        step_time_s=("step_time_median_s", "mean"), step_time_std_s=("step_time_median_s", "std"),
        step_time_min_s=("step_time_median_s", "min"), step_time_max_s=("step_time_median_s", "max"),
        tokens_per_s=("tokens_per_s", "mean"), tokens_per_s_lo=("tokens_per_s", "min"),
        tokens_per_s_hi=("tokens_per_s", "max"), tokens_per_s_per_gpu=("tokens_per_s_per_gpu", "mean"),
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
            kf = np.where(n > 1, (1 / s_abs - 1 / n) / (1 - 1 / n), np.nan)
        agg["karp_flatt"] = np.where((kf >= 0) & (kf <= 1), kf, np.nan)  # no serial fraction outside [0, 1]
    else:
        agg["efficiency"] = t0 / t
        agg["speedup"] = agg["efficiency"] * n / n0  # scaled speedup over the base point
    # The fastest and slowest repeat against the base mean.
    agg["efficiency_lo"] = agg["efficiency"] * t / agg["step_time_max_s"]
    agg["efficiency_hi"] = agg["efficiency"] * t / agg["step_time_min_s"]
    agg.insert(0, "scaling", kind)
    return agg


def projection(fit: Fit, base_n: float, tokens_per_step: float | None, gpus: list[int],
               ranks_per_node: int | None) -> pd.DataFrame:
    """Amdahl's prediction at larger GPU counts with the range the interval of f gives, beside Gustafson's scaled
    speedup for the same serial fraction. Only for a fit that stands."""
    assert fit.ok and fit.model == "amdahl", fit
    n = np.asarray(gpus, dtype=float)
    f_lo, f_hi = fit.interval
    speedup = fit.speedup(n, base_n)
    t_base = fit.step_time_s(base_n)
    df = pd.DataFrame({"world_size": n.astype(int), "step_time_s": fit.step_time_s(n),
                       "speedup": speedup, "speedup_lo": fit.speedup(n, base_n, f_hi),
                       "speedup_hi": fit.speedup(n, base_n, f_lo), "efficiency": speedup / (n / base_n),
                       "gustafson_scaled_speedup": fit.scaled_speedup(n)})
    df.insert(2, "step_time_lo_s", t_base / df["speedup_hi"])
    df.insert(3, "step_time_hi_s", t_base / df["speedup_lo"])
    if ranks_per_node:
        df.insert(1, "nodes", df["world_size"] / ranks_per_node)
    if tokens_per_step:
        df["tokens_per_s"] = tokens_per_step / df["step_time_s"]
    return df


@dataclass
class ScalingResult:
    series: dict
    kind: str
    table: pd.DataFrame
    amdahl: Fit | None = None  # strong scaling
    gustafson: Fit | None = None  # weak scaling
    projection: pd.DataFrame | None = None  # only when the fit stands
    run_ids: list[str] = field(default_factory=list)  # the runs of the series

    @property
    def fit(self) -> Fit | None:
        return self.amdahl or self.gustafson

    def summary(self) -> dict:
        out = {"series": self.series, "scaling": self.kind, "points": self.table.to_dict(orient="records")}
        if self.amdahl:
            out["amdahl"] = self.amdahl.as_dict()
        if self.gustafson:
            out["gustafson"] = self.gustafson.as_dict()
        if self.projection is not None:
            out["projection"] = self.projection.to_dict(orient="records")
        return out


def analyse_scaling(runs: pd.DataFrame, requested: str = "auto", project_factors=(2, 4, 8)) -> list[ScalingResult]:
    """Every scaling series in a table of runs (one row per run, from metrics.run_metrics)."""
    results = []
    for key, group in series_of(runs):
        kind = scaling_kind(group, requested)
        if kind == "none":
            continue
        table = scaling_table(group, kind)
        res = ScalingResult(series=key, kind=kind, table=table, run_ids=list(group["run_id"]))
        n0 = float(table["world_size"].iloc[0])
        targets = [int(table["world_size"].max()) * f for f in project_factors]
        rpn = group["ranks_per_node"].dropna()
        rpn = int(rpn.iloc[0]) if len(rpn) and rpn.nunique() == 1 else None
        n, t = group["world_size"].to_numpy(dtype=float), group["step_time_median_s"].to_numpy(dtype=float)
        if kind == "strong":
            # Fit on every repeat (not the means): the run-to-run spread weighs in.
            res.amdahl = fit_amdahl(n, t)
            tokens = group["tokens_per_step"].dropna()
            if res.amdahl.ok:
                res.projection = projection(res.amdahl, n0, float(tokens.iloc[0]) if len(tokens) else None, targets,
                                            rpn)
        else:
            t0 = float(table["step_time_s"].iloc[0])
            res.gustafson = fit_gustafson(n / n0, (n / n0) * t0 / t)  # every repeat's scaled speedup
            if res.gustafson.ok:
                rel = np.asarray(targets, dtype=float) / n0
                scaled = res.gustafson.scaled_speedup(rel)
                lo, hi = res.gustafson.interval
                res.projection = pd.DataFrame({"world_size": targets, "scaled_speedup": scaled,
                                               "scaled_speedup_lo": res.gustafson.scaled_speedup(rel, hi),
                                               "scaled_speedup_hi": res.gustafson.scaled_speedup(rel, lo),
                                               "efficiency": scaled / rel})
        results.append(res)
    return results
