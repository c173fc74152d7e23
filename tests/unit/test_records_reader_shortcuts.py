"""The record reader's shortcuts give exactly what decoding every value gives: columns the footer statistics prove
constant (integers only) or all-null are not decoded, integers are converted by numpy, and the figures' reducer reuses
one rank's step layout for the next rank only when that rank recorded the same steps in the same starts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from profiling import figures
from profiling.figures import COLUMNS, RunReducer, StepLayout
from profiling.records import _parquet_columns, is_constant


def _reference(path, columns) -> dict[str, np.ndarray]:
    """Every value decoded the plain way: nulls NaN, all-null columns left out."""
    table = pq.read_table(path)
    out = {}
    for c in columns:
        if c not in table.column_names:
            continue
        values = [np.nan if v is None else float(v) for v in table.column(c).to_pylist()]
        if not all(np.isnan(values)):
            out[c] = np.array(values, dtype=np.float64)
    return out


def _write(path, columns: dict[str, pa.Array], row_group_size=None):
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


@pytest.mark.parametrize("row_group_size", [None, 3])
def test_statistics_shortcuts_equal_decoding_every_value(tmp_path, row_group_size):
    n = 8
    cols = {
        "step": pa.array(np.arange(1, n + 1, dtype=np.int64)),
        "restart": pa.array(np.zeros(n, dtype=np.int64)),  # constant integer: from the statistics
        "tokens": pa.array(np.full(n, 4096, dtype=np.int32)),
        "pp_rank": pa.array([1, 1, 1, None, 1, 1, 1, 1], type=pa.int64()),  # one value but a null: decoded
        "model_flops": pa.array([5.0, float("nan"), 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]),  # float min == max, a NaN inside
        "loss": pa.array([None] * n, type=pa.float64()),  # only nulls: left out
        "comm_time_s": pa.array([0.1, None, 0.3, None, 0.5, None, 0.7, None]),
        "rss_bytes": pa.array([7, 7, 7, 7, 9, 9, 9, 9], type=pa.int64()),  # constant per row group of 4, not overall
        "mfu": pa.array([None, None, None, 0.5, 0.5, 0.5, 0.5, 0.5]),
    }
    path = tmp_path / "rank00000.parquet"
    _write(path, cols, row_group_size)
    wanted = list(COLUMNS)
    got, want = _parquet_columns(path, wanted), _reference(path, wanted)
    assert list(got) == [c for c in wanted if c in want]  # the caller's order, the same columns
    for c in want:
        np.testing.assert_array_equal(got[c], want[c], err_msg=c)
        assert got[c].dtype == np.float64 and got[c].shape == (n,)
    assert "loss" not in got and np.isnan(got["model_flops"][1])
    assert is_constant(got["restart"]) and is_constant(got["tokens"])
    assert not any(is_constant(got[c]) for c in ("pp_rank", "model_flops", "rss_bytes", "step", "comm_time_s"))
    with pytest.raises(ValueError):
        got["restart"][0] = 1.0  # a view of one value: nobody writes through it


def test_an_older_schema_file_lacks_the_newer_columns(tmp_path):
    path = tmp_path / "rank00001.parquet"
    _write(path, {"step": pa.array([1, 2], type=pa.int64()), "step_time_s": pa.array([0.1, 0.2])})
    assert set(_parquet_columns(path, ["step", "step_time_s", "val_loss"])) == {"step", "step_time_s"}
    empty = tmp_path / "rank00002.parquet"
    _write(empty, {"step": pa.array([], type=pa.int64())})
    assert _parquet_columns(empty, ["step"]) == {}


def _rank_columns(steps, restart, seed):
    rng = np.random.default_rng(seed)
    n = len(steps)
    return {"step": np.asarray(steps, dtype=np.float64), "restart": np.asarray(restart, dtype=np.float64),
            "step_time_s": 0.1 + rng.random(n), "loss": np.where(rng.random(n) < 0.2, np.nan, rng.random(n)),
            "comm_time_s": np.where(np.arange(n) % 2 == 0, 0.01, np.nan), "data_time_s": 0.001 * rng.random(n)}


def test_the_reused_step_layout_gives_what_a_fresh_one_gives(monkeypatch):
    one = list(range(1, 21))
    ranks = [
        _rank_columns(one, [0] * 20, 0),
        _rank_columns(one, [0] * 20, 1),  # the same layout: reused
        _rank_columns(one, [0] * 10 + [1] * 10, 2),  # the same steps in two starts: its own warm-up
        _rank_columns(one[:15], [0] * 15, 3),  # fewer steps
        _rank_columns(list(range(1, 13)) + list(range(9, 21)), [0] * 12 + [1] * 12, 4),  # re-ran 9-12 after a requeue
        _rank_columns(one, [0] * 20, 5),
    ]
    reused = RunReducer(warmup=3)
    for r, cols in enumerate(ranks):
        reused.add_rank(r, cols)
    monkeypatch.setattr(StepLayout, "fits", lambda self, step, restart, warmup: False)
    fresh = RunReducer(warmup=3)
    for r, cols in enumerate(ranks):
        fresh.add_rank(r, cols)
    a, b = reused.figures(), fresh.figures()
    assert {k: a[k] for k in figures.JOB_FIGURES} == {k: b[k] for k in figures.JOB_FIGURES}
    assert [r.as_dict() for r in reused.ranks] == [r.as_dict() for r in fresh.ranks]
    for name in ("step_time_max_s", "step_warmup", "loss_sum", "loss_count"):
        np.testing.assert_array_equal(getattr(reused, name), getattr(fresh, name), err_msg=name)
    # The requeued rank's warm-up is its own: steps 1-3 and 9-11 (the second start's first three) are warm-up.
    assert reused.ranks[4].steps_measured == 20 - 6 and reused.ranks[2].steps_measured == 20 - 6
    assert reused.ranks[0].steps_measured == 17 and reused.ranks[3].steps_measured == 12


def test_record_files_are_written_with_the_stated_encodings(tmp_path):
    """compact_rank writes through write_parquet: the step delta-encoded, few-valued fields through a dictionary,
    per-step measurements plain; what is read back is what was written."""
    from profiling.records import DELTA_FIELDS, DICTIONARY_FIELDS, RecordWriter, parquet_path, read_columns
    from profiling.schema import SCHEMA_VERSION

    writer = RecordWriter(tmp_path, 3, validate_every=1)
    for step in range(1, 41):
        writer.write({"schema_version": SCHEMA_VERSION, "run_id": "r", "restart": 0, "rank": 3, "node": "n1",
                      "tp_rank": 0, "pp_rank": 1, "dp_rank": 1, "step": step, "time": 1.7e9 + step,
                      "step_time_s": 0.1 + step / 1000, "tokens": 512, "tokens_per_s": 512 / (0.1 + step / 1000),
                      "tokens_per_s_per_gpu": 128.0, "loss": 5 - step / 100})
    writer.close()
    meta = pq.ParquetFile(parquet_path(tmp_path, 3)).metadata
    chunks = {meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i) for i in range(meta.num_columns)}
    assert "DELTA_BINARY_PACKED" in chunks["step"].encodings and not chunks["step"].has_dictionary_page
    assert chunks["run_id"].has_dictionary_page and chunks["tokens"].has_dictionary_page
    assert not chunks["step_time_s"].has_dictionary_page and not chunks["loss"].has_dictionary_page
    assert set(DELTA_FIELDS).isdisjoint(DICTIONARY_FIELDS)
    cols = read_columns(parquet_path(tmp_path, 3), ["step", "step_time_s", "tokens", "loss"])
    np.testing.assert_array_equal(cols["step"], np.arange(1, 41))
    np.testing.assert_array_equal(cols["step_time_s"], 0.1 + np.arange(1, 41) / 1000)
    assert set(cols["tokens"]) == {512.0}
