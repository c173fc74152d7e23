"""PNG plots of an analysis (matplotlib, Agg backend: no display needed). Each function returns the files it wrote."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from hpc_tools.analysis.analyze import Analysis

MAX_HEATMAPS = 4


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _short(run_id: str, label: str | None) -> str:
    return label or run_id[-22:]


def _series_name(s) -> str:
    return ", ".join(f"{k}={v}" for k, v in s.series.items() if k in ("tensor_size", "pipeline_size")) or "runs"


def _bars(mid, lo, hi) -> np.ndarray:
    """Asymmetric error bars (2 x N) from a range around a value."""
    mid, lo, hi = (np.asarray(v, dtype=float) for v in (mid, lo, hi))
    return np.vstack([np.clip(mid - lo, 0, None), np.clip(hi - mid, 0, None)])


def throughput(a: Analysis, out: Path) -> list[Path]:
    """Tokens/s vs GPUs per scaling series, error bars from its fastest to its slowest repeat, each with its ideal
    (linear from the smallest run) line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drawn = False
    for s in a.scaling:
        t = s.table
        if t["tokens_per_s"].isna().all():
            continue
        ax.errorbar(t["world_size"], t["tokens_per_s"], yerr=_bars(t["tokens_per_s"], t["tokens_per_s_lo"],
                                                                   t["tokens_per_s_hi"]),
                    marker="o", capsize=3, label=f"measured ({s.kind}; {_series_name(s)}; bars: run-to-run spread)")
        base = t["tokens_per_s"].iloc[0] / t["world_size"].iloc[0]
        ax.plot(t["world_size"], base * t["world_size"], "--", color="grey", label="ideal (linear)")
        drawn = True
    if not drawn:
        runs = a.runs.dropna(subset=["tokens_per_s"])
        if runs.empty:
            plt.close(fig)
            return []
        ax.plot(runs["world_size"], runs["tokens_per_s"], "o", label="runs")
    ax.set_xlabel("GPUs (ranks)")
    ax.set_ylabel("tokens / s")
    ax.set_title("Throughput vs GPUs")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return [_save(fig, out / "throughput_vs_gpus.png")]


def _fit_curve(ax, s, color) -> None:
    """The fitted law over the measured GPU counts only, with the band its interval gives; a fit that does not stand
    is named in the legend with its reason and not drawn."""
    fit, t = s.fit, s.table
    if fit is None:
        return
    if not fit.ok:
        ax.plot([], [], " ", label=textwrap.fill(fit.verdict(), 80))  # a legend line, no curve
        return
    n0 = float(t["world_size"].iloc[0])
    n = np.geomspace(n0, float(t["world_size"].max()), 50)
    lo, hi = fit.interval
    if fit.model == "amdahl":
        curve = [fit.speedup(n, n0, f) / (n / n0) for f in (fit.serial_fraction, hi, lo)]
    else:
        curve = [fit.scaled_speedup(n / n0, v) / (n / n0) for v in (fit.serial_fraction, hi, lo)]
    sym = "f" if fit.model == "amdahl" else "s"
    ax.plot(n, curve[0], ":", color=color,
            label=f"{fit.model.capitalize()} fit {sym}={fit.serial_fraction:.3f} [{lo:.3f}, {hi:.3f}], "
                  f"R^2 {fit.r2:.3f}")
    ax.fill_between(n, curve[1], curve[2], color=color, alpha=0.15, lw=0)


def efficiency(a: Analysis, out: Path) -> list[Path]:
    """Parallel efficiency per scaling series with its run-to-run spread (error bars) and the fitted law (with its
    95 % band) where the fit stands."""
    if not a.scaling:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.2, 4.6))
    top = 1.1
    for s in a.scaling:
        t = s.table
        bars = ax.errorbar(t["world_size"], t["efficiency"], yerr=_bars(t["efficiency"], t["efficiency_lo"],
                                                                        t["efficiency_hi"]),
                           marker="o", capsize=3, label=f"{s.kind} scaling ({_series_name(s)}; bars: run-to-run "
                                                        "spread)")
        _fit_curve(ax, s, bars[0].get_color())
        top = max(top, float(np.nanmax(t["efficiency_hi"])) * 1.05)
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, top)
    ax.set_xlabel("GPUs (ranks)")
    ax.set_ylabel("parallel efficiency")
    ax.set_title("Scaling efficiency")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    return [_save(fig, out / "efficiency_vs_gpus.png")]


def breakdown(a: Analysis, out: Path) -> list[Path]:
    """Median step time per run split into data loading, communication, pipeline bubble and the rest."""
    runs = a.runs.dropna(subset=["step_time_median_s"])
    if runs.empty:
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.4, 0.6 * len(runs) + 2), 4.2))
    # Numbered: two runs may share a layout and GPU count (2 nodes x 1 vs 1 node x 2, or repeats).
    labels = [f"#{i}\n{r.layout.split(' on ')[0] if isinstance(r.layout, str) else ''}\n"
              f"{r.nodes}x{r.ranks_per_node} r{r.repeat}" for i, r in enumerate(runs.itertuples())]
    total = runs["step_time_median_s"].to_numpy()
    parts = {name: runs[col].fillna(0).to_numpy() * total for name, col in
             (("data loading", "data_share"), ("communication", "comm_share"), ("pipeline bubble", "bubble_share"))}
    bottom = np.zeros(len(runs))
    for name, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom += values
    ax.bar(labels, np.clip(total - bottom, 0, None), bottom=bottom, label="compute / other")
    ax.set_ylabel("median step time (s)")
    ax.set_title("Step-time breakdown per layout")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    return [_save(fig, out / "step_time_breakdown.png")]


def memory(a: Analysis, out: Path) -> list[Path]:
    ranks = a.ranks
    if ranks.empty or ranks["peak_mem_gb"].isna().all():
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = dict(zip(a.runs["run_id"], a.runs["label"].fillna("")))
    for run_id, group in ranks.groupby("run_id", sort=False):
        ax.plot(group["rank"], group["peak_mem_gb"], marker="o", ms=3, label=_short(run_id, labels.get(run_id)))
    kind = a.runs["peak_mem_kind"].dropna()
    ax.set_xlabel("rank")
    ax.set_ylabel(f"peak memory (GB, {kind.iloc[0] if len(kind) else 'n/a'})")
    ax.set_title("Peak memory per rank")
    if ranks["run_id"].nunique() <= 12:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return [_save(fig, out / "memory_per_rank.png")]


def heatmaps(a: Analysis, out: Path) -> list[Path]:
    """Per-rank step-time heatmaps for the runs with the most ranks (at most MAX_HEATMAPS)."""
    if not a.heatmaps:
        return []
    plt = _plt()
    sizes = dict(zip(a.runs["run_id"], a.runs["world_size"]))
    chosen = sorted(a.heatmaps, key=lambda r: -int(sizes.get(r, 0) or 0))[:MAX_HEATMAPS]
    files = []
    for i, run_id in enumerate(chosen):
        grid, edges, ranks = a.heatmaps[run_id]
        fig, ax = plt.subplots(figsize=(6.4, max(2.4, min(8.0, 0.25 * len(ranks) + 1.5))))
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(edges[0], edges[-1], len(ranks) - 0.5, -0.5))
        fig.colorbar(im, ax=ax, label="mean step time (s)")
        ax.set_xlabel("step")
        ax.set_ylabel("rank")
        ax.set_title(f"Step time per rank: {run_id}", fontsize=9)
        files.append(_save(fig, out / f"heatmap_{i}.png"))
    return files


def loss(a: Analysis, out: Path) -> list[Path]:
    steps = a.steps
    if steps.empty or steps["loss"].isna().all():
        return []
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = dict(zip(a.runs["run_id"], a.runs["label"].fillna("")))
    for run_id, group in steps.dropna(subset=["loss"]).groupby("run_id", sort=False):
        ax.plot(group["step"], group["loss"], lw=1, label=_short(run_id, labels.get(run_id)))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves")
    if steps["run_id"].nunique() <= 12:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return [_save(fig, out / "loss_curves.png")]


PLOTS = (throughput, efficiency, breakdown, memory, heatmaps, loss)


def all_plots(a: Analysis, out: Path) -> list[Path]:
    files: list[Path] = []
    for plot in PLOTS:
        files.extend(plot(a, out))
    return files
