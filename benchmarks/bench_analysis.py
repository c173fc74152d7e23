"""Benchmark: `analyze` over ~10 million step records vs a bare pyarrow read + group-by of the same columns.

    python benchmarks/bench_analysis.py                      # 4 runs x 256 ranks x 10,000 steps = 10.24 M records
    python benchmarks/bench_analysis.py --ranks 32 --steps 2000 --runs 2   # a quick look

Writes synthetic run folders (real schema, parquet per rank) into a temporary folder, then times
1. baseline: for each run, pyarrow reads the analysis columns of every rank file, concatenates them and groups by rank
   (mean of each column) -- the least any analysis must do;
2. analysis: hpc_tools.analysis.analyze.analyse over the same folders (every metric, per-rank stats, per-step
   slowest rank, heatmap bins, scaling fit), without plotting.
Prints both times and their ratio (goal <= 3). Each is the best of --repeat timings (the file cache is warm for both).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpc_tools.analysis.analyze import analyse  # noqa: E402
from hpc_tools.testing.synthetic import synthetic_run  # noqa: E402
from profiling.figures import COLUMNS  # noqa: E402
from profiling.records import rank_files  # noqa: E402


def generate(root: Path, runs: int, ranks: int, steps: int, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(runs):
        gpus_per_node = 8
        nodes = max(ranks // gpus_per_node, 1)
        st = (0.5 + 0.05 * rng.random((ranks, steps))) / (i + 1)
        comm = np.where(np.arange(steps) % 10 == 0, st * 0.2, np.nan)
        run = synthetic_run(root, [f"cluster.nodes={nodes}", f"cluster.gpus_per_node={min(ranks, gpus_per_node)}",
                                   f"training.train_iters={steps}", "training.global_batch_size=1024"],
                            st, loss=np.broadcast_to(np.linspace(8, 3, steps), st.shape).copy(), comm_time_s=comm,
                            data_time_s=st * 0.01, rss_bytes=np.full(st.shape, 2e9),
                            model_flops=np.full(st.shape, 1e15))
        out.append(run.path)
    return out


def baseline(run_dirs: list[Path]) -> int:
    """Read the same columns with pyarrow and group by rank: the floor any analysis pays."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 0
    for run in run_dirs:
        files = rank_files(run / "records")
        table = pa.concat_tables([pq.read_table(p, columns=[c for c in COLUMNS] + ["rank"]) for p in files.values()])
        aggs = [(c, "mean") for c in COLUMNS if c != "rank"]
        table.group_by("rank").aggregate(aggs)
        rows += table.num_rows
    return rows


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_analysis.") as tmp:
        t0 = time.perf_counter()
        dirs = generate(Path(tmp), args.runs, args.ranks, args.steps)
        gen_s = time.perf_counter() - t0
        records = args.runs * args.ranks * args.steps
        size_mb = sum(f.stat().st_size for d in dirs for f in (d / "records").iterdir()) / 1e6
        print(f"records: {records:,} ({args.runs} runs x {args.ranks} ranks x {args.steps} steps), "
              f"{size_mb:.0f} MB parquet, generated in {gen_s:.1f} s")
        base_s = best_of(lambda: baseline(dirs), args.repeat)
        result = {}
        ana_s = best_of(lambda: result.setdefault("a", analyse([str(d) for d in dirs])), args.repeat)
        a = result["a"]
        print(f"baseline pyarrow read + group-by: {base_s:.2f} s ({records / base_s / 1e6:.1f} M records/s)")
        print(f"hpc_tools analyse:                {ana_s:.2f} s ({records / ana_s / 1e6:.1f} M records/s)")
        print(f"ratio analyse / baseline:         {ana_s / base_s:.2f} (goal <= 3)")
        print(f"check: {len(a.runs)} runs, {len(a.ranks)} rank rows, median step times "
              f"{', '.join(f'{x:.3f}' for x in a.runs['step_time_median_s'])} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
