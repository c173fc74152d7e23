"""Run folders: atomic creation, locked manifest updates, lookup; many writers at once."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from hpc_tools.errors import UserError
from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder, find_run, list_runs
from hpc_tools.submission import new_run
from tests.helpers import REPO


def _make_and_update(root: str) -> str:
    recipe = load_recipe(REPO / "recipes/comm_check.yaml", profile="local")
    run = new_run(recipe, root, "local")
    for i in range(5):
        run.update(event=f"tick {i}", counter=i)
    return str(run.path)


def test_twenty_concurrent_writers_give_twenty_intact_folders(tmp_path):
    with mp.get_context("spawn").Pool(4) as pool:
        paths = pool.map(_make_and_update, [str(tmp_path)] * 20)
    assert len(set(paths)) == 20
    runs = list_runs(tmp_path)
    assert len(runs) == 20 and not [p for p in tmp_path.iterdir() if p.name.startswith(".") and p.is_dir()]
    for run in runs:
        manifest = json.loads((run.path / "manifest.json").read_text())
        assert manifest["counter"] == 4 and [e["event"] for e in manifest["events"]] == [f"tick {i}" for i in range(5)]
        assert (run.path / "recipe.yaml").read_text().startswith("name: comm_check")
        assert (run.path / "job.sbatch").read_text().startswith("#!/bin/bash")


def test_failed_creation_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError, match="round trip"):
        RunFolder.create(tmp_path, "r1", "a: 1\n", "#!/bin/bash\n", {}, check_recipe=lambda t: t + "changed")
    assert list(tmp_path.iterdir()) == []


def test_find_run_by_prefix_and_job_id(tmp_path):
    a = RunFolder.create(tmp_path, "alpha-1", "x: 1\n", "", {"job_id": "77"})
    RunFolder.create(tmp_path, "alpha-2", "x: 1\n", "", {"job_id": "78"})
    assert find_run("77", tmp_path).path == a.path
    assert find_run(str(a.path), tmp_path).path == a.path
    with pytest.raises(UserError, match="matches 2 runs"):
        find_run("alpha", tmp_path)
    with pytest.raises(UserError, match="no run matches"):
        find_run("beta", tmp_path)
    assert Path(find_run("alpha-2", tmp_path).path).name == "alpha-2"


def test_first_terminal_state_of_a_life_stands(tmp_path):
    run = RunFolder.create(tmp_path, "r", "x: 1\n", "", {})
    run.update(event="slurm CANCELLED", state="CANCELLED")
    run.update(event="preempted", state="PREEMPTED", last_step=4)  # a rank reporting its stop afterwards
    manifest = run.manifest()
    assert manifest["state"] == "CANCELLED" and manifest["last_step"] == 4
    assert [e["event"] for e in manifest["events"]] == ["slurm CANCELLED", "preempted"]
    run.update(event="started", state="RUNNING")  # a requeued job starts a new life
    assert run.manifest()["state"] == "RUNNING"


def test_slurms_verdict_replaces_the_ranks_stop_report(tmp_path):
    run = RunFolder.create(tmp_path, "r", "x: 1\n", "", {})
    run.update(event="preempted", state="PREEMPTED")  # SIGTERM reached the ranks first
    run.update(event="slurm CANCELLED", state="CANCELLED")
    run.update(event="exited", state="COMPLETED")
    assert run.manifest()["state"] == "CANCELLED"
