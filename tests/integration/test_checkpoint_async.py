"""Background saves and the node-local tier on Megatron (DP2 on 2 CPU ranks) through the real entry point: 2 launches.

Run A (8 steps, ``checkpoint.async_save``): a local-tier save after every step (``local_interval_iters: 1``, the
folder given as ``$HPCT_LOCAL/ckpt``, expanded on the rank) and a shared one every 4 steps; the background writer of
step 3 is killed right after it started (``HPC_TOOLS_INJECT_KILL_CKPT_WRITER``). Step 3 is never committed (no
``iter_0000003`` anywhere, iter_2 stays the newest, the save's record says verified: false); every other save is
complete, and ``status --json`` lists the saves with their blocked and write times.

Run B is the restart after a crash between steps 5 and 6: its shared tier holds A's iter_4, its local tier (a tmpfs
just larger than one checkpoint, or where nothing can be mounted a free-space hook) A's iter_5, written in the
background. B resumes from the local iter_5 (the newer one), its steps 6-8 have A's losses bit for bit (so the
background write saved the state of step 5, not a later one), and its local saves find the tier full: each goes to
the shared tier, told in one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from hpc_tools.checkpoints.dirs import CheckpointDirs, dir_name
from hpc_tools.executors.local import run_local
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from hpc_tools.train.checkpointing.saver import INJECT_KILL_WRITER_ENV, INJECT_LOCAL_FREE_ENV
from profiling.records import read_events
from tests.helpers import REPO, loss_curve, run_cli

ITERS = 8
SETS = [f"training.train_iters={ITERS}", "training.lr_decay_iters=9", "checkpoint.interval_iters=4",
        "checkpoint.keep_last=10", "checkpoint.async_save=true", "checkpoint.local_dir=$HPCT_LOCAL/ckpt",
        "checkpoint.local_interval_iters=1", "training.log_interval=1",
        "parallel.tensor_size=1", "parallel.sequence_parallel=false", "parallel.pipeline_size=1",
        "cluster.gpus_per_node=2"]

pytestmark = [pytest.mark.slow, pytest.mark.megatron]


def prepare(root: Path, *extra: str):
    from hpc_tools.submission import new_run

    recipe = load_recipe(REPO / "recipes" / "gpt_3d.yaml", [*SETS, *extra], profile="local")
    return recipe, new_run(recipe, root, "local", source="gpt_3d.yaml")


def launch(recipe, run, **env: str) -> int:
    return run_local(run, ParallelLayout.from_recipe(recipe).world_size, extra_env={"PYTHONPATH": str(REPO), **env})


def log0(run) -> str:
    return (run.logs_dir / "rank00000.out").read_text(errors="replace")


def steps(dirs: CheckpointDirs) -> list[int]:
    return [s for s, _ in dirs.complete()]


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    recipe, a = prepare(root / "a")
    local_a = root / "local_a"
    assert launch(recipe, a, HPCT_LOCAL=str(local_a), **{INJECT_KILL_WRITER_ENV: "3"}) == 0, log0(a)[-4000:]

    shared_b, mount = root / "shared_b", root / "local_b"
    (shared_b).mkdir()
    shutil.copytree(a.checkpoints_dir / dir_name(4), shared_b / dir_name(4))
    iter5 = local_a / "ckpt" / a.path.name / dir_name(5)  # <local_dir>/<run folder name>/iter_N
    recipe_b, b = prepare(root / "b", f"checkpoint.dir={shared_b}")
    mount.mkdir()
    size = folder_bytes(iter5)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.05) + (256 << 10)}", "tmpfs",
                              str(mount)], capture_output=True).returncode == 0
    try:
        shutil.copytree(iter5, mount / "ckpt" / b.path.name / dir_name(5))
        env = {"HPCT_LOCAL": str(mount)} if mounted else {"HPCT_LOCAL": str(mount), INJECT_LOCAL_FREE_ENV: "4096"}
        assert launch(recipe_b, b, **env) == 0, log0(b)[-4000:]
        local_b = steps(CheckpointDirs(mount / "ckpt" / b.path.name))
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], check=False)
    return {"a": a, "local_a": CheckpointDirs(local_a / "ckpt" / a.path.name), "b": b,
            "shared_b": CheckpointDirs(shared_b), "local_b": local_b, "root": root, "mounted": mounted}


def test_a_killed_background_writer_is_never_committed(runs):
    a, local = runs["a"], runs["local_a"]
    assert steps(local) == [1, 2, 5, 6, 7], (steps(local), log0(a)[-3000:])
    assert steps(CheckpointDirs(a.checkpoints_dir)) == [4, 8]
    assert not any(p.name.startswith(dir_name(3)) for p in local.root.iterdir()), list(local.root.iterdir())
    log = log0(a)
    assert "checkpoint of step 3 (local tier, written in the background) failed" in log, log[-3000:]
    assert f"{dir_name(2)} stays the newest" in log
    for step, tier in ((5, "local"), (4, "shared")):
        meta = CheckpointDirs.read_meta((local.root if tier == "local" else a.checkpoints_dir) / dir_name(step))
        assert meta["async"] is True and meta["tier"] == tier and len(meta["files"]["by_rank"]) == 2
    assert CheckpointDirs.read_meta(a.checkpoints_dir / dir_name(8))["async"] is False  # the last save: synchronous


def test_status_lists_the_saves_and_goodput_has_checkpoint_blocked(runs):
    a = runs["a"]
    out = run_cli("status", a.run_id, "--json", "--runs-dir", str(a.path.parent))
    assert out.returncode == 0, out.stderr[-2000:]
    status = json.loads(out.stdout)
    saves = {c["iteration"]: c for c in status["checkpoints"]}
    assert sorted(saves) == list(range(1, ITERS + 1))
    assert saves[3]["verified"] is False and saves[3]["async"] is True
    assert saves[8] == {**saves[8], "tier": "shared", "async": False, "verified": True}
    for step in (1, 2, 4, 5, 6, 7):
        c = saves[step]
        assert c["async"] is True and c["verified"] is True and c["tier"] == ("shared" if step == 4 else "local")
        assert 0 < c["blocked_s"] and 0 < c["write_s"], c
    g = status["goodput"]  # the slowest rank's blocked time per save, summed; rank 0's is in `checkpoints`
    assert sum(c["blocked_s"] for c in status["checkpoints"]) <= g["checkpoint_blocked_s"] < g["allocation_s"], g
    assert g["recovery_s"] == 0.0 and g["checkpoint_save_s"] == g["checkpoint_blocked_s"], g
    events = [e for e in read_events(a.records_dir)[0] if e.get("event") == "checkpoint_save"]
    assert {e["step"] for e in events} == set(range(1, ITERS + 1))


def test_restart_takes_the_newer_local_checkpoint_and_a_full_local_tier_falls_back(runs):
    a, b = runs["a"], runs["b"]
    log = log0(b)
    local5 = b.path.parent.parent / "local_b" / "ckpt" / b.path.name / dir_name(5)
    assert f"resumed from {local5} at step 5" in log, log[-3000:]
    ref, got = loss_curve(a.path), loss_curve(b.path)
    assert [got[s] for s in (6, 7, 8)] == [ref[s] for s in (6, 7, 8)]  # bit for bit
    assert steps(runs["shared_b"]) == [4, 6, 7, 8]  # the local saves of 6 and 7 found no room
    assert runs["local_b"] == [5]
    told = [line for line in log.splitlines() if "local checkpoint tier full or unusable" in line]
    assert len(told) == 2 and "step 6 saved to the shared tier" in told[0], told
