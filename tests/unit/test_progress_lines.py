"""Progress lines, start-up phases, library warnings once each, buffered records, evaluation in the loop and its
goodput bucket, and the asynchronous stop agreement: the pieces without a training job (the job itself:
tests/integration/test_validation_loss.py)."""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_tools.runtime.progress import ProgressMeter, StartupLog, hms, read_progress, write_progress
from hpc_tools.train import loop
from profiling.records import RecordWriter, jsonl_path, read_columns
from profiling.schema import FIELD_NAMES, SCHEMA_VERSION

LINE_RE = re.compile(r"^step (\d+)/(\d+) loss \S+( val \S+)? lr \S+ grad \S+ tok/s \S+( \(\S+/gpu\))? "
                     r"TFLOP/s/gpu \S+ MFU (\S+ %|n/a)( pp wait \S+ %)? mem (\S+ GB|-) "
                     r"elapsed \d+:\d\d:\d\d eta (\d+:\d\d:\d\d|-)$")


def record(step: int, dt: float = 0.5, **extra) -> dict:
    return {"step": step, "step_time_s": dt, "tokens": 1000, "tflops_per_gpu": 2.0, "mfu": 0.25, "loss": 3.0 / step,
            "rss_bytes": 2 * 10**9, "tokens_per_s": 1000 / dt, "tokens_per_s_per_gpu": 250 / dt, "lr": 3e-4 / step,
            "grad_norm": 1.25 * step, **extra}


def test_progress_line_is_one_line_with_every_field_and_rates_over_the_window():
    meter = ProgressMeter(first=1, total=10, eval_interval=5)
    meter.add(record(1, dt=9.0), 1, 3.0)  # the first step (warm-up) is left out of the ETA
    line, scalars = meter.line(1)
    assert LINE_RE.match(line) and "\n" not in line, line
    assert line.startswith("step 1/10 loss 3.0000 lr 3.00e-04 grad 1.25 tok/s 111 (27.8/gpu) "), line
    assert " eta -" in line, line
    meter.add(record(2, dt=1.0), 2, 1.5)
    meter.add(record(3, dt=3.0, tflops_per_gpu=6.0), 3, 1.0)
    meter.add_eval(3, 2.25, 2.0)
    line, scalars = meter.line(3)
    assert LINE_RE.match(line), line
    assert " val 2.2500 " in line and "MFU 25.0 %" in line and "mem 2.00 GB" in line, line
    assert " lr 1.00e-04 grad 3.75 " in line and " tok/s 500 (125/gpu) " in line, line  # the newest step's lr, norm
    assert scalars["tokens_per_s"] == pytest.approx(2000 / 4.0)  # total tokens over total time, not a mean of rates
    assert scalars["tflops_per_gpu"] == pytest.approx((2.0 * 1 + 6.0 * 3) / 4)
    assert scalars["val_loss"] == 2.25 and scalars["loss"] == 1.0
    # ETA: 7 steps left at the mean 2 s of steps 2-3, plus the evaluations still due (steps 5 and 10) at 2 s each
    assert meter.eta_s(3) == pytest.approx(7 * 2.0 + 2 * 2.0)
    meter.add(record(4), 4, 0.9)
    line, scalars = meter.line(4)
    assert " val " not in line and "val_loss" not in scalars  # only on the line of the evaluation's window
    assert " pp wait " not in line and "pp_wait_share" not in scalars  # no pipeline: no wait figure


def test_progress_line_pipeline_wait_and_unknowns_and_units_from_one_owner():
    """A pipelined run's line carries its wait share over the window; a record without lr, norm, FLOPs or memory
    prints dashes; every quantity is in profiling.units' unit (GB, %, one line)."""
    meter = ProgressMeter(first=1, total=4)
    meter.add(record(1, dt=1.0, pp_wait_s=0.5), 1, 1.0)
    meter.add(record(2, dt=3.0, pp_wait_s=0.5), 2, 1.0)
    line, scalars = meter.line(2)
    assert LINE_RE.match(line), line
    assert scalars["pp_wait_share"] == pytest.approx(1.0 / 4.0) and " pp wait 25.0 % " in line, line
    meter.add({"step": 3, "step_time_s": 1.0}, 3, None)
    line, _ = meter.line(3)
    assert LINE_RE.match(line), line
    assert " lr - grad - tok/s - TFLOP/s/gpu - MFU n/a mem - " in line and "GiB" not in line, line


def test_hms_and_startup_phases_logged_once_each():
    assert hms(3725.4) == "1:02:05" and hms(None) == "-" and hms(float("nan")) == "-"
    said = []
    startup = StartupLog(lambda msg, *a: said.append(msg % a))
    startup.done("model build", 2.345)
    startup.done("model build", 9.0)
    startup.done("checkpoint load", 0.01, "fresh start")
    assert said == ["start-up: model build 2.35 s", "start-up: checkpoint load 0.01 s (fresh start)"]


def test_progress_file_round_trip_and_a_missing_one(tmp_path):
    assert read_progress(tmp_path) is None
    write_progress(tmp_path, 7, 30, "step 7/30 ...", {"loss": 1.0}, 12.0, (5, 2.5))
    got = read_progress(tmp_path)
    assert got["step"] == 7 and got["total"] == 30 and got["latest_val_loss"] == 2.5 and got["val_step"] == 5
    assert not list(tmp_path.glob(".*tmp"))


def _rec(step: int) -> dict:
    return {"schema_version": SCHEMA_VERSION, "run_id": "r", "job_id": None, "restart": 0, "rank": 0, "node": "n",
            "tp_rank": 0, "pp_rank": 0, "dp_rank": 0, "step": step, "time": 1.0 + step, "step_time_s": 0.5,
            "tokens": 10, "tokens_per_s": 20.0, "tokens_per_s_per_gpu": 20.0}


def test_record_writer_buffers_and_flushes_by_count_on_demand_and_at_close(tmp_path):
    writer = RecordWriter(tmp_path, 0, flush_every=3, flush_every_s=3600)
    path = jsonl_path(tmp_path, 0)
    for step in (1, 2):
        writer.write(_rec(step))
    assert path.read_text() == ""  # buffered: nothing written yet on the step's path
    writer.write(_rec(3))
    assert len(path.read_text().splitlines()) == 3  # the count reached: one write of three lines
    writer.write(_rec(4))
    writer.flush()
    assert len(path.read_text().splitlines()) == 4
    writer.write(_rec(5))
    writer.close(compact=False)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_record_writer_flushes_by_time(tmp_path):
    writer = RecordWriter(tmp_path, 0, flush_every=1000, flush_every_s=0.0)
    writer.write(_rec(1))
    assert len(jsonl_path(tmp_path, 0).read_text().splitlines()) == 1
    writer.close(compact=False)


def test_schema_2_adds_validation_fields_and_version_1_files_still_read(tmp_path):
    assert SCHEMA_VERSION >= 2 and {"val_loss", "eval_time_s"} <= set(FIELD_NAMES)
    old = {**_rec(1), "schema_version": 1, "loss": 2.0}
    jsonl_path(tmp_path, 0).write_text(json.dumps(old) + "\n")
    cols = read_columns(jsonl_path(tmp_path, 0), ("step", "loss", "val_loss"))
    assert cols["loss"][0] == 2.0 and "val_loss" not in cols  # a version-1 file simply lacks the new columns


def test_collector_puts_the_evaluation_into_its_step_record_outside_the_step_time(tmp_path):
    from profiling.collector import StepCollector

    c = StepCollector(run_id="r", records_dir=tmp_path, rank=0, world_size=1, job_id=None, restart=0,
                      tokens_per_step=10, coords={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, summary_interval=1000)
    for step in (1, 2):
        c.start_step(step)
        rec = c.end_step(step, loss=1.0)
        if step == 2:
            c.add_evaluation(2, 0.75, 1.5)
    c.close()
    rows = [json.loads(x) for x in jsonl_path(tmp_path, 0).read_text().splitlines()]
    assert [(r["step"], r["val_loss"], r["eval_time_s"]) for r in rows] == [(1, None, None), (2, 0.75, 1.5)]
    assert rec["step_time_s"] < 1.5


def test_goodput_counts_evaluation_time_as_its_own_bucket(tmp_path):
    from profiling.goodput import measure

    writer = RecordWriter(tmp_path, 0)
    for step in (1, 2, 3):
        writer.write({**_rec(step), **({"val_loss": 1.0, "eval_time_s": 0.25} if step != 2 else {})})
    writer.close(compact=False)
    g = measure(tmp_path, {"events": []}, world_size=1, gpu=False, now=10.0)
    assert g.seconds()["evaluation"] == pytest.approx(0.5)
    assert g.seconds()["productive"] == pytest.approx(1.5)


def test_recipe_eval_fields_and_their_bounds():
    from pydantic import ValidationError

    from hpc_tools.recipe.training import TrainingConfig

    t = TrainingConfig()
    assert t.eval_interval is None and t.eval_iters == 10
    assert TrainingConfig(eval_interval=5, eval_iters=1).eval_interval == 5
    for bad in ({"eval_iters": 0}, {"eval_interval": 0}):
        with pytest.raises(ValidationError):
            TrainingConfig(**bad)


def test_eval_due():
    assert [s for s in range(1, 11) if loop.eval_due(s, 10, 4)] == [4, 8, 10]
    assert not any(loop.eval_due(s, 10, None) for s in range(1, 11))


class _Ctx:
    def __init__(self, tmp_path: Path, eval_interval):
        self.recipe = SimpleNamespace(
            training=SimpleNamespace(train_iters=5, log_interval=2, max_nonfinite_steps=3, eval_interval=eval_interval,
                                     eval_iters=2),
            checkpoint=SimpleNamespace(interval_iters=None, keep_last=2, resume=True, load_path=None, verify="size",
                                       local_dir=None, local_interval_iters=None))
        self.checkpoint_dir = tmp_path / "checkpoints"
        self.run_dir = tmp_path
        self.is_rank0 = True
        self.logged: list[str] = []
        self.finals: list[bool] = []

    def heartbeat(self, step):
        pass

    def note_layout(self, from_iteration):
        pass

    def agree_stop(self, final=False):
        self.finals.append(final)
        return False

    def info(self, msg, *args):
        self.logged.append(msg % args)


class _Collector:
    def __init__(self):
        self.evals, self.flushes = [], 0

    def start_step(self, step):
        pass

    def data_timer(self):
        import contextlib

        return contextlib.nullcontext()

    def end_step(self, step, **fields):
        return {"step": step, "step_time_s": 0.1, "tokens": 100, "loss": fields["loss"]}

    def add_evaluation(self, step, val_loss, seconds):
        self.evals.append((step, val_loss))

    def flush(self):
        self.flushes += 1

    def close(self):
        pass


class _Engine:
    checkpoints = False

    def __init__(self):
        self.evaluated = []

    def describe(self):
        return "fake"

    def coords(self):
        return {"dp_rank": 0}

    def batch(self, step):
        return step

    def step(self, step, batch):
        return loop.StepResult(loss=1.0 / step)

    def evaluate(self, batches):
        self.evaluated.append(len(batches))
        return 0.5

    def close(self):
        pass


def test_loop_evaluates_at_the_interval_and_the_last_step_and_logs_progress(tmp_path, monkeypatch):
    from hpc_tools.train import data

    monkeypatch.setattr(loop.Evaluation, "batches", lambda self: [["b1"], ["b2"]])
    monkeypatch.setattr(data, "validation_samples", lambda recipe: None, raising=False)
    ctx, engine, collector = _Ctx(tmp_path, eval_interval=2), _Engine(), _Collector()
    monkeypatch.setattr(loop, "_open_trackers", lambda c: None)
    loop.train(ctx, engine, collector_for=lambda c, **coords: collector)
    assert collector.evals == [(2, 0.5), (4, 0.5), (5, 0.5)] and engine.evaluated == [2, 2, 2]
    lines = [x for x in ctx.logged if x.startswith("step ")]
    assert [x.split()[1] for x in lines] == ["2/5", "4/5", "5/5"] and all(" val 0.5000 " in x for x in lines), lines
    assert [x.split(":")[0] for x in ctx.logged if x.startswith("start-up")] == ["start-up"] * 2  # load, first step
    assert ctx.finals == [False] * 4 + [True]  # the last step's stop agreement leaves nothing in flight
    assert read_progress(tmp_path)["step"] == 5


def test_loop_without_eval_interval_never_evaluates(tmp_path, monkeypatch):
    ctx, engine, collector = _Ctx(tmp_path, eval_interval=None), _Engine(), _Collector()
    monkeypatch.setattr(loop, "_open_trackers", lambda c: None)
    loop.train(ctx, engine, collector_for=lambda c, **coords: collector)
    assert engine.evaluated == [] and collector.evals == []
    assert [x.split()[1] for x in ctx.logged if x.startswith("step ")] == ["2/5", "4/5", "5/5"]


def test_trackers_get_the_scalars_of_each_log_line_and_are_closed(tmp_path, monkeypatch):
    calls = []

    class Trackers:
        def log(self, step, scalars):
            calls.append((step, sorted(scalars)))
            raise RuntimeError("a tracker that fails must not stop training")

        def close(self):
            calls.append("close")

    monkeypatch.setattr(loop, "_open_trackers", lambda c: Trackers())
    ctx, engine, collector = _Ctx(tmp_path, eval_interval=None), _Engine(), _Collector()
    loop.train(ctx, engine, collector_for=lambda c, **coords: collector)
    assert [c[0] for c in calls[:-1]] == [2, 4, 5] and calls[-1] == "close"
    assert {"loss", "step_time_s", "tokens_per_s"} <= set(calls[0][1])


def test_library_warnings_go_to_the_log_file_once_each_and_are_counted(tmp_path, monkeypatch, capsys):
    from hpc_tools.runtime import ranklog

    log_file = tmp_path / "logs" / "rank00000.out"
    log_file.parent.mkdir()
    log_file.write_text("")
    monkeypatch.setattr(ranklog, "stdout_file", lambda: None)
    monkeypatch.setattr(ranklog, "log_sink", lambda run_dir, rank: (open(log_file, "a"), log_file, True))
    saved = logging.getLogger("py.warnings").handlers[:], logging.getLogger("py.warnings").propagate
    try:
        rank_log = ranklog.RankLog(tmp_path, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            for _ in range(3):
                warnings.warn("Apex is not installed", UserWarning, stacklevel=1)
            warnings.warn("something is deprecated", FutureWarning, stacklevel=1)
        ranklog.detail("detail line %d", 7)
        line = rank_log.warnings_line()
        rank_log.close()
    finally:
        logging.captureWarnings(False)
        logging.getLogger("py.warnings").handlers[:], logging.getLogger("py.warnings").propagate = saved
    from profiling.collector import DETAIL_LOGGER

    assert DETAIL_LOGGER == ranklog.DETAIL_LOGGER  # the collector's detail lines go where ranklog routes them
    text = log_file.read_text()
    assert text.count("UserWarning: Apex is not installed") == 1, text
    assert text.count("FutureWarning: something is deprecated") == 1 and len(text.splitlines()) == 3, text
    assert "detail line 7" in text
    assert line == f"2 library warnings in {log_file} (each once)"
    out = capsys.readouterr()
    assert "Apex" not in out.out + out.err and "detail line" not in out.out + out.err


def test_stop_agreement_is_read_one_step_later_on_every_rank_and_final_reads_at_once(tmp_path):
    import torch
    import torch.distributed as dist

    from hpc_tools.runtime.context import RankContext
    from hpc_tools.runtime.preemption import StopFlag

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ctx = SimpleNamespace(stop=StopFlag(), device=torch.device("cpu"), _stop_pending=None)
        assert RankContext.agree_stop(ctx) is False  # step 1: nothing in flight yet; step 1's flag starts
        ctx.stop.requested = True  # the signal arrives during step 2
        assert RankContext.agree_stop(ctx) is False  # step 2 reads step 1's agreed flag (no stop)
        assert RankContext.agree_stop(ctx) is True and ctx._stop_pending is None  # step 3: everyone stops
        late = SimpleNamespace(stop=StopFlag(), device=torch.device("cpu"), _stop_pending=None)
        assert RankContext.agree_stop(late) is False
        late.stop.requested = True
        assert RankContext.agree_stop(late, final=True) is True and late._stop_pending is None  # nothing left
    finally:
        if created:
            dist.destroy_process_group()
