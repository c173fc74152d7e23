"""Validation loss, progress lines, start-up phases and the quiet console on real local jobs through the CLI: the
README's main command (gpt_3d's local profile: Megatron-core TP2 x PP2 on 4 CPU ranks) and the DeepSpeed recipe
(ZeRO-2 on 2 CPU ranks), each with an evaluation every 3 steps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hpc_tools.registry import list_runs
from profiling.schema import SCHEMA_VERSION
from tests.helpers import REPO, run_cli, step_records

pytestmark = pytest.mark.slow

PROGRESS = re.compile(r"step (\d+)/6 loss \d+\.\d{4}( val (\d+\.\d{4}))? lr \S+ grad \S+ tok/s \S+ \(\S+/gpu\) "
                      r"TFLOP/s/gpu \S+ MFU (\S+ %|n/a)( pp wait \S+ %)? mem \S+ GB "
                      r"elapsed \d+:\d\d:\d\d eta (\d+:\d\d:\d\d|-)$")
SETS = ["training.train_iters=6", "training.eval_interval=3", "training.eval_iters=2", "training.log_interval=2",
        "checkpoint.interval_iters=0"]


def submit(recipe: str, runs_dir: Path):
    out = run_cli("submit", str(REPO / recipe), "--executor", "local", "--runs-dir", str(runs_dir),
                  *[x for s in SETS for x in ("--set", s)], timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run,) = list_runs(runs_dir)
    return out.stdout, run


def check_validation_records(run, ranks: int) -> dict[int, float]:
    records = step_records(run.path)
    assert sorted(records) == list(range(ranks))
    per_step: dict[int, set] = {}
    for rank, recs in records.items():
        assert all(r["schema_version"] == SCHEMA_VERSION >= 2 for r in recs)
        for r in recs:
            if r["step"] in (3, 6):
                assert r["val_loss"] is not None and r["eval_time_s"] > 0, (rank, r)
                per_step.setdefault(r["step"], set()).add(r["val_loss"])
            else:
                assert r["val_loss"] is None and r["eval_time_s"] is None, (rank, r)
    assert all(len(v) == 1 for v in per_step.values()), per_step  # the same on every rank
    return {step: v.pop() for step, v in per_step.items()}


def test_megatron_main_command_console_progress_and_validation_loss(tmp_path):
    console, run = submit("recipes/gpt_3d.yaml", tmp_path)
    lines = console.splitlines()
    progress = [m for line in lines if (m := PROGRESS.search(line))]
    assert [int(m.group(1)) for m in progress] == [2, 3, 4, 6], console
    vals = {int(m.group(1)): float(m.group(3)) for m in progress if m.group(3)}
    assert sorted(vals) == [3, 6], console
    phases = [line.split("start-up: ")[1].rsplit(" ", 1)[0] for line in lines if "start-up: " in line]
    assert [p.split(" ")[0] for p in phases] == ["imports", "process", "model", "checkpoint", "first"], phases
    # library warnings: none on the console, each once in rank 0's log, and one console line counting them
    assert not [line for line in lines if "Warning:" in line or "warnings.warn" in line], console
    count = [line for line in lines if "library warning" in line]
    log0 = run.logs_dir / "rank00000.out"
    assert len(count) == 1 and str(log0) in count[0], console
    logged = [line for line in log0.read_text().splitlines() if " py.warnings: " in line]
    n = int(count[0].split("INFO hpc_tools: ")[1].split()[0])
    assert len(logged) == n > 0 and len(set(logged)) == n
    assert len(lines) <= 20, console  # a console to read: start-up, progress, the end (was 25 lines, 18 warnings)

    val = check_validation_records(run, 4)
    assert {s: round(v, 4) for s, v in val.items()} == vals and val[6] < val[3]

    status = run_cli("status", str(run.path))
    assert status.returncode == 0, status.stderr
    assert "progress step 6/6, loss " in status.stdout and f"val {val[6]:.4f} at step 6" in status.stdout
    data = json.loads(run_cli("status", str(run.path), "--json").stdout)
    assert data["progress"]["step"] == 6 and data["progress"]["latest_val_loss"] == pytest.approx(val[6])
    assert data["goodput"]["evaluation_s"] > 0  # its own bucket, not step time


@pytest.mark.deepspeed
def test_deepspeed_validation_loss_is_recorded_the_same_on_every_rank(tmp_path):
    console, run = submit("recipes/gpt_zero.yaml", tmp_path)
    val = check_validation_records(run, 2)
    assert sorted(val) == [3, 6] and val[6] < val[3], val
    assert f"val {val[6]:.4f}" in console
