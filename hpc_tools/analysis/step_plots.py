"""The per-step plots users expect beside the loss curve: throughput, learning rate and gradient norm over the steps;
and the per-rank memory as bars. They follow ``plots``' layout rules (and use its helpers)."""

from __future__ import annotations

from pathlib import Path

from hpc_tools.analysis import plots
from hpc_tools.analysis.analyze import Analysis
from hpc_tools.analysis.plots import MAX_BAR_GROUPS, _band, _colors, _figure, _finish, _has, _ticks, groups


def throughput_over_steps(a: Analysis, out: Path) -> list[Path]:
    """Tokens/s per GPU of each step (the run's tokens per step / the slowest rank's step time / the world size),
    one line per configuration (band: its repeats); warm-up steps are left out, as in every figure."""
    if not _has(a, "step_time_s") or "tokens_per_step" not in a.runs:
        return []
    per_run = a.runs.set_index("run_id")
    steps = a.steps[~a.steps["warmup"].astype(bool)] if "warmup" in a.steps else a.steps
    tokens = steps["run_id"].map(per_run["tokens_per_step"] / per_run["world_size"])
    steps = steps.assign(tokens_per_s_per_gpu=tokens / steps["step_time_s"]).dropna(subset=["tokens_per_s_per_gpu"])
    if steps.empty:
        return []
    fig, ax = _figure()
    named = groups(a)
    for color, (label, ids) in zip(_colors(len(named)), named):
        _band(ax, steps, ids, "step", "tokens_per_s_per_gpu", color, label, lw=1)
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, out / "throughput_over_steps.png", "step", "tokens / s per GPU",
                   "Throughput over steps (after warm-up)")


def _over_steps(a: Analysis, out: Path, col: str, name: str, ylabel: str, title: str, log: bool = False
                ) -> list[Path]:
    """One record field per step (mean over the ranks that carry it), one line per configuration."""
    if not _has(a, col):
        return []
    fig, ax = _figure()
    named = groups(a)
    for color, (label, ids) in zip(_colors(len(named)), named):
        _band(ax, a.steps, ids, "step", col, color, label, lw=1)
    if log and (a.steps[col].dropna() > 0).all():
        ax.set_yscale("log")
    return _finish(fig, ax, out / f"{name}.png", "step", ylabel, title)


def learning_rate(a: Analysis, out: Path) -> list[Path]:
    return _over_steps(a, out, "lr", "learning_rate", "learning rate", "Learning rate over steps")


def grad_norm(a: Analysis, out: Path) -> list[Path]:
    return _over_steps(a, out, "grad_norm", "grad_norm", "gradient norm (before clipping)",
                       "Gradient norm over steps", log=True)


def memory_bars(a: Analysis, out: Path) -> list[Path]:
    """Peak memory per rank as bars, ranks side by side within each configuration (the largest over its repeats)."""
    ranks = a.ranks
    if ranks.empty or "peak_mem_gb" not in ranks or ranks["peak_mem_gb"].isna().all():
        return []
    named = groups(a)[:MAX_BAR_GROUPS]
    per_group = [ranks[ranks["run_id"].isin(ids)].groupby("rank")["peak_mem_gb"].max() for _, ids in named]
    most = max((len(g) for g in per_group), default=0)
    fig, ax = _figure(width=max(7.6, 0.12 * most * len(named) + 4.5))
    width = 0.8 / max(most, 1)
    for gi, g in enumerate(per_group):
        for color, (rank, value) in zip(_colors(most), g.items()):
            ax.bar(gi + (int(rank) - (most - 1) / 2) * width, value, width, color=color,
                   label=f"rank {int(rank)}" if most <= 16 else "_rank")
    _ticks(ax, [label for label, _ in named])
    kind = a.runs["peak_mem_kind"].dropna() if "peak_mem_kind" in a.runs else []
    return _finish(fig, ax, out / "memory_per_rank.png", None,
                   f"peak memory (GB, {kind.iloc[0] if len(kind) else 'n/a'})", "Peak memory per rank", grid=False)


PLOTS = (throughput_over_steps, learning_rate, grad_norm)


def all_plots(a: Analysis, out: Path) -> list[Path]:
    """Every plot of the report, in its order: the loss, then throughput, learning rate and gradient norm over steps,
    the rest of ``plots.PLOTS``, the per-rank memory bars before the heatmaps."""
    order = (plots.loss, *PLOTS, *(p for p in plots.PLOTS if p not in (plots.loss, plots.heatmaps)), memory_bars,
             plots.heatmaps)
    files: list[Path] = []
    for plot in order:
        files.extend(plot(a, out))
    return files
