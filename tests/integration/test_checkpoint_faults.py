"""Fault injection on both backends through the real entry point (run folder -> local executor -> rank -> loop).

One uninterrupted run of 5 steps (a checkpoint after each), then one faulty run in a new folder holding a copy of its
checkpoints, which meets, in this order:

* random bytes in a tensor file (iter_5), a truncated shard (iter_4) and a missing shard (iter_3): the resume sets
  each aside (``iter_N.bad-<reason>``, never deleted), falls back to the one before, and from iter_2 on the losses
  equal the uninterrupted run's;
* a NaN loss injected on rank 1 only (``HPC_TOOLS_INJECT_NONFINITE``) at step 6: skipped and counted on every rank,
  no checkpoint of it, the weights stay finite (step 7 trains and saves); at steps 8 and 9, two in a row with
  ``training.max_nonfinite_steps=1``: the job stops with an error naming step 9 and ``latest`` stays iter_7.

The schedule is fixed by ``training.lr_decay_iters`` so that the 5-step and the 9-step runs share it. Two launches per
backend, tiny models on 2 CPU ranks.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest

from hpc_tools.checkpoints.dirs import META, CheckpointDirs
from hpc_tools.executors.local import run_local
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from hpc_tools.train.loop import INJECT_NONFINITE_ENV
from profiling.records import read_jsonl
from tests.helpers import REPO

STEPS = ["training.train_iters=5", "training.lr_decay_iters=9", "checkpoint.interval_iters=1",
         "checkpoint.keep_last=10", "training.log_interval=1"]
BACKENDS = {
    # DP2 with the distributed optimizer: every rank writes its own torch_dist shard.
    "megatron": ("gpt_3d.yaml", ["parallel.tensor_size=1", "parallel.sequence_parallel=false",
                                "parallel.pipeline_size=1", "cluster.gpus_per_node=2"]),
    "deepspeed": ("gpt_zero.yaml", []),  # ZeRO-2 on 2 ranks: one optimizer shard per rank
}

pytestmark = [pytest.mark.slow]


def prepare(root: Path, backend: str, *extra: str):
    from hpc_tools.submission import new_run

    name, overrides = BACKENDS[backend]
    recipe = load_recipe(REPO / "recipes" / name, [*STEPS, *overrides, *extra], profile="local")
    return recipe, new_run(recipe, root, "local", source=name)


def launch(recipe, run, **env: str) -> int:
    return run_local(run, ParallelLayout.from_recipe(recipe).world_size, extra_env={"PYTHONPATH": str(REPO), **env})


def log0(run) -> str:
    return (run.logs_dir / "rank00000.out").read_text(errors="replace")


def records(run, rank: int = 0) -> dict[int, dict]:
    """step -> the newest record of that step on ``rank``."""
    return {r["step"]: r for r in read_jsonl(run.records_dir / f"rank{rank:05d}.jsonl")}


def largest_file(folder: Path) -> Path:
    return max((p for p in folder.iterdir() if p.is_file() and p.name != META), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module", params=[pytest.param("megatron", marks=pytest.mark.megatron),
                                        pytest.param("deepspeed", marks=pytest.mark.deepspeed)])
def reference(request, tmp_path_factory):
    """The uninterrupted run of 5 steps with a checkpoint after each."""
    backend = request.param
    recipe, run = prepare(tmp_path_factory.mktemp(f"ref_{backend}"), backend)
    assert launch(recipe, run) == 0, log0(run)[-3000:]
    assert [s for s, _ in CheckpointDirs(run.checkpoints_dir).complete()] == [1, 2, 3, 4, 5]
    return backend, run


def test_bad_checkpoints_fall_back_and_nonfinite_steps_are_skipped_then_stop(reference, tmp_path):
    backend, ref = reference
    recipe, run = prepare(tmp_path, backend, "training.train_iters=9", "training.max_nonfinite_steps=1")
    shutil.rmtree(run.checkpoints_dir, ignore_errors=True)
    shutil.copytree(ref.checkpoints_dir, run.checkpoints_dir)
    dirs = CheckpointDirs(run.checkpoints_dir)
    hit = {}
    # iter_5: 4 KiB of random bytes in the middle of the largest tensor file (same size: only the checksum sees it)
    path = largest_file(dirs.final_path(5))
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(os.urandom(4096))
    hit[5] = path.name
    path = largest_file(dirs.final_path(4))  # iter_4: a truncated shard
    os.truncate(path, path.stat().st_size // 2)
    hit[4] = path.name
    path = largest_file(dirs.final_path(3))  # iter_3: a missing shard
    path.unlink()
    hit[3] = path.name

    code = launch(recipe, run, **{INJECT_NONFINITE_ENV: "6,8,9@1"})
    text = log0(run)
    # The fallback.
    aside = {p.name: (p / "SET_ASIDE.txt").read_text() for p in dirs.set_aside_folders()}
    assert sorted(aside) == ["iter_0000003.bad-missing", "iter_0000004.bad-size", "iter_0000005.bad-checksum"], \
        text[-3000:]
    for step, name in hit.items():
        note = next(text for folder, text in aside.items() if folder.startswith(f"iter_{step:07d}"))
        assert name in note, (step, note)
    assert "falling back to the previous complete checkpoint" in text and hit[5] in text
    assert "iter_0000002 at step 2" in text and "checkpoint verified:" in text
    mine, theirs = records(run), records(ref)
    assert {s: mine[s]["loss"] for s in (3, 4, 5)} == {s: theirs[s]["loss"] for s in (3, 4, 5)}, \
        "the losses after the fallback are the uninterrupted run's"
    # The non-finite guard.
    assert code != 0, text[-3000:]
    assert "NonFiniteError: step 9: loss or gradient norm not finite" in text and \
        "steps 8..9 (training.max_nonfinite_steps=1)" in text, text[-3000:]
    for rank in (0, 1):
        rows = records(run, rank)
        assert sorted(rows) == list(range(3, 10)), "records from the resumed step to the stopping step"
        assert [s for s, r in rows.items() if r["nonfinite"]] == [6, 8, 9]
        assert all(rows[s]["skipped"] for s in (6, 8, 9))
        assert math.isfinite(rows[7]["loss"]) and not rows[7]["nonfinite"], "step 6 skipped: the weights stayed finite"
    assert [s for s, _ in dirs.complete()] == [1, 2, 3, 4, 5, 7], "no checkpoint of the non-finite steps 6 and 8"
    assert dirs.read_latest() == dirs.final_path(7) and not dirs.partial_path(8).exists()
    assert "checkpoint of step 6 not saved" in text and "checkpoint of step 8 not saved" in text
    print(f"\n{backend}: 3 bad checkpoints set aside, resumed from step 2, losses 3..5 equal the uninterrupted run; "
          "step 6 skipped, stopped at step 9, latest stays iter_0000007")
