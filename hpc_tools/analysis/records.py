"""Reading step records at scale: one rank file at a time, only the needed columns, aggregated as soon as it is read.

A run's trace (ranks x steps rows) is never held whole: each rank file is reduced to a few numbers (``RankStats``)
plus its contribution to per-step arrays indexed by step (the slowest rank per step, the loss), and a binned
step-time row for the heatmap. Parquet is preferred; a rank whose JSON lines are newer than its parquet (a job killed
after a requeue appended to them) or that has no parquet is read from the JSON lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# Columns the analysis reads when present; every one but step and step_time_s is optional.
COLUMNS = ("step", "step_time_s", "tokens", "data_time_s", "comm_time_s", "pp_wait_s", "loss", "model_flops",
           "tflops_per_gpu", "mfu", "mem_allocated_max_bytes", "rss_bytes")
REQUIRED = ("step", "step_time_s")
HEATMAP_BINS = 100
RANK_FILE_RE = re.compile(r"^rank(\d+)\.(parquet|jsonl)$")


@dataclass
class RankStats:
    """One rank after warm-up: step-time quantiles, time shares, peak memory."""

    rank: int
    steps: int
    step_time_median_s: float
    step_time_p10_s: float
    step_time_p90_s: float
    step_time_mean_s: float
    data_share: float | None
    comm_share: float | None
    bubble_share: float | None
    peak_mem_bytes: float | None
    mem_kind: str | None


@dataclass
class RunRecords:
    """A run's records reduced: per-rank stats and per-step arrays (index = step number)."""

    ranks: list[RankStats] = field(default_factory=list)
    step_time_max_s: np.ndarray = field(default_factory=lambda: np.empty(0))  # slowest rank per step (NaN = none)
    loss_sum: np.ndarray = field(default_factory=lambda: np.empty(0))
    loss_count: np.ndarray = field(default_factory=lambda: np.empty(0))
    tokens_per_step: float | None = None
    model_flops_per_step: float | None = None
    peak_tflops: float | None = None  # implied by the records' own tflops_per_gpu / mfu, when both are present
    heatmap: np.ndarray = field(default_factory=lambda: np.empty((0, 0)))  # ranks x bins, mean step time
    heatmap_edges: np.ndarray = field(default_factory=lambda: np.empty(0))
    heatmap_ranks: list[int] = field(default_factory=list)
    warmup_steps: int = 0
    source_files: int = 0


def rank_files(records_dir: Path) -> dict[int, Path]:
    """rank -> the file to read (parquet unless the JSON lines are newer or alone)."""
    found: dict[int, dict[str, Path]] = {}
    if not records_dir.is_dir():
        return {}
    for path in records_dir.iterdir():
        m = RANK_FILE_RE.match(path.name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = path
    out = {}
    for rank, kinds in found.items():
        pq_path, js_path = kinds.get("parquet"), kinds.get("jsonl")
        if pq_path and (js_path is None or pq_path.stat().st_mtime >= js_path.stat().st_mtime):
            out[rank] = pq_path
        else:
            out[rank] = js_path
    return dict(sorted(out.items()))


def read_columns(path: Path) -> dict[str, np.ndarray]:
    """The wanted columns of one rank file as float arrays (absent optional columns are simply missing)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        present = set(pf.schema_arrow.names)
        names = [c for c in COLUMNS if c in present]
        table = pf.read(columns=names)
        return {c: table.column(c).to_numpy(zero_copy_only=False).astype(np.float64, copy=False) for c in names}
    from profiling.records import read_jsonl

    rows = list(read_jsonl(path))
    present = [c for c in COLUMNS if any(c in r for r in rows[:1] + rows[-1:])]
    return {c: np.array([np.nan if r.get(c) is None else r[c] for r in rows], dtype=np.float64) for c in present}


def _dedupe_last(cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Keep the last record of each step: a requeued job re-runs the steps after its checkpoint and appends them."""
    steps = cols["step"]
    if steps.size < 2 or np.all(np.diff(steps) > 0):
        return cols
    rev = steps[::-1]
    _, first_in_rev = np.unique(rev, return_index=True)
    keep = np.sort(steps.size - 1 - first_in_rev)
    return {k: v[keep] for k, v in cols.items()}


def _share(cols: dict[str, np.ndarray], name: str, step_time: np.ndarray) -> float | None:
    """sum(part) / sum(step time) over the steps where the part was measured (communication is sampled)."""
    part = cols.get(name)
    if part is None:
        return None
    ok = ~np.isnan(part)
    total = step_time[ok].sum()
    return float(part[ok].sum() / total) if ok.any() and total > 0 else None


def _peak_memory(cols: dict[str, np.ndarray]) -> tuple[float | None, str | None]:
    for name, kind in (("mem_allocated_max_bytes", "gpu_allocated"), ("rss_bytes", "host_rss")):
        values = cols.get(name)
        if values is not None and not np.all(np.isnan(values)):
            return float(np.nanmax(values)), kind
    return None, None


def rank_stats(rank: int, cols: dict[str, np.ndarray], warmup: int) -> RankStats | None:
    keep = cols["step"] > warmup
    st = cols["step_time_s"][keep]
    if st.size == 0:
        return None
    p10, p50, p90 = np.percentile(st, (10, 50, 90))
    sub = {k: v[keep] for k, v in cols.items()}
    mem, kind = _peak_memory(cols)
    return RankStats(rank=rank, steps=int(st.size), step_time_median_s=float(p50), step_time_p10_s=float(p10),
                     step_time_p90_s=float(p90), step_time_mean_s=float(st.mean()),
                     data_share=_share(sub, "data_time_s", st), comm_share=_share(sub, "comm_time_s", st),
                     bubble_share=_share(sub, "pp_wait_s", st), peak_mem_bytes=mem, mem_kind=kind)


def _grow(arr: np.ndarray, size: int, fill: float) -> np.ndarray:
    if arr.size >= size:
        return arr
    out = np.full(size, fill)
    out[: arr.size] = arr
    return out


def _median_or_none(values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    values = values[~np.isnan(values)]
    return float(np.median(values)) if values.size else None


def read_run(records_dir: Path, warmup: int, max_step: int | None = None) -> RunRecords:
    """Reduce every rank file of a run; ``max_step`` (train_iters) sizes the per-step arrays and heatmap bins."""
    out = RunRecords(warmup_steps=warmup)
    files = rank_files(Path(records_dir))
    heat_rows: list[np.ndarray] = []
    tokens, flops, peaks = [], [], []
    for rank, path in files.items():
        cols = read_columns(path)
        if any(c not in cols for c in REQUIRED) or cols["step"].size == 0:
            continue
        out.source_files += 1
        cols = _dedupe_last(cols)
        steps = cols["step"].astype(np.int64)
        n = int(max(steps.max(), max_step or 0)) + 1
        out.step_time_max_s = _grow(out.step_time_max_s, n, np.nan)
        _fmax_into(out.step_time_max_s, steps, cols["step_time_s"])
        loss = cols.get("loss")
        if loss is not None and not np.all(np.isnan(loss)):
            out.loss_sum, out.loss_count = _grow(out.loss_sum, n, 0.0), _grow(out.loss_count, n, 0.0)
            ok = ~np.isnan(loss)
            out.loss_sum[steps[ok]] += loss[ok]  # steps are unique after dedupe: plain indexing is exact
            out.loss_count[steps[ok]] += 1.0
        stats = rank_stats(rank, cols, warmup)
        if stats is not None:
            out.ranks.append(stats)
        after = steps > warmup
        tokens.append(_median_or_none(cols["tokens"][after] if "tokens" in cols else None))
        flops.append(_median_or_none(cols["model_flops"][after] if "model_flops" in cols else None))
        if "tflops_per_gpu" in cols and "mfu" in cols:
            with np.errstate(divide="ignore", invalid="ignore"):
                peaks.append(_median_or_none(cols["tflops_per_gpu"] / cols["mfu"]))
        heat_rows.append(_heatmap_row(out, steps, cols["step_time_s"], max_step))
        out.heatmap_ranks.append(rank)
    out.tokens_per_step = _first(tokens)
    out.model_flops_per_step = _first(flops)
    out.peak_tflops = _first(peaks)
    if heat_rows:
        out.heatmap = np.vstack(heat_rows)
    return out


def _fmax_into(target: np.ndarray, steps: np.ndarray, values: np.ndarray) -> None:
    """target[steps] = fmax(target[steps], values); steps are unique after dedupe, so plain indexing is exact."""
    target[steps] = np.fmax(target[steps], values)


def _first(values: list[float | None]) -> float | None:
    return next((v for v in values if v is not None), None)


def _heatmap_row(out: RunRecords, steps: np.ndarray, step_time: np.ndarray, max_step: int | None) -> np.ndarray:
    """Mean step time of one rank per step bin; the bins (at most HEATMAP_BINS) are fixed by the first rank read."""
    if out.heatmap_edges.size == 0:
        last = int(max(max_step or 0, int(steps.max())))
        bins = min(HEATMAP_BINS, max(last, 1))
        out.heatmap_edges = np.linspace(1, last + 1, bins + 1)
    bins = out.heatmap_edges.size - 1
    idx = np.clip(np.searchsorted(out.heatmap_edges, steps, side="right") - 1, 0, bins - 1)
    sums = np.bincount(idx, weights=step_time, minlength=bins)
    counts = np.bincount(idx, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
