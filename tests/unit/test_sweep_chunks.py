"""Splitting a sweep into job arrays under Slurm's limits (hpc_tools.sweep.chunks), property-style: a simulated
Slurm that runs each array's tasks up to its throttle, over grid sizes, MaxArraySize, queue limits and
sweep.max_parallel; plus the limits read from Slurm's own output (hpc_tools.sweep.limits) and the sweep record
(hpc_tools.sweep.submit)."""

from __future__ import annotations

import random
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_tools.errors import UserError
from hpc_tools.sweep import chunks
from hpc_tools.sweep.limits import SlurmLimits, config_limits, enforces_limits, read_limits, refusal, submit_limit


class FakeSlurm:
    """Arrays of tasks ('P' pending, 'R' running, 'D' done); a task starts only while its array runs fewer than its
    throttle, and only ``slots`` tasks run on the cluster at once."""

    def __init__(self, slots: int):
        self.slots, self.arrays, self.submitted = slots, [], 0

    def live(self) -> list[chunks.LiveArray]:
        return [chunks.LiveArray(str(i), a["throttle"], sum(t != "D" for t in a["tasks"]))
                for i, a in enumerate(self.arrays) if any(t != "D" for t in a["tasks"])]

    def queued(self) -> int:
        return sum(t != "D" for a in self.arrays for t in a["tasks"])

    def running(self) -> int:
        return sum(t == "R" for a in self.arrays for t in a["tasks"])

    def schedule(self, rng: random.Random) -> None:
        for a in self.arrays:
            for i, t in enumerate(a["tasks"]):
                if t == "P" and a["tasks"].count("R") < a["throttle"] and self.running() < self.slots:
                    a["tasks"][i] = "R"
        for a in self.arrays:
            a["tasks"] = ["D" if t == "R" and rng.random() < 0.4 else t for t in a["tasks"]]


def drive(cells: int, cap: int, queue_limit: int | None, throttle: int | None, slots: int, seed: int) -> int:
    """Run a sweep of ``cells`` through ``chunks.plan`` against FakeSlurm, checking every limit at every tick;
    returns how many cells were submitted in all, once the queue has drained."""
    rng, slurm, due = random.Random(seed), FakeSlurm(slots), cells
    for _ in range(50 * cells + 50):
        room = None if queue_limit is None else queue_limit - slurm.queued()
        live = slurm.live()
        plan = chunks.plan([chunks.Group(due, cap)] if due else [], live, room, throttle)
        olds = {a.job: a.throttle for a in live}
        for job, new in plan.raises:
            assert new > olds[job], "a throttle is only raised"
            slurm.arrays[int(job)]["throttle"] = new
        for c in plan.chunks:
            assert 1 <= c.size <= cap and 1 <= c.throttle <= c.size
            slurm.arrays.append({"throttle": c.throttle, "tasks": ["P"] * c.size})
            due -= c.size
        assert due >= 0
        live = slurm.live()
        if throttle is not None:
            assert chunks.running_bound(live) <= throttle
            held = due > 0 or any(a.live > a.throttle for a in live)
            if held and (room is None or room - sum(c.size for c in plan.chunks) > 0):
                assert chunks.running_bound(live) == throttle, "the throttle's room is left unused"
        elif due:
            assert room is not None and slurm.queued() == queue_limit, "cells held back with room in the queue"
        if queue_limit is not None:
            assert slurm.queued() <= queue_limit
        slurm.schedule(rng)
        assert throttle is None or slurm.running() <= throttle
        if due == 0 and slurm.queued() == 0:
            return sum(len(a["tasks"]) for a in slurm.arrays)
    raise AssertionError(f"sweep of {cells} did not finish: due {due}, arrays {slurm.arrays}")


@settings(max_examples=150, deadline=None)
@given(cells=st.integers(1, 80), cap=st.integers(1, 30), queue_limit=st.one_of(st.none(), st.integers(1, 40)),
       throttle=st.one_of(st.none(), st.integers(1, 20)), slots=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_every_cell_runs_once_within_every_limit(cells, cap, queue_limit, throttle, slots, seed):
    assert drive(cells, cap, queue_limit, throttle, slots, seed) == cells  # each cell submitted once


def test_the_done_when_case_25_cells_max_array_size_10():
    first = chunks.plan([chunks.Group(25, 10)], [], None, None)
    assert [(c.size, c.throttle) for c in first.chunks] == [(10, 10), (10, 10), (5, 5)]  # all at once, no %256
    throttled = chunks.plan([chunks.Group(25, 10)], [], None, 4)
    assert [(c.size, c.throttle) for c in throttled.chunks] == [(10, 4)]  # the rest waits for the throttle's room
    later = chunks.plan([chunks.Group(15, 10)], [chunks.LiveArray("7", 4, 3)], None, 4)
    assert later.raises == [] and [(c.size, c.throttle) for c in later.chunks] == [(10, 1)]
    drained = chunks.plan([chunks.Group(5, 10)], [chunks.LiveArray("7", 4, 1), chunks.LiveArray("8", 1, 10)], None, 4)
    assert drained.raises == [("8", 3)] and drained.chunks == []  # 7 still runs one


def test_groups_and_queue_room_split_in_order():
    plan = chunks.plan([chunks.Group(3, 10), chunks.Group(4, 1)], [], 5, None)
    assert [(c.group, c.size) for c in plan.chunks] == [(0, 3), (1, 1), (1, 1)]
    assert chunks.plan([chunks.Group(3, 10)], [], 0, None).chunks == []


# --- what Slurm says ------------------------------------------------------------------------------------------------

def test_config_limits_and_enforcement():
    assert config_limits({"MaxArraySize": "10", "MaxJobCount": "10000",
                          "SchedulerParameters": "bf_interval=1,max_array_tasks=4"}) == (10, 4, 10000)
    assert config_limits({}) == (1001, None, 10000)  # Slurm's defaults
    assert not enforces_limits({"AccountingStorageType": "accounting_storage/slurmdbd",
                                "AccountingStorageEnforce": "none"})
    assert enforces_limits({"AccountingStorageType": "accounting_storage/slurmdbd",
                            "AccountingStorageEnforce": "associations,limits"})
    assert not enforces_limits({"AccountingStorageType": "accounting_storage/none",
                                "AccountingStorageEnforce": "limits"})


def test_submit_limit_from_sacctmgr():
    # `sacctmgr -nP show assoc ... format=MaxSubmit,GrpSubmit,QOS` and `show qos format=Name,MaxSubmitPU,GrpSubmit`
    assert submit_limit("||normal\n", "normal|||\nlow|5|\n") is None
    assert submit_limit("50||normal,low\n", "normal|||\nlow|20|\nhigh|3|\n") == 20  # high is not the user's
    assert submit_limit("||normal\n", "normal||7\n") == 7


def test_limits_arithmetic():
    lim = SlurmLimits(10, None, 10000, 30, "sacctmgr", queued_user=12, queued_all=40, user="u")
    assert (lim.array_tasks, lim.queue_room, lim.queue_limit) == (10, 18, 30)
    off = SlurmLimits(0, None, 10000, None, "not enforced", 0, 9990, "u")
    assert (off.array_tasks, off.queue_room, off.queue_limit) == (1, 10, 10000)  # MaxArraySize 0: single jobs
    assert SlurmLimits(1001, 50, None, None, "", 0, 0, "u").array_tasks == 50
    assert refusal(lim) is None
    line = refusal(SlurmLimits(10, None, 10000, 0, "sacctmgr", user="u"))
    assert "MaxSubmitJobs=0" in line and "\n" not in line


def test_read_limits_asks_sacctmgr_only_where_limits_are_enforced():
    asked = []

    def runner(enforce: str):
        def run(cmd, **kw):
            asked.append(cmd[0])
            out = {"scontrol": f"MaxArraySize = 10\nMaxJobCount = 500\nAccountingStorageType = "
                               f"accounting_storage/slurmdbd\nAccountingStorageEnforce = {enforce}\n",
                   "sacctmgr": "4||normal\n" if "assoc" in cmd else "normal|||\n",
                   "squeue": "u\nu\nother\n"}[cmd[0]]
            return subprocess.CompletedProcess(cmd, 0, out, "")
        return run

    lim = read_limits(runner("none"))
    assert asked == ["scontrol", "squeue"] and lim.max_submit_jobs is None and "unbounded" in lim.submit_note
    assert (lim.max_array_size, lim.max_job_count, lim.queued_all) == (10, 500, 3)
    asked.clear()
    lim = read_limits(runner("associations,limits"))
    assert asked == ["scontrol", "sacctmgr", "sacctmgr", "squeue"] and lim.max_submit_jobs == 4


# --- the sweep's record ---------------------------------------------------------------------------------------------

@pytest.fixture
def record(tmp_path, monkeypatch):
    """A Slurm sweep of 25 created cells over synthetic runs, with sbatch replaced by a counter."""
    from hpc_tools.executors import slurm
    from hpc_tools.sweep.folder import SweepFolder
    from hpc_tools.testing.synthetic import synthetic_run

    arrays = []

    class Job:
        def __init__(self, job_id):
            self.job_id = job_id

    def fake_array(runs, recipe, exclude=None, parallelism=None):
        arrays.append((len(runs), parallelism))
        return [Job(f"{100 + len(arrays)}_{i}") for i in range(len(runs))]

    monkeypatch.setattr(slurm, "submit_array", fake_array)
    monkeypatch.setattr(slurm, "submit_run", lambda run, recipe, exclude=None: Job(str(900 + len(arrays))))
    sweep = SweepFolder.create(tmp_path / "runs", "demo", {"executor": "slurm", "max_parallel": 4, "cells": [],
                                                           "invalid": []})
    run = synthetic_run(sweep.path, [], np.ones((1, 2)), state="CREATED")  # one folder: sbatch is not called
    with sweep.edit() as d:  # cells as create_sweep writes them for Slurm, with their submission group
        d["cells"] = [{"id": f"c{i:03d}-r0", "cell": i, "repeat": 0, "label": f"i={i}", "params": {}, "overrides": [],
                       "run_dir": run.run_id, "run_id": run.run_id, "job_id": None, "status": "pending",
                       "attempts": [], "group": "same resources"} for i in range(25)]
    return sweep, arrays


def test_submit_due_records_chunks_and_submits_each_cell_once(record):
    from hpc_tools.sweep.submit import submit_due

    sweep, arrays = record
    lim = SlurmLimits(10, None, 10000, None, "not enforced", user="u")
    said = []
    assert len(submit_due(sweep, said.append, lim)) == 10 and arrays == [(10, 4)]
    data = sweep.read()
    assert data["waiting"] == 15 and data["chunks"][0]["job"] == "101" and data["chunks"][0]["throttle"] == 4
    assert [c["job_id"] for c in data["cells"][:3]] == ["101_0", "101_1", "101_2"]
    assert any("15 cell(s) wait for room" in line for line in said)
    assert submit_due(sweep, said.append, lim) == [] and arrays == [(10, 4)]  # the throttle is taken: nothing new
    with sweep.edit() as d:  # eight of the first array ended
        for c in d["cells"][:8]:
            c["status"] = "completed"
    assert len(submit_due(sweep, said.append, lim)) == 10 and arrays == [(10, 4), (10, 2)]
    with pytest.raises(UserError, match="MaxSubmitJobs=0"):
        submit_due(sweep, said.append, SlurmLimits(10, None, 10000, 0, "sacctmgr", user="u"))


def test_cells_with_restarts_go_in_as_single_jobs_and_the_throttle_counts_them(record):
    from hpc_tools.sweep.submit import submit_due

    sweep, arrays = record
    with sweep.edit() as d:
        d["cells"] = d["cells"][:5]
        for c in d["cells"][:3]:
            c["group"] = None  # cluster.restarts: its own job (create_sweep writes None)
    submitted = submit_due(sweep, lambda line: None, SlurmLimits(10, None, 10000, None, "not enforced", user="u"))
    data = sweep.read()
    assert len(submitted) == 5 and data["waiting"] == 0
    assert [(len(c["cells"]), c["throttle"]) for c in data["chunks"]] == [(1, 1), (1, 1), (1, 1), (2, 1)]
    assert arrays == [(2, 1)]  # three single jobs take 3 of max_parallel 4: the array of the other two gets %1


def test_an_array_task_cancelled_before_it_started_ends_its_cell(record, monkeypatch):
    """`sacct -j 49_6` says nothing of a task cancelled while pending; `sacct -j 49` prints it in the array's line
    (Slurm 22.05's output below, as the test cluster gave it)."""
    from hpc_tools.runstate import SacctReader
    from hpc_tools.sweep import runner

    sweep, _ = record
    lines = {"49": "49_0|COMPLETED|0:0|00:00:52|n1\n49_[6-9%4]|CANCELLED by 0|0:0|00:00:00|None assigned\n"}
    asked = []

    def sacct(ids):
        asked.append(list(ids))
        return "".join(lines.get(i, "") for i in ids)

    monkeypatch.setattr(runner, "READER", SacctReader(query=sacct))
    with sweep.edit() as d:
        d["cells"] = d["cells"][:2]
        d["cells"][0]["job_id"], d["cells"][1]["job_id"] = "49_0", "49_6"
    data = runner.refresh(sweep)
    assert [c["status"] for c in data["cells"]] == ["completed", "cancelled"] and "49" in asked[0]


def test_a_sweep_slurm_cannot_take_is_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import yaml

    from hpc_tools import submission
    from hpc_tools.cli import main
    from hpc_tools.sweep import grid, limits
    from tests.unit.inline_recipes import GPT_3D

    monkeypatch.setattr(submission, "choose_executor", lambda *a, **k: ("slurm", ""))  # a cluster that answers
    monkeypatch.setattr(grid, "check_world", lambda plan, slurm: None)  # its partition (asked of sinfo) fits
    monkeypatch.setattr(limits, "read_limits", lambda: SlurmLimits(1001, None, 10000, 0, "sacctmgr", user="ann"))
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(yaml.safe_dump({**GPT_3D, "sweep": {"grid": {"training.seed": [1, 2]}, "max_parallel": 2}}))
    code = main(["sweep", str(recipe), "--runs-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "lets user ann queue no jobs (MaxSubmitJobs=0" in err, err
    assert not (tmp_path / "runs").exists()


def test_a_cell_whose_run_ended_counts_until_its_slurm_job_has(record):
    from hpc_tools.sweep.submit import submit_due

    sweep, arrays = record
    lim = SlurmLimits(10, None, 10000, None, "not enforced", user="u")
    submit_due(sweep, lambda line: None, lim)
    with sweep.edit() as d:  # eight runs recorded their end; Slurm still runs the job of the eighth
        for c in d["cells"][:8]:
            c.update(status="completed", slurm_state="COMPLETED")
        d["cells"][7]["slurm_state"] = "RUNNING"
    submit_due(sweep, lambda line: None, lim)
    assert arrays == [(10, 4), (10, 1)]  # 3 of the first array hold places, not 2
