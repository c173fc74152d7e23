"""The Megatron backend through the real entry point: run folder -> local executor -> hpc_tools.runtime.rank -> trainer.

recipes/gpt_3d.yaml's local profile (TP2 x PP2 with sequence parallelism, selective recompute, distributed optimizer)
on 4 CPU ranks, started as the README's main command: the loss falls, every rank writes its records, checkpoints are
kept as the recipe says and the manifest ends COMPLETED. Then the same run, cut to its first 12 steps, hit by a stop
signal (SIGUSR2, what Slurm sends before the time limit) checkpoints, stops, and a second launch resumes it to the
same losses as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.executors.local import run_local
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder
from tests.helpers import REPO, local_rank_pids

RECIPE = REPO / "recipes" / "gpt_3d.yaml"
STOP_AFTER_STEP = 4
RESUMED_ITERS = 12  # the stopped run trains the uninterrupted run's first 12 steps (of 30), a stop after step 4

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def prepare(root: Path, *overrides: str):
    from hpc_tools.submission import new_run

    recipe = load_recipe(RECIPE, list(overrides), profile="local")
    return recipe, new_run(recipe, root, "local", source=str(RECIPE))


def first_steps_of(uninterrupted, iters: int) -> list[str]:
    """Overrides for a run of the first ``iters`` steps of ``uninterrupted``: its learning-rate schedule kept (decay
    over the full run), so each of those steps computes the same loss (batches are a function of the step)."""
    return [f"training.train_iters={iters}", f"training.lr_decay_iters={uninterrupted.training.train_iters}"]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """step -> loss from the records of the ranks that compute it (every such rank must agree exactly)."""
    found: dict[int, float] = {}
    for path in sorted((run_dir / "records").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["loss"] is None:
                continue
            assert found.setdefault(rec["step"], rec["loss"]) == rec["loss"], f"ranks disagree on step {rec['step']}"
    return found


@pytest.fixture(scope="module")
def completed_run(main_command):
    """The README's main command (shared with the other tests that read it: tests/conftest.py main_command)."""
    recipe = load_recipe(RECIPE, profile="local")
    out = main_command("recipes/gpt_3d.yaml")
    assert out["returncode"] == 0, out["stderr"]
    return recipe, ParallelLayout.from_recipe(recipe), RunFolder(out["result"]["run_dir"]), 0, out["wall_s"]


def test_local_profile_trains_end_to_end(completed_run):
    recipe, layout, run, code, wall_s = completed_run
    assert run.manifest()["profile"] == "local"
    assert run.manifest()["state"] == "COMPLETED"
    assert (layout.tensor_size, layout.pipeline_size, layout.world_size) == (2, 2, 4)
    iters = recipe.training.train_iters
    for rank in range(layout.world_size):
        lines = (run.records_dir / f"rank{rank:05d}.jsonl").read_text().splitlines()
        steps = [json.loads(line)["step"] for line in lines]
        assert steps == list(range(1, iters + 1)), f"rank {rank} records"
        assert (run.records_dir / f"rank{rank:05d}.parquet").is_file()
    losses = losses_by_step(run.path)
    assert sorted(losses) == list(range(1, iters + 1))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (iters - 2, iters - 1, iters)) / 3
    assert last < first - 0.2, f"loss did not fall: {first:.3f} -> {last:.3f}"
    kept = [s for s, _ in CheckpointDirs(run.checkpoints_dir).complete()]
    interval = recipe.checkpoint.interval_iters
    expected = sorted({*range(interval, iters + 1, interval), iters})[-recipe.checkpoint.keep_last:]
    assert kept == expected
    print(f"\ne2e gpt_3d local: {iters} steps in {wall_s:.1f} s, loss {losses[1]:.4f} -> {losses[iters]:.4f}")


def test_stop_signal_checkpoints_and_resumes_to_the_same_losses(completed_run, tmp_path):
    full, layout, reference, code, _ = completed_run
    assert code == 0
    recipe, run = prepare(tmp_path, *first_steps_of(full, RESUMED_ITERS))
    records0 = run.records_dir / "rank00000.jsonl"
    signalled: list[int] = []

    def send_stop_signal():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if records0.exists() and len(records0.read_text().splitlines()) >= STOP_AFTER_STEP:
                for pid in local_rank_pids(run.path):
                    os.kill(pid, signal.SIGUSR2)
                    signalled.append(pid)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=send_stop_signal, daemon=True)
    watcher.start()
    assert run_local(run, layout.world_size) == 0, (run.logs_dir / "rank00000.out").read_text()[-3000:]
    watcher.join()
    assert len(signalled) == layout.world_size
    manifest = run.manifest()
    assert manifest["state"] == "PREEMPTED", manifest["events"][-3:]  # not under Slurm: no requeue
    stopped_at = manifest["last_step"]
    assert STOP_AFTER_STEP <= stopped_at < recipe.training.train_iters
    assert CheckpointDirs(run.checkpoints_dir).newest_step() == stopped_at

    assert run_local(run, layout.world_size) == 0, (run.logs_dir / "rank00000.out").read_text()[-3000:]
    assert run.manifest()["state"] == "COMPLETED"
    steps0 = [json.loads(line)["step"] for line in records0.read_text().splitlines()]
    assert steps0 == list(range(1, recipe.training.train_iters + 1)), "records must continue, never repeat"
    resumed = losses_by_step(run.path)
    uninterrupted = {s: loss for s, loss in losses_by_step(reference.path).items() if s <= RESUMED_ITERS}
    assert resumed == uninterrupted, {s: (resumed.get(s), uninterrupted[s]) for s in uninterrupted
                                      if resumed.get(s) != uninterrupted[s]}
    print(f"\nstopped at step {stopped_at}, resumed, {len(resumed)} losses equal to the uninterrupted run")
