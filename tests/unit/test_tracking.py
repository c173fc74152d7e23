"""Experiment tracking: event files read back by TensorBoard's own reader, rebuilt from records, a failing tracker that
never stops training, the recipe rule, and the `tensorboard` command."""

from __future__ import annotations

import json
import logging
import math
import struct

import numpy as np
import pytest

from hpc_tools.errors import RecipeError
from hpc_tools.testing.synthetic import synthetic_recipe, synthetic_run, write_rank_parquet
from hpc_tools.tracking import TAGS, Trackers, events, open_trackers, write_from_records
from hpc_tools.tracking.events import FILE_VERSION, PlainEventWriter, encode_event, event_files
from hpc_tools.tracking.rebuild import rebuild
from hpc_tools.tracking.trackers import Sink
from tests.helpers import run_cli

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="tensorboard is in environment/requirements-*.txt")

# What the training loop hands the trackers at a log line (hpc_tools.train.loop, global rank 0).
LOG_LINES = {
    10: {"loss": 7.25, "lr": 3e-4, "grad_norm": 1.75, "tokens_per_s": 12345.5, "tflops_per_gpu": 101.5, "mfu": 0.41,
         "mem_allocated_max_bytes": 21_474_836_480, "step_time_s": 0.83, "val_loss": None},
    20: {"loss": 6.5, "val_loss": 6.75, "lr": 2.5e-4, "grad_norm": 1.25, "tokens_per_s": 12400.0,
         "tflops_per_gpu": 102.0, "mfu": 0.42, "mem_allocated_max_bytes": 21_474_836_480, "step_time_s": 0.82},
}


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard itself reads the folder."""
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def f32(x: float) -> float:
    """The value as TensorBoard stores it (Summary.Value.simple_value is a 32-bit float)."""
    return float(np.float32(x))


def expected_from(lines: dict[int, dict]) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step, scalars in lines.items():
        for name, value in scalars.items():
            if value is not None:
                out.setdefault(TAGS[name], []).append((step, f32(value)))
    return out


@pytest.mark.parametrize("plain", [False, True], ids=["tensorboard-writer", "self-contained-writer"])
def test_logged_scalars_read_back_by_tensorboard(tmp_path, monkeypatch, plain):
    if plain:  # as on a machine without the tensorboard package
        monkeypatch.setattr("hpc_tools.tracking.events.tensorboard_installed", lambda: False)
    trackers = open_trackers(tmp_path, synthetic_recipe())
    assert trackers.names == ["TensorBoard"]
    for step, scalars in LOG_LINES.items():
        trackers.log(step, scalars)
    trackers.close()
    files = event_files(tmp_path / "tensorboard")
    assert len(files) == 1
    assert read_scalars(tmp_path / "tensorboard") == expected_from(LOG_LINES)


def test_tensorboard_off_writes_nothing(tmp_path):
    trackers = open_trackers(tmp_path, synthetic_recipe(["tracking.tensorboard=false"]))
    trackers.log(1, {"loss": 1.0})
    trackers.close()
    assert trackers.names == [] and not (tmp_path / "tensorboard").exists()


def test_self_contained_encoding_is_tensorboards_own():
    from tensorboard.compat.proto import event_pb2, summary_pb2

    summary = summary_pb2.Summary
    for step in (0, 1, 300_000, 2**40):
        ours = encode_event(1.5e9, step, scalars={"loss/train": 2.5, "memory/x": 8e10})
        theirs = event_pb2.Event(wall_time=1.5e9, step=step, summary=summary(value=[
            summary.Value(tag="loss/train", simple_value=2.5), summary.Value(tag="memory/x", simple_value=8e10)]))
        assert ours == theirs.SerializeToString()
    assert encode_event(2.0, file_version=FILE_VERSION) == \
        event_pb2.Event(wall_time=2.0, file_version=FILE_VERSION).SerializeToString()
    assert events.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    record = events.tfrecord(b"abc")
    assert struct.unpack("<Q", record[:8])[0] == 3 and record[12:15] == b"abc"
    assert struct.unpack("<I", record[15:])[0] == events.masked_crc32c(b"abc")


class Broken(Sink):
    name = "Broken"

    def __init__(self):
        self.calls = 0

    def log(self, step, scalars):
        self.calls += 1
        raise ConnectionError("service unreachable")


def test_a_failing_tracker_warns_once_and_the_others_go_on(tmp_path, caplog):
    broken = Broken()
    good = PlainEventWriter(tmp_path)

    class Good(Sink):
        name = "Good"

        def log(self, step, scalars):
            good.add_scalars(step, scalars)

        def close(self):
            good.close()

    trackers = Trackers([broken, Good()])
    with caplog.at_level(logging.WARNING, logger="hpc_tools"):
        for step in (1, 2, 3):
            trackers.log(step, {"loss": float(step), "note": "not a number", "lr": None})
        trackers.close()
    assert broken.calls == 1 and trackers.names == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Broken" in warnings[0] and "service unreachable" in warnings[0]
    assert read_scalars(tmp_path) == {"loss/train": [(1, 1.0), (2, 2.0), (3, 3.0)]}


def test_a_tracker_that_cannot_open_is_left_out(tmp_path, caplog):
    (tmp_path / "tensorboard").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="hpc_tools"):
        trackers = open_trackers(tmp_path, synthetic_recipe())
        trackers.log(1, {"loss": 1.0})
        trackers.close()
    assert trackers.names == []
    assert any("TensorBoard could not start" in r.getMessage() for r in caplog.records)


def test_an_enabled_tracker_without_its_package_is_a_validation_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow")
                        else real(name, *a))
    with pytest.raises(RecipeError) as err:
        synthetic_recipe(["tracking.wandb.mode=offline", "tracking.mlflow.experiment=e"])
    wandb, mlflow = (str(v) for v in err.value.violations)
    assert "tracking.wandb.enabled" in wandb and "'wandb' package" in wandb and "pip install wandb" in wandb
    assert "tracking.mlflow.enabled" in mlflow and "'mlflow' package" in mlflow
    synthetic_recipe(["tracking.wandb.enabled=false", "tracking.mlflow={enabled: false}"])  # switched off: valid


def _steps_run(tmp_path):
    """Two ranks, 6 steps; loss on both ranks (different values), mfu and val_loss as the job records them."""
    st = np.full((2, 6), 0.5)
    loss = np.array([[4.0, 3.5, 3.0, 2.5, 2.25, 2.0], [4.2, 3.7, 3.2, 2.7, 2.45, 2.2]])
    mfu = np.array([[0.30, 0.31, 0.32, 0.33, 0.34, 0.35], [0.29, 0.30, 0.31, 0.32, 0.33, 0.34]])
    val = np.full((2, 6), np.nan)
    val[:, 2], val[:, 5] = 3.1, 2.4  # evaluation at steps 3 and 6, the same on every rank
    return synthetic_run(tmp_path, [], st, loss=loss, mfu=mfu, val_loss=val), loss, mfu


def test_write_from_records_equals_the_records(tmp_path):
    run, loss, mfu = _steps_run(tmp_path)
    folder = write_from_records(run.path)
    assert folder == run.path / "tensorboard"
    got = read_scalars(folder)
    steps = range(1, 7)
    assert got["loss/train"] == [(s, f32(loss[:, s - 1].mean())) for s in steps]  # mean over the ranks
    assert got["throughput/mfu"] == [(s, f32(mfu[0, s - 1])) for s in steps]  # rank 0's record
    assert got["loss/val"] == [(3, f32(3.1)), (6, f32(2.4))]
    assert [v for _, v in got["time/step_time_s"]] == [0.5] * 6
    # Rebuilding replaces the old file: TensorBoard never sees a step twice.
    write_from_records(run.path)
    assert len(event_files(folder)) == 1 and read_scalars(folder) == got


def test_a_resumed_runs_recomputed_steps_count_once(tmp_path):
    run = synthetic_run(tmp_path, [], np.full((1, 4), 0.5), loss=np.array([[4.0, 3.0, 2.0, 1.0]]))
    # A second life re-ran steps 3-4 after a checkpoint at step 2, then went on to step 5: its records win.
    steps = np.array([1, 2, 3, 4, 3, 4, 5])
    loss = np.array([4.0, 3.0, 2.0, 1.0, 2.5, 1.5, 0.5])
    write_rank_parquet(run.records_dir, 0, run.run_id, steps, np.full(7, 0.5), 64, 1, loss=loss,
                       restart=np.array([0, 0, 0, 0, 1, 1, 1]))
    folder, n = rebuild(run.path, plain=True)
    assert n == 5
    assert read_scalars(folder)["loss/train"] == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 1.5), (5, 0.5)]


def test_tensorboard_command_on_a_run_and_a_sweep(tmp_path, capsys):
    from hpc_tools.cli import main
    from hpc_tools.sweep.folder import SweepFolder

    run, loss, _ = _steps_run(tmp_path)
    out = run_cli("tensorboard", run.run_id, "--runs-dir", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["logdir"] == str(run.path / "tensorboard") and data["runs"][0]["steps"] == 6
    assert data["command"] == f"tensorboard --logdir {run.path / 'tensorboard'} --port 6006"
    assert read_scalars(run.path / "tensorboard")["loss/train"][0] == (1, f32(loss[:, 0].mean()))

    # A sweep: one run done, one still running whose job writes its own event file (left alone).
    sweep = SweepFolder.create(tmp_path, "sw", {"cells": []})
    done = synthetic_run(sweep.path, [], np.full((1, 3), 0.5), loss=np.array([[3.0, 2.0, 1.0]]))
    live = synthetic_run(sweep.path, [], np.full((1, 3), 0.5), state="RUNNING", loss=np.array([[3.0, 2.0, 1.0]]))
    writer = PlainEventWriter(live.path / "tensorboard")
    writer.add_scalars(1, {"loss/train": 9.0})
    writer.close()
    with sweep.edit() as d:
        d["cells"] = [{"id": "a", "run_dir": done.path.name}, {"id": "b", "run_dir": live.path.name},
                      {"id": "c"}]  # a cell not submitted yet
    capsys.readouterr()
    assert main(["tensorboard", str(sweep.path), "--write-only"]) == 0  # in this process: one start-up less
    out = capsys.readouterr().out
    assert f"{done.run_id}: 3 steps -> " in out and f"{live.run_id}: left as is" in out
    assert "tensorboard --logdir" not in out
    assert read_scalars(done.path / "tensorboard")["loss/train"] == [(1, 3.0), (2, 2.0), (3, 1.0)]
    assert read_scalars(live.path / "tensorboard")["loss/train"] == [(1, 9.0)]

    assert main(["tensorboard", "no-such-run", "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no run or sweep matches 'no-such-run'" in err


RUN_NAME = "synthetic-20260101-000000-abcdef"  # a run folder's name: the W&B run id, the MLflow run name
# The second log line with a NaN loss (the guard skipped that step): W&B takes it, MLflow leaves it out.
LOGGED = {10: LOG_LINES[10], 20: {**LOG_LINES[20], "loss": float("nan")}}


def wandb_records(run_file) -> list:
    """The protobuf records of a W&B offline run file (``run-ID.wandb``), read as W&B's own sync reads them: a
    7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB-style 32 KiB blocks of chunks, each with a
    CRC-32 of its type and data, a length and a type (1 full, 2 first, 3 middle, 4 last)."""
    import zlib

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room left for a chunk header: the rest of the block is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_file_holds_the_logged_scalars(tmp_path, monkeypatch, caplog):
    """The real wandb package, offline: the run file it writes under RUN/wandb/ holds the recipe, the run's id (the
    run folder's name: a requeued job continues the same W&B run) and tags, and every scalar at its step, as logged
    (W&B takes the NaN); the run is finished."""
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # wandb-core, its service process, gets 30 s to start and init 90 s: on a loaded 2-core machine (the parallel
    # suite) that is not always enough, and a tracker that fails to open is dropped with a warning
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "300")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "300")
    run_dir = tmp_path / RUN_NAME
    recipe = synthetic_recipe(["tracking.tensorboard=false", "tracking.wandb.project=p", "tracking.wandb.tags=[a]"])
    caplog.set_level(logging.WARNING)  # a tracker that fails warns and switches off: the warning is the failure's cause
    trackers = open_trackers(run_dir, recipe)
    assert trackers.names == ["W&B"], caplog.text
    for step, scalars in LOGGED.items():
        trackers.log(step, scalars)
        assert trackers.names == ["W&B"], (step, caplog.text)
    trackers.close()
    assert trackers.names == [] and not [r for r in caplog.records if r.name.startswith("hpc_tools")], caplog.text
    run_files = list((run_dir / "wandb").rglob("*.wandb"))
    assert len(run_files) == 1, (run_files, sorted(str(p) for p in (run_dir / "wandb").rglob("*")))
    (run_file,) = run_files
    assert run_file.name == f"run-{RUN_NAME}.wandb"
    records = wandb_records(run_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.project, list(run.tags)) == (RUN_NAME, "p", ["a"])
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["tracking"]["wandb"]["project"] == "p" and config["name"] == recipe.name  # the resolved recipe
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history] == list(LOGGED), (history, [r.WhichOneof("record_type") for r in records])
    for h, scalars in zip(history, LOGGED.values()):
        want = {TAGS[k]: v for k, v in scalars.items() if v is not None}
        got = {k: v for k, v in h.items() if not k.startswith("_")}
        assert got.keys() == want.keys()
        assert all(got[k] == v or (math.isnan(got[k]) and math.isnan(v)) for k, v in want.items()), (got, want)
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished, not left open


def test_mlflow_file_store_holds_the_logged_scalars(tmp_path, monkeypatch):
    """The real mlflow package with its default store here, the file store under RUN/mlruns/ (MLflow 3 refuses one
    unless MLFLOW_ALLOW_FILE_STORE is true: the tracker opts in). Read back with MLflow's own client: one run per
    life in the recipe's experiment, named after the run folder, each metric's history as logged (the NaN loss left
    out), the run ended."""
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset below; restored to unset after the test")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    run_dir = tmp_path / RUN_NAME
    recipe = synthetic_recipe(["tracking.tensorboard=false", "tracking.mlflow.experiment=e"])
    for _ in range(2):  # a second life finds the experiment the first made
        trackers = open_trackers(run_dir, recipe)
        assert trackers.names == ["MLflow"]
        for step, scalars in LOGGED.items():
            trackers.log(step, scalars)
        trackers.close()
    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    assert [e.name for e in client.search_experiments()].count("e") == 1
    runs = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert len(runs) == 2
    for run in runs:
        assert run.info.run_name == RUN_NAME and run.info.status == "FINISHED"
        assert run.data.params == {"recipe": recipe.name}
        for name in TAGS:
            want = [(step, scalars[name]) for step, scalars in LOGGED.items()
                    if scalars.get(name) is not None and math.isfinite(scalars[name])]  # the NaN loss left out
            history = client.get_metric_history(run.info.run_id, TAGS[name])
            assert [(m.step, m.value) for m in history] == want, name
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss/train")] == [(10, 7.25)]
