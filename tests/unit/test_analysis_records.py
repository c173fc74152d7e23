"""Per-run and per-rank metrics against hand computations over small record files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.testing.synthetic import synthetic_run

STEPS, RANKS = 20, 4


@pytest.fixture
def run(tmp_path):
    rng = np.random.default_rng(1)
    st = 0.1 + 0.01 * rng.random((RANKS, STEPS))
    st[3] *= 1.5  # rank 3 is a straggler
    loss = np.full((RANKS, STEPS), np.nan)
    loss[2:] = np.linspace(6, 4, STEPS)  # only the last pipeline stage (ranks 2, 3) reports the loss
    comm = np.full((RANKS, STEPS), np.nan)
    comm[:, ::5] = 0.02  # sampled every 5th step
    rss = np.arange(RANKS)[:, None] * 1e8 + 1e9 + np.zeros((RANKS, STEPS))
    folder = synthetic_run(tmp_path, ["cluster.gpus_per_node=4", "training.global_batch_size=8"], st, loss=loss,
                           comm_time_s=comm, data_time_s=st * 0.1, rss_bytes=rss)
    return folder, st, comm


def test_run_metrics_equal_hand_computation(run):
    folder, st, comm = run
    warm = 3
    result = analyse([str(folder.path)], warmup=warm)
    row = result.runs.iloc[0]
    per_step = st.max(axis=0)[warm:]  # slowest rank per step, after warm-up
    assert row["steps_measured"] == STEPS - warm
    assert row["step_time_median_s"] == pytest.approx(np.median(per_step))
    assert row["step_time_p10_s"] == pytest.approx(np.percentile(per_step, 10))
    assert row["step_time_p90_s"] == pytest.approx(np.percentile(per_step, 90))
    tokens = 8 * 64  # global batch x seq_length
    assert row["tokens_per_s"] == pytest.approx(tokens / np.median(per_step))
    assert row["tokens_per_s_per_gpu"] == pytest.approx(tokens / np.median(per_step) / RANKS)
    assert row["peak_mem_gb"] == pytest.approx((3e8 + 1e9) / 1e9) and row["peak_mem_kind"] == "host_rss"
    assert row["data_share"] == pytest.approx(0.1)
    steps = np.arange(1, STEPS + 1)
    sampled = (steps > warm) & ~np.isnan(comm[0])
    expected_comm = np.mean([comm[r, sampled].sum() / st[r, sampled].sum() for r in range(RANKS)])
    assert row["comm_share"] == pytest.approx(expected_comm)
    assert np.isnan(row["tflops_per_gpu"]) and np.isnan(row["mfu"])  # no FLOPs in these records
    medians = np.median(st[:, warm:], axis=1)
    assert row["rank_skew"] == pytest.approx((medians.max() - medians.min()) / np.median(medians))
    assert row["slowest_rank"] == 3
    # Collectives were timed on 3 measured steps only: too few for a straggler verdict (profiling.stragglers).
    assert row["stragglers"] == "" and row["straggler_verdict"].startswith("inconclusive: 3 step(s)")
    losses = result.steps.set_index("step")["loss"]
    assert losses.loc[1] == pytest.approx(6.0) and losses.loc[STEPS] == pytest.approx(4.0)


def test_jsonl_fallback_with_requeue_duplicates_and_missing_columns(tmp_path):
    """A killed rank has only JSON lines; a requeue re-ran steps 3-4 and appended them: the last record wins."""
    folder = synthetic_run(tmp_path, ["cluster.gpus_per_node=1"], np.full((1, 4), 1.0))
    (folder.records_dir / "rank00000.parquet").unlink()
    rows = [(1, 1.0), (2, 1.0), (3, 9.0), (4, 9.0), (3, 2.0), (4, 2.0), (5, 2.0)]
    with open(folder.records_dir / "rank00000.jsonl", "w") as f:
        for step, t in rows:  # only required-ish fields: every optional column is absent
            f.write(json.dumps({"step": step, "step_time_s": t, "tokens": 64}) + "\n")
        f.write('{"step": 6, "step_ti')  # torn last line
    result = analyse([str(folder.path)], warmup=0)
    row = result.runs.iloc[0]
    assert row["steps_measured"] == 5
    assert row["step_time_median_s"] == pytest.approx(np.median([1, 1, 2, 2, 2]))
    assert np.isnan(row["comm_share"]) and np.isnan(row["peak_mem_gb"])


def test_analyze_cli_json_and_bad_input(run, cli, tmp_path):
    folder, _, _ = run
    out = cli("analyze", str(folder.path), "--json", "--warmup", "2")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["runs"][0]["world_size"] == 4 and data["runs"][0]["warmup_steps"] == 2
    missing = cli("analyze", str(tmp_path / "nope"), "--runs-dir", str(tmp_path))
    assert missing.returncode == 2 and missing.stderr.startswith("error:") and "Traceback" not in missing.stderr
    neg = cli("analyze", str(folder.path), "--warmup", "-1")
    assert neg.returncode == 2 and "argument --warmup: '-1' is below 0" in neg.stderr


def test_streamed_rank_columns_equal_reading_each_file(tmp_path):
    """iter_rank_columns (one dataset scan) gives what read_columns gives file by file, in rank order: parquet and
    JSON-lines ranks mixed, a file without optional columns, a file with no rows, a column that is all null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from profiling.figures import COLUMNS
    from profiling.records import iter_rank_columns, jsonl_path, parquet_path, rank_files, read_columns

    rng = np.random.default_rng(2)
    st = 0.1 + 0.01 * rng.random((4, 30))
    comm = np.full((4, 30), np.nan)
    comm[:, ::3] = 0.01
    folder = synthetic_run(tmp_path, ["cluster.gpus_per_node=4"], st, comm_time_s=comm, loss=st * 10)
    records = folder.records_dir
    (records / "rank00001.parquet").unlink()  # rank 1 was killed before it compacted: JSON lines only
    with open(jsonl_path(records, 1), "w") as f:
        for s in range(1, 11):
            f.write(json.dumps({"step": s, "step_time_s": 0.2, "tokens": 64, "loss": None}) + "\n")
    # Rank 3 by an older writer: only the required columns; rank 5: a file with no rows.
    pq.write_table(pa.table({"step": pa.array([1, 2, 3]), "step_time_s": pa.array([0.3, 0.2, 0.1])}),
                   parquet_path(records, 3))
    pq.write_table(pa.table({"step": pa.array([], pa.int64()), "step_time_s": pa.array([], pa.float64())}),
                   parquet_path(records, 5))
    streamed = list(iter_rank_columns(records, COLUMNS))
    assert [r for r, _ in streamed] == list(rank_files(records)) == [0, 1, 2, 3, 5]
    for rank, cols in streamed:
        alone = read_columns(rank_files(records)[rank], COLUMNS)
        alone = {k: v for k, v in alone.items() if v.size and not np.all(np.isnan(v))}  # all-null: left out
        assert sorted(cols) == sorted(alone), rank
        for k in cols:
            np.testing.assert_array_equal(cols[k], alone[k])
            assert cols[k].dtype == np.float64
    assert "comm_time_s" in dict(streamed)[0] and "loss" not in dict(streamed)[1] and dict(streamed)[5] == {}
    result = analyse([str(folder.path)], warmup=0)
    assert result.runs.iloc[0]["ranks_measured"] == 4  # the empty rank adds no figures


def test_fast_paths_equal_numpy_bit_for_bit():
    """The reducer's shortcuts change how data flows, never a figure: percentiles from one sort equal np.percentile
    exactly; a contiguous measured mask becomes a slice (a view) selecting the same records."""
    from profiling.figures import percentiles, selector

    rng = np.random.default_rng(4)
    for i in range(3000):
        n = int(rng.integers(1, 40)) if i % 2 else int(rng.integers(40, 5000))
        x = rng.random(n) * 10 ** rng.uniform(-6, 4)
        if i % 5 == 0:
            x = np.round(x, 2)  # ties
        assert np.array_equal(percentiles(x), np.percentile(x, (10, 50, 90))), n
    with_nan = np.array([1.0, np.nan, 3.0])
    assert np.array_equal(percentiles(with_nan), np.percentile(with_nan, (10, 50, 90)), equal_nan=True)
    x = np.arange(10.0)
    for mask in (np.arange(10) >= 3, np.arange(10) < 4, np.zeros(10, bool), np.ones(10, bool),
                 np.array([1, 1, 0, 1, 1, 0, 0, 1, 1, 1], bool)):
        sel = selector(mask)
        assert np.array_equal(x[sel], x[mask])
        assert isinstance(sel, slice) == (mask.sum() == 0 or np.all(np.diff(np.flatnonzero(mask)) == 1))
