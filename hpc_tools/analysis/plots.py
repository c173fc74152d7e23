"""PNG plots of an analysis (matplotlib, Agg backend: no display needed). Each function returns the files it wrote.

Layout rules every plot follows (``layout_problems`` checks them; the tests run it on every figure):
- legends sit outside the axes (right of them, inside the figure: constrained layout makes room), never over the
  data, never cut; one entry per name;
- series are named by their short labels (``analysis.labels``: only what varies across the runs);
- repeats of one configuration are one line with a band (their min-max) or one bar with an error bar;
- only a scaling series (runs that differ in scale alone, ``analysis.scaling``) is drawn against the GPU count.
"""

from __future__ import annotations

import re
import textwrap
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from hpc_tools.analysis.analyze import Analysis
from hpc_tools.analysis.labels import short_name

MAX_HEATMAPS = 4
MAX_BAR_GROUPS = 24  # configurations shown in a bar chart (the tables carry every run)
GB = 1e9
DPI = 110
_kept: list[list] = []  # one list of (figure, path) per active ``kept()``, innermost last
_saved: set[int] = set()  # ids of kept figures laid out by their save (drawn at the figure's own dpi)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextmanager
def kept():
    """Keep the figures the plots make open, as [(figure, path)], e.g. to check their layout; closed on exit."""
    import matplotlib

    mine: list = []
    _kept.append(mine)
    try:
        with matplotlib.rc_context({"figure.max_open_warning": 0}):  # kept open on purpose
            yield mine
    finally:
        _kept.remove(mine)
        plt = _plt()
        for fig, _ in mine:
            _saved.discard(id(fig))
            plt.close(fig)


def _figure(width: float = 7.6, height: float = 4.2, ncols: int = 1, nrows: int = 1):
    fig = _plt().figure(figsize=(width, height), layout="constrained", dpi=DPI)
    axes = fig.subplots(nrows, ncols)
    return fig, axes


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi="figure")
    if _kept:
        _kept[-1].append((fig, path))
        _saved.add(id(fig))
    else:
        _plt().close(fig)
    return path


def _finish(fig, ax, path: Path, xlabel: str | None, ylabel: str, title: str, title_size: int = 10,
            grid: bool = True, extra: list | None = None) -> list[Path]:
    """The ending of a one-axes plot: axis labels, title, a light grid, the legend right of the axes, saved to
    ``path`` (returned as the plot's list of files)."""
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    if grid:
        ax.grid(alpha=0.3)
    _legend(fig, ax, extra=extra)
    return [_save(fig, path)]


def _legend(fig, axes=None, title: str | None = None, extra: list | None = None) -> None:
    """One legend right of the axes, each name once (``extra``: (handle, label) pairs appended, e.g. line styles)."""
    seen: dict[str, object] = {}
    for ax in (axes if isinstance(axes, (list, tuple, np.ndarray)) else [axes or fig.axes[0]]):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label and not label.startswith("_"):
                seen.setdefault(label, handle)
    for handle, label in extra or []:
        seen.setdefault(label, handle)
    if not seen:
        return
    fig.legend(list(seen.values()), list(seen), loc="outside right upper", fontsize=8, title=title,
               title_fontsize=8, ncol=1 if len(seen) <= 14 else 2, frameon=False)


def _colors(n: int) -> list:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def groups(a: Analysis) -> list[tuple[str, list[str]]]:
    """(label, run ids) per configuration, in the labels' natural order: repeats of a configuration are one group."""
    runs = a.runs
    if runs.empty:
        return []
    if "group" not in runs:  # an analysis made without labels: every run its own group
        return [(str(r.run_id)[-22:], [r.run_id]) for r in runs.itertuples()]
    out: dict[int, tuple[str, list[str]]] = {}
    for r in runs.itertuples():
        out.setdefault(int(r.group), (str(r.short_label), []))[1].append(r.run_id)
    return sorted(out.values(), key=lambda g: _natural(g[0]))


def _natural(text: str) -> list:
    """Sort key that orders numbers by value: "hidden=64" before "hidden=128"."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part]


def _band(ax, steps: pd.DataFrame, run_ids: list[str], x: str, y: str, color, label: str | None, lo: str | None = None,
          hi: str | None = None, **style) -> bool:
    """The mean over ``run_ids`` of ``y`` against ``x``, with the band from their min to their max (or from the
    ``lo``/``hi`` columns' min and max, e.g. the ranks' range). False when no run has the column."""
    if y not in steps:
        return False
    part = steps[steps["run_id"].isin(run_ids)].dropna(subset=[y])
    if part.empty:
        return False
    by = part.groupby(x)
    mean = by[y].mean()
    ax.plot(mean.index, mean.to_numpy(), color=color, label=label, **style)
    low = by[lo].min() if lo in part else by[y].min()
    high = by[hi].max() if hi in part else by[y].max()
    if (high - low).abs().max() > 0:
        ax.fill_between(mean.index, low.to_numpy(), high.to_numpy(), color=color, alpha=0.2, lw=0)
    return True


def _series_names(a: Analysis) -> list[str]:
    """A name per scaling series: what its runs' short labels have in common (the label less the scale, e.g.
    ``hidden=128``), else the series keys that differ between the series; then the scaling kind."""
    if not a.scaling:
        return []
    labels = dict(zip(a.runs["run_id"], a.runs["short_label"])) if "short_label" in a.runs else {}
    keys = [k for k in a.scaling[0].series if len({str(s.series.get(k)) for s in a.scaling}) > 1]
    names = []
    for s in a.scaling:
        words = [str(labels.get(r, "")).split() for r in s.run_ids]
        common = " ".join(w for w in words[0] if all(w in other for other in words[1:])) if words else ""
        if len(a.scaling) > 1 and not common:
            common = " ".join(f"{short_name(k)}={s.series.get(k)}" for k in keys)
        names.append(f"{common} ({s.kind})" if common else f"{s.kind} scaling")
    return names


def _gpu_axis(ax, a: Analysis) -> None:
    """GPU counts on a log-2 axis, labelled with the measured counts as plain numbers."""
    from matplotlib.ticker import NullFormatter

    ax.set_xscale("log", base=2)
    counts = sorted({int(n) for s in a.scaling for n in s.table["world_size"]})
    ax.set_xticks(counts, [str(n) for n in counts])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _bars(mid, lo, hi) -> np.ndarray:
    """Asymmetric error bars (2 x N) from a range around a value."""
    mid, lo, hi = (np.asarray(v, dtype=float) for v in (mid, lo, hi))
    return np.vstack([np.clip(mid - lo, 0, None), np.clip(hi - mid, 0, None)])


def throughput(a: Analysis, out: Path) -> list[Path]:
    """Tokens/s vs GPUs per scaling series, error bars from its fastest to its slowest repeat, with the ideal (linear
    from the smallest run) line. Runs outside any series are not drawn (the report lists them in a table)."""
    series = [(s, name) for s, name in zip(a.scaling, _series_names(a)) if not s.table["tokens_per_s"].isna().all()]
    if not series:
        return []
    fig, ax = _figure()
    for i, (s, name) in enumerate(series):
        t = s.table
        bars = ax.errorbar(t["world_size"], t["tokens_per_s"], yerr=_bars(t["tokens_per_s"], t["tokens_per_s_lo"],
                                                                          t["tokens_per_s_hi"]),
                           marker="o", capsize=3, label=f"measured, {name}")
        base = t["tokens_per_s"].iloc[0] / t["world_size"].iloc[0]
        ax.plot(t["world_size"], base * t["world_size"], "--", color=bars[0].get_color(), alpha=0.6, lw=1,
                label="ideal (linear)" if i == 0 else "_ideal")
    _gpu_axis(ax, a)
    return _finish(fig, ax, out / "throughput_vs_gpus.png", "GPUs (ranks)", "tokens / s",
                   "Throughput vs GPUs (bars: fastest-slowest repeat)")


def _fit_curve(ax, s, color, name: str) -> None:
    """The fitted law over the measured GPU counts only, with the band its interval gives; a fit that does not stand
    is named in the legend (the report's scaling section says why) and not drawn."""
    fit, t = s.fit, s.table
    if fit is None:
        return
    if not fit.ok:
        ax.plot([], [], " ", label=f"{name}: no {fit.model.capitalize()} fit\n({fit.gpu_counts} GPU counts; "
                                   "why: see the report)")  # a legend line, no curve
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
            label=f"{name}: {fit.model.capitalize()} fit\n{sym}={fit.serial_fraction:.3f} [{lo:.3f}, {hi:.3f}], "
                  f"R^2 {fit.r2:.3f}")
    ax.fill_between(n, curve[1], curve[2], color=color, alpha=0.15, lw=0)


def efficiency(a: Analysis, out: Path) -> list[Path]:
    """Parallel efficiency per scaling series with its run-to-run spread (error bars) and the fitted law (with its
    95 % band) where the fit stands."""
    if not a.scaling:
        return []
    fig, ax = _figure()
    top = 1.1
    for s, name in zip(a.scaling, _series_names(a)):
        t = s.table
        bars = ax.errorbar(t["world_size"], t["efficiency"], yerr=_bars(t["efficiency"], t["efficiency_lo"],
                                                                        t["efficiency_hi"]),
                           marker="o", capsize=3, label=name)
        _fit_curve(ax, s, bars[0].get_color(), name)
        top = max(top, float(np.nanmax(t["efficiency_hi"])) * 1.05)
    ax.axhline(1.0, color="grey", ls="--", lw=1)
    _gpu_axis(ax, a)
    ax.set_ylim(0, top)
    return _finish(fig, ax, out / "efficiency_vs_gpus.png", "GPUs (ranks)", "parallel efficiency",
                   "Scaling efficiency (bars: fastest-slowest repeat)")


CHARS_PER_INCH = 13  # 7-point tick labels, with a gap between neighbours


def _ticks(ax, labels: list[str]) -> None:
    """Category labels that do not overprint: wrapped to the width each category has on the axes (at most three
    lines), slanted where even that does not fit."""
    ax.set_xticks(range(len(labels)))
    fig = ax.get_figure()
    width_in = fig.get_figwidth() * ax.get_position().width
    slot = max(4, int(width_in / max(len(labels), 1) * CHARS_PER_INCH))
    wrapped = [textwrap.wrap(t, slot, break_long_words=False) or [""] for t in labels]
    fits = all(len(lines) <= 3 and max(len(x) for x in lines) <= slot for lines in wrapped)
    if fits:
        ax.set_xticklabels(["\n".join(lines) for lines in wrapped], fontsize=7)
    else:
        ax.set_xticklabels(["\n".join(textwrap.wrap(t, 24)[:2]) for t in labels], fontsize=7, rotation=35,
                           ha="right", rotation_mode="anchor")


def breakdown(a: Analysis, out: Path) -> list[Path]:
    """Median step time per configuration (mean over its repeats, error bar: fastest-slowest repeat) split into data
    loading, communication, pipeline bubble and the rest."""
    runs = a.runs.dropna(subset=["step_time_median_s"]) if not a.runs.empty else a.runs
    if runs.empty:
        return []
    rows = []
    for label, ids in groups(a)[:MAX_BAR_GROUPS]:
        g = runs[runs["run_id"].isin(ids)]
        if g.empty:
            continue
        total = g["step_time_median_s"]
        rows.append({"label": label, "total": total.mean(), "lo": total.min(), "hi": total.max(),
                     **{col: (g[col].fillna(0) * total).mean() for col in ("data_share", "comm_share",
                                                                             "bubble_share") if col in g}})
    table = pd.DataFrame(rows)
    fig, ax = _figure(width=max(7.6, 0.55 * len(table) + 4.5), height=4.6)
    x = np.arange(len(table))
    bottom = np.zeros(len(table))
    for (name, col), color in zip((("data loading", "data_share"), ("communication", "comm_share"),
                                   ("pipeline bubble", "bubble_share")), ("tab:blue", "tab:orange", "tab:green")):
        values = table[col].fillna(0).to_numpy() if col in table else np.zeros(len(table))
        if values.any():  # a part no run measured is left out of the bars and the legend
            ax.bar(x, values, bottom=bottom, label=name, color=color)
            bottom += values
    rest = np.clip(table["total"].to_numpy() - bottom, 0, None)
    ax.bar(x, rest, bottom=bottom, label="compute / other", color="tab:red")
    if (table["hi"] > table["lo"]).any():
        ax.errorbar(x, table["total"], yerr=_bars(table["total"], table["lo"], table["hi"]), fmt="none",
                    ecolor="black", capsize=3, lw=1, label="fastest-slowest repeat")
    _ticks(ax, list(table["label"]))
    return _finish(fig, ax, out / "step_time_breakdown.png", None, "median step time (s)",
                   "Step-time breakdown per configuration", grid=False)


def heatmaps(a: Analysis, out: Path) -> list[Path]:
    """Per-rank step-time heatmaps for the runs with the most ranks (at most MAX_HEATMAPS); the colour scale spans the
    bins without warm-up steps (``heat_limits``), slower bins show at its top colour."""
    if not a.heatmaps:
        return []
    sizes = dict(zip(a.runs["run_id"], a.runs["world_size"]))
    labels = dict(zip(a.runs["run_id"], a.runs["short_label"])) if "short_label" in a.runs else {}
    chosen = sorted(a.heatmaps, key=lambda r: -int(sizes.get(r, 0) or 0))[:MAX_HEATMAPS]
    files = []
    for i, run_id in enumerate(chosen):
        grid, edges, ranks = a.heatmaps[run_id]
        fig, ax = _figure(height=max(2.6, min(8.0, 0.25 * len(ranks) + 1.8)))
        limits = heat_limits(a, run_id, edges, grid)
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                       extent=(edges[0], edges[-1], len(ranks) - 0.5, -0.5),
                       **({"vmin": limits[0], "vmax": limits[1]} if limits else {}))
        fig.colorbar(im, ax=ax, label="mean step time (s)" + ("\n(scale without warm-up)" if limits else ""),
                     extend="max" if limits else "neither")
        ax.set_xlabel("step")
        ax.set_ylabel("rank")
        ax.set_title(f"Step time per rank: {labels.get(run_id, '')} ({run_id})", fontsize=9)
        files.append(_save(fig, out / f"heatmap_{i}.png"))
    return files


def heat_limits(a: Analysis, run_id: str, edges: np.ndarray, grid: np.ndarray) -> tuple[float, float] | None:
    """The heatmap's colour range over the bins that hold no warm-up step (the first steps of every start would set
    the scale and flatten the rest); None when every bin holds one."""
    steps = a.steps[a.steps["run_id"] == run_id] if not a.steps.empty else a.steps
    if steps.empty or "warmup" not in steps:
        return None
    warm = steps.loc[steps["warmup"].astype(bool), "step"].to_numpy()
    bins = np.clip(np.searchsorted(edges, warm, side="right") - 1, 0, grid.shape[1] - 1)
    keep = np.ones(grid.shape[1], dtype=bool)
    keep[bins] = False
    values = grid[:, keep]
    if not keep.any() or np.isnan(values).all():
        return None
    return float(np.nanmin(values)), float(np.nanmax(values))


def _has(a: Analysis, col: str) -> bool:
    return not a.steps.empty and col in a.steps and not a.steps[col].isna().all()


def loss(a: Analysis, out: Path) -> list[Path]:
    """Training loss per step, one line per configuration (band: min-max over its repeats), and the validation loss
    at the evaluation steps (dashed, same colour) where the records carry it."""
    if not _has(a, "loss"):
        return []
    from matplotlib.lines import Line2D

    fig, ax = _figure()
    named = groups(a)
    val = _has(a, "val_loss")
    for color, (label, ids) in zip(_colors(len(named)), named):
        _band(ax, a.steps, ids, "step", "loss", color, label, lw=1)
        if val:
            _band(ax, a.steps, ids, "step", "val_loss", color, None, ls="--", marker=".", ms=4, lw=1)
    styles = [(Line2D([], [], color="black", lw=1), "train"),
              (Line2D([], [], color="black", ls="--", marker=".", lw=1), "validation")] if val else []
    return _finish(fig, ax, out / "loss_curves.png", "step", "loss",
                   "Training and validation loss" if val else "Training loss", extra=styles)


def val_loss_vs_tokens(a: Analysis, out: Path) -> list[Path]:
    """Across a sweep (two or more configurations): validation loss against tokens consumed."""
    named = groups(a)
    if len(named) < 2 or not _has(a, "val_loss") or not _has(a, "tokens"):
        return []
    fig, ax = _figure()
    for color, (label, ids) in zip(_colors(len(named)), named):
        _band(ax, a.steps.dropna(subset=["val_loss", "tokens"]), ids, "tokens", "val_loss", color, label,
              marker=".", ms=4, lw=1)
    return _finish(fig, ax, out / "val_loss_vs_tokens.png", "tokens consumed", "validation loss",
                   "Validation loss vs tokens")


def mfu(a: Analysis, out: Path) -> list[Path]:
    """MFU per step (mean over the ranks), one line per configuration (band: min-max over its repeats)."""
    if not _has(a, "mfu"):
        return []
    fig, ax = _figure()
    named = groups(a)
    for color, (label, ids) in zip(_colors(len(named)), named):
        part = a.steps.assign(mfu_pct=a.steps["mfu"] * 100)
        _band(ax, part, ids, "step", "mfu_pct", color, label, lw=1)
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, out / "mfu_over_steps.png", "step", "MFU (%)", "Model FLOPs utilisation over steps")


MEMORY_KINDS = (("mem_allocated_max_bytes", "allocated (max)"), ("mem_reserved_max_bytes", "reserved (max)"),
                ("rss_bytes", "host RSS"))


def memory_timeline(a: Analysis, out: Path) -> list[Path]:
    """Memory per step, band: the range over the ranks (and repeats). One configuration: allocated, reserved and host
    RSS; several: one line per configuration of the allocated peak (host RSS on CPU ranks)."""
    have = [(col, name) for col, name in MEMORY_KINDS if _has(a, f"{col}_max")]
    if not have:
        return []
    named = groups(a)
    steps = a.steps.copy()
    for col, _ in have:
        for end in ("max", "min"):
            steps[f"{col}_{end}_gb"] = steps[f"{col}_{end}"] / GB
    fig, ax = _figure()
    if len(named) == 1:
        ids = named[0][1]
        for color, (col, name) in zip(_colors(len(have)), have):
            _band(ax, steps, ids, "step", f"{col}_max_gb", color, name, lo=f"{col}_min_gb", hi=f"{col}_max_gb", lw=1)
        title = f"Memory over steps: {named[0][0]} (band: range over ranks)"
    else:
        col, name = have[0]
        for color, (label, ids) in zip(_colors(len(named)), named):
            _band(ax, steps, ids, "step", f"{col}_max_gb", color, label, lo=f"{col}_min_gb", hi=f"{col}_max_gb",
                  lw=1)
        title = f"Memory over steps: {name} (band: range over ranks and repeats)"
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, out / "memory_timeline.png", "step", "GB", title, title_size=9)


def predicted_vs_measured(a: Analysis, out: Path) -> list[Path]:
    """The planner's predicted step time and allocated memory next to the measured ones, per configuration (the
    measured step time's error bar: its p10-p90 over steps, over repeats)."""
    runs = a.runs
    if runs.empty or "predicted_step_time_s" not in runs or runs["predicted_step_time_s"].isna().all():
        return []
    rows = []
    for label, ids in groups(a)[:MAX_BAR_GROUPS]:
        g = runs[runs["run_id"].isin(ids)]
        if g["predicted_step_time_s"].isna().all():
            continue
        rows.append({"label": label, "measured": g["step_time_median_s"].mean(), "lo": g["step_time_p10_s"].min(),
                     "hi": g["step_time_p90_s"].max(), "predicted": g["predicted_step_time_s"].mean(),
                     "mem": g["mem_allocated_peak_bytes"].max() / GB if "mem_allocated_peak_bytes" in g else np.nan,
                     "mem_pred": g["predicted_mem_allocated_bytes"].mean() / GB
                     if "predicted_mem_allocated_bytes" in g else np.nan})
    table = pd.DataFrame(rows)
    with_mem = bool(table["mem"].notna().any() and table["mem_pred"].notna().any())
    stacked = with_mem and len(table) > 6  # many configurations: memory below step time, not beside it
    width = 0.5 * len(table) + 4.5 if stacked or not with_mem else 0.9 * len(table) + 4.5
    fig, axes = _figure(width=max(7.6, width), height=7.6 if stacked else 4.4, ncols=2 if with_mem and not stacked
                        else 1, nrows=2 if stacked else 1)
    axes = list(axes) if with_mem else [axes]
    x, w = np.arange(len(table)), 0.38
    ax = axes[0]
    ax.bar(x - w / 2, table["measured"], w, yerr=_bars(table["measured"], table["lo"], table["hi"]), capsize=3,
           color="tab:blue", label="measured")
    ax.bar(x + w / 2, table["predicted"], w, color="tab:orange", label="predicted (planner)")
    for xi, (m, p) in enumerate(zip(table["measured"], table["predicted"])):
        if m and p and len(table) <= 8:  # more would touch; the runs table has predicted_vs_measured
            ax.annotate(f"{m / p:.2f}x", (xi, max(m, p)), xytext=(0, 3), textcoords="offset points", ha="center",
                        fontsize=7)
    ax.set_ylabel("step time (s)")
    ax.set_title("Step time (measured: median, bar p10-p90)", fontsize=9)
    ax.margins(y=0.12)
    _ticks(ax, list(table["label"]))
    if with_mem:
        ax = axes[1]
        ax.bar(x - w / 2, table["mem"], w, color="tab:blue")
        ax.bar(x + w / 2, table["mem_pred"], w, color="tab:orange")
        ax.set_ylabel("allocated peak per GPU (GB)")
        ax.set_title("Allocated memory peak", fontsize=9)
        _ticks(ax, list(table["label"]))
    _legend(fig, axes)
    return [_save(fig, out / "predicted_vs_measured.png")]


# The plots of this module; the report draws them with those of ``step_plots`` (``step_plots.all_plots``).
PLOTS = (loss, val_loss_vs_tokens, throughput, efficiency, breakdown, predicted_vs_measured, mfu, memory_timeline,
         heatmaps)


def _inside(inner, outer, tol: float = 1.0) -> bool:
    return (inner.x0 >= outer.x0 - tol and inner.y0 >= outer.y0 - tol and inner.x1 <= outer.x1 + tol
            and inner.y1 <= outer.y1 + tol)


def layout_problems(fig) -> list[str]:
    """What breaks the layout rules in a drawn figure (empty when nothing does): a legend or any text outside the
    figure (cut off), a legend over an axes' data area, a name twice in a legend, overlapping tick labels."""
    if id(fig) not in _saved:  # a kept figure was laid out by its save: drawing it again costs as much
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    problems = []
    whole = fig.get_tightbbox(renderer).transformed(fig.dpi_scale_trans)
    if not _inside(whole, fig.bbox, tol=2.0):
        problems.append(f"content {whole.bounds} extends past the figure {fig.bbox.bounds}")
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    for leg in legends:
        box = leg.get_window_extent(renderer)
        if not _inside(box, fig.bbox):
            problems.append(f"legend {box.bounds} outside the figure {fig.bbox.bounds}")
        for ax in fig.axes:
            if box.overlaps(ax.bbox):
                problems.append(f"legend {box.bounds} over the axes {ax.bbox.bounds}")
        texts = [t.get_text() for t in leg.get_texts()]
        if len(texts) != len(set(texts)):
            problems.append(f"legend names repeated: {texts}")
    for ax in fig.axes:
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        for b1, b2 in zip(boxes, boxes[1:]):
            if b1.overlaps(b2):
                problems.append(f"tick labels overlap on {ax.get_title()!r}")
                break
    return problems


def step_waterfall(measured: dict[str, float], planned: dict[str, float], title: str, path: Path) -> list[Path]:
    """One step bucket by bucket, planned beside measured (``analysis.breakdown``): each bucket a bar floating from
    the sum of the buckets before it, so the last bar's top is the step; buckets neither side has are left out."""
    names = [k for k in measured if measured.get(k, 0.0) > 0 or planned.get(k, 0.0) > 0]
    fig, ax = _figure(width=max(6.0, 0.75 * len(names) + 3), height=4.2)
    x = np.arange(len(names))
    w = 0.38
    for offset, values, label, color in ((-w / 2, planned, "planned", "tab:orange"),
                                         (w / 2, measured, "measured", "tab:blue")):
        heights = np.array([values.get(k, 0.0) for k in names])
        bottoms = np.concatenate([[0.0], np.cumsum(heights)[:-1]])
        ax.bar(x + offset, heights, w, bottom=bottoms, color=color, label=label)
    _ticks(ax, names)
    return _finish(fig, ax, path, None, "seconds (cumulative over the step)", title, title_size=9)
