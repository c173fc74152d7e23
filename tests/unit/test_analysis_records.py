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
    assert row["stragglers"] == "3" and row["slowest_rank"] == 3
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
    assert neg.returncode == 2 and "--warmup -1 must be >= 0" in neg.stderr
