"""Benchmark: `analyze` over 10 M and 100 M step records vs a bare pyarrow scan + group-by of the same columns.

    python benchmarks/bench_analysis.py                                   # 4 runs x 256 ranks x 10,000 steps = 10.24 M
    python benchmarks/bench_analysis.py --runs 1 --ranks 1024 --steps 100000 --data /tmp/bench_analysis_100M
                                                                          # one 1,024-rank x 100k-step run = 102.4 M
    python benchmarks/bench_analysis.py --ranks 32 --steps 2000 --runs 2  # a quick look

Writes synthetic run folders (real run folders, every schema field, one parquet file per rank written directly with
pyarrow) into --data (kept and reused when it already holds the same dataset) or a temporary folder, then measures,
each in a fresh subprocess so that its peak RSS (VmHWM) is its own:
1. baseline: per run, one pyarrow dataset scan of every rank file with the analysis columns (column projection)
   feeding Acero's streaming hash group-by on rank (the mean of each column) -- the least any analysis must do, with
   bounded memory;
2. analysis: hpc_tools.analysis.analyze.analyse over the same folders (every figure of profiling.figures, per-rank
   table, per-step slowest rank and loss, heatmap bins, planner prediction, scaling fit), without plotting.
Baseline and analysis alternate --repeat times; each time is the best of its repeats (the file cache is warm for
both). Prints both times, their ratio (goal <= 1.3) and each side's peak RSS (goal < 2 GB at 100 M records; VmHWM,
the child's own high-water mark).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from profiling.figures import COLUMNS  # noqa: E402
from profiling.records import parquet_path, rank_files, write_parquet  # noqa: E402

MARKER = "bench_analysis.json"


# --- the dataset ------------------------------------------------------------------------------------------------------

def _run_folder(root: Path, nodes: int, gpus_per_node: int, steps: int):
    from hpc_tools.recipe.load import dump_resolved
    from hpc_tools.registry import RunFolder, new_run_id
    from hpc_tools.testing.synthetic import synthetic_recipe

    recipe = synthetic_recipe([f"cluster.nodes={nodes}", f"cluster.gpus_per_node={gpus_per_node}",
                               f"training.train_iters={steps}", "training.global_batch_size=1024"])
    run = RunFolder.create(root, new_run_id(recipe.name), dump_resolved(recipe), "",
                           {"state": "COMPLETED", "world_size": nodes * gpus_per_node, "executor": "synthetic"})
    return run, recipe.training.global_batch_size * recipe.model.seq_length


def generate(root: Path, runs: int, ranks: int, steps: int, seed: int = 0) -> list[Path]:
    """``runs`` run folders of ``ranks`` x ``steps`` records; run i is (i + 1) x faster (a strong-scaling look)."""
    import pyarrow as pa

    from profiling.schema import SCHEMA_VERSION, arrow_schema

    rng = np.random.default_rng(seed)
    schema = arrow_schema()
    step = np.arange(1, steps + 1, dtype=np.int64)
    loss = np.linspace(8, 3, steps)
    sampled = step % 10 == 1  # communication timed on every 10th step
    consts: dict[tuple[str, object], pa.Array] = {}

    def const(name: str, value) -> pa.Array:
        """A column of one value, built once per value (a string column of 100k values costs milliseconds)."""
        key = (name, value)
        if key not in consts:
            field = schema.field(name)
            consts[key] = pa.array(np.full(steps, value, dtype=object if field.type == pa.string() else None),
                                   type=field.type)
        return consts[key]

    out = []
    for i in range(runs):
        gpus_per_node = min(ranks, 8)
        run, tokens = _run_folder(root, max(ranks // gpus_per_node, 1), gpus_per_node, steps)
        for r in range(ranks):
            st = (0.5 + 0.05 * rng.random(steps)) / (i + 1)
            cols = {
                "schema_version": const("schema_version", SCHEMA_VERSION), "run_id": const("run_id", run.run_id),
                "restart": const("restart", 0), "rank": const("rank", r), "node": const("node", f"node{r // 8:04d}"),
                "tp_rank": const("tp_rank", 0), "pp_rank": const("pp_rank", 0), "dp_rank": const("dp_rank", r),
                "step": step, "time": 1.7e9 + np.cumsum(st), "step_time_s": st, "data_time_s": st * 0.01,
                "tokens": const("tokens", tokens), "tokens_per_s": tokens / st,
                "tokens_per_s_per_gpu": tokens / st / ranks, "loss": loss, "model_flops": const("model_flops", 1e15),
                "rss_bytes": const("rss_bytes", 2_000_000_000),
                "comm_time_s": pa.array(np.where(sampled, st * 0.2, np.nan), from_pandas=True),
            }
            arrays = [pa.array(cols[f.name], type=f.type) if f.name in cols else pa.nulls(steps, type=f.type)
                      for f in schema]
            write_parquet(pa.Table.from_arrays(arrays, schema=schema), parquet_path(run.records_dir, r))
        out.append(run.path)
    return out


def dataset(data: Path | None, runs: int, ranks: int, steps: int) -> tuple[list[Path], float]:
    """The run folders (reused from ``data`` when it holds this dataset) and the seconds spent generating them."""
    from profiling.records import DELTA_FIELDS, DICTIONARY_FIELDS

    # The files are rebuilt when the record files' encoding changes (the reader's speed depends on it).
    params = {"runs": runs, "ranks": ranks, "steps": steps, "encoding": [list(DICTIONARY_FIELDS), list(DELTA_FIELDS)]}
    marker = data / MARKER if data else None
    if marker is not None and marker.is_file():
        saved = json.loads(marker.read_text())
        if saved["params"] == params and all(Path(d).is_dir() for d in saved["runs"]):
            return [Path(d) for d in saved["runs"]], 0.0
        shutil.rmtree(data)
    assert data is not None
    data.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dirs = generate(data, runs, ranks, steps)
    gen_s = time.perf_counter() - t0
    marker.write_text(json.dumps({"params": params, "runs": [str(d) for d in dirs]}))
    return dirs, gen_s


# --- the two measured programs (each run in its own subprocess) ---------------------------------------------------

def baseline(run_dirs: list[Path]) -> dict:
    """A pyarrow dataset scan of the analysis columns into Acero's streaming group-by on rank, per run."""
    import pyarrow.acero as ac
    import pyarrow.dataset as ds

    rows = ranks = 0
    for run in run_dirs:
        files = [str(p) for p in rank_files(run / "records").values()]
        dataset = ds.dataset(files, format="parquet")
        wanted = [c for c in COLUMNS if c in dataset.schema.names]  # files of an older schema lack newer columns
        cols = wanted + ["rank"]
        table = ac.Declaration.from_sequence([
            ac.Declaration("scan", ac.ScanNodeOptions(dataset, columns=cols)),
            ac.Declaration("project", ac.ProjectNodeOptions([ds.field(c) for c in cols], cols)),
            ac.Declaration("aggregate", ac.AggregateNodeOptions(
                [(c, "hash_mean", None, c) for c in wanted] + [("step", "hash_count", None, "n")], keys=["rank"])),
        ]).to_table()
        rows += int(np.sum(table.column("n").to_numpy()))
        ranks += table.num_rows
    return {"records": rows, "ranks": ranks}


def analysis(run_dirs: list[Path]) -> dict:
    from hpc_tools.analysis.analyze import analyse

    a = analyse([str(d) for d in run_dirs])
    # Every record read: each rank's measured steps plus its warm-up steps.
    warm = int((a.runs["warmup_steps"] * a.runs["ranks_measured"]).sum())
    return {"records": int(a.ranks["steps_measured"].sum()) + warm,
            "ranks": len(a.ranks), "step_time_median_s": [round(float(x), 4) for x in a.runs["step_time_median_s"]]}


PROGRAMS = {"baseline": baseline, "analysis": analysis}


def measure(kind: str, run_dirs: list[Path]) -> dict:
    """Run one program in a fresh interpreter; its wall time (without start-up and imports) and peak RSS."""
    out = subprocess.run([sys.executable, __file__, "--child", kind, *map(str, run_dirs)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(kind: str, run_dirs: list[Path]) -> None:
    # Imports before the clock (start-up is not what is compared; the RSS counts them).
    import pyarrow.acero  # noqa: F401
    import pyarrow.dataset  # noqa: F401

    if kind == "analysis":
        import hpc_tools.analysis.analyze  # noqa: F401
        import hpc_tools.planner  # noqa: F401
        import hpc_tools.recipe.load  # noqa: F401
    t0 = time.perf_counter()
    result = PROGRAMS[kind](run_dirs)
    wall = time.perf_counter() - t0
    print(json.dumps({"kind": kind, "wall_s": wall, "peak_rss_bytes": peak_rss_bytes(), **result}))


def peak_rss_bytes() -> int:
    """This process's peak RSS. On Linux VmHWM of /proc/self/status: ``getrusage``'s ru_maxrss keeps the high-water
    mark of the memory image exec replaced, i.e. the parent's RSS at fork (the generator's, when it just wrote the
    dataset)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--repeat", type=int, default=3, help="alternating timings of each side; the best counts")
    p.add_argument("--data", type=Path, default=None,
                   help="folder for the dataset, kept and reused (default: a temporary folder, removed after)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--child", choices=sorted(PROGRAMS), help=argparse.SUPPRESS)
    p.add_argument("dirs", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.dirs)
        return 0
    tmp = None if args.data else tempfile.TemporaryDirectory(prefix="bench_analysis.")
    try:
        dirs, gen_s = dataset(args.data or Path(tmp.name) / "data", args.runs, args.ranks, args.steps)
        records = args.runs * args.ranks * args.steps
        size_mb = sum(f.stat().st_size for d in dirs for f in (d / "records").iterdir()) / 1e6
        print(f"records: {records:,} ({args.runs} runs x {args.ranks} ranks x {args.steps} steps), {size_mb:,.0f} MB "
              f"parquet, {'generated in %.1f s' % gen_s if gen_s else 'reused from ' + str(args.data)}", flush=True)
        results: dict[str, list[dict]] = {"baseline": [], "analysis": []}
        for _ in range(args.repeat):
            for kind in results:
                results[kind].append(measure(kind, dirs))
        base, ana = (min(results[k], key=lambda r: r["wall_s"]) for k in ("baseline", "analysis"))
        assert base["records"] == ana["records"] == records, (base, ana)
        peak = {k: max(r["peak_rss_bytes"] for r in v) for k, v in results.items()}
        summary = {"records": records, "runs": args.runs, "ranks": args.ranks, "steps": args.steps,
                   "parquet_mb": size_mb, "baseline_s": base["wall_s"], "analysis_s": ana["wall_s"],
                   "ratio": ana["wall_s"] / base["wall_s"], "baseline_peak_rss_gb": peak["baseline"] / 1e9,
                   "analysis_peak_rss_gb": peak["analysis"] / 1e9,
                   "all_s": {k: [round(r["wall_s"], 2) for r in v] for k, v in results.items()}}
        print(f"baseline pyarrow scan + group-by: {base['wall_s']:.2f} s ({records / base['wall_s'] / 1e6:.1f} M "
              f"records/s), peak RSS {peak['baseline'] / 1e9:.2f} GB")
        print(f"hpc_tools analyse:                {ana['wall_s']:.2f} s ({records / ana['wall_s'] / 1e6:.1f} M "
              f"records/s), peak RSS {peak['analysis'] / 1e9:.2f} GB (goal < 2 GB at 100 M records)")
        print(f"ratio analyse / baseline:         {summary['ratio']:.2f} (goal <= 1.3); all timings {summary['all_s']}")
        print(f"check: {ana['ranks']} rank rows, median step times {ana['step_time_median_s']} s")
        if args.json:
            print(json.dumps(summary))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
