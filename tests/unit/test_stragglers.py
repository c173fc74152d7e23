"""Stragglers by cause (profiling.stragglers) on synthetic synchronous runs: every rank's step time is the same (the
slow rank's peers wait for it in the collectives), so only how a rank spends its step can name it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.testing.synthetic import synthetic_run
from profiling import stragglers

STEPS = 30
WARMUP = 2


def synchronous(ranks: int, rng, *, compute=0.10, data=0.01, allreduce=0.02, slow: dict | None = None,
                pp_rank=None, sample_every: int = 1, noise: float = 0.005):
    """ranks x steps records of a synchronous data-parallel job. ``slow`` = {rank: (kind, seconds)} with kind
    compute, data or communication (a collective of its own, e.g. with a rank outside the compared ones, takes that
    much longer: its step is longer and its peers do not wait for it)."""
    c = compute + noise * rng.random((ranks, STEPS))
    d = data + 0.1 * noise * rng.random((ranks, STEPS))
    own_comm = np.zeros((ranks, STEPS))
    if pp_rank is not None:  # later stages compute more (e.g. the loss): legitimate, not a straggler
        c += 0.05 * np.asarray(pp_rank)[:, None]
    for rank, (kind, seconds) in (slow or {}).items():
        {"compute": c, "data": d, "communication": own_comm}[kind][rank] += seconds
    arrive = c + d  # when each rank reaches the step's collective
    step = arrive.max(axis=0) + allreduce  # everyone leaves the shared collective together
    comm = step[None, :] - arrive + own_comm  # its wait for the latest peer + the transfer + its own collectives
    step = step[None, :] + own_comm
    sampled = np.zeros(STEPS, bool)
    sampled[sample_every - 1::sample_every] = True
    comm[:, ~sampled] = np.nan
    return step, d, comm


def run(tmp_path, ranks, *, pp_rank=None, **kw):
    st, data, comm = synchronous(ranks, np.random.default_rng(7), pp_rank=pp_rank, **kw)
    columns = {"data_time_s": data, "comm_time_s": comm}
    if pp_rank is not None:
        columns["pp_rank"] = np.repeat(np.asarray(pp_rank)[:, None], STEPS, axis=1)
    folder = synthetic_run(tmp_path, [f"cluster.gpus_per_node={ranks}", f"training.global_batch_size={ranks}"],
                           st, **columns)
    return analyse([str(folder.path)], warmup=WARMUP)


@pytest.mark.parametrize("ranks,slow_rank,kind", [(4, 2, "compute"), (4, 1, "data"), (2, 0, "compute"),
                                                  (8, 5, "data")])
def test_the_slow_rank_and_only_it_is_named_with_its_cause(tmp_path, ranks, slow_rank, kind):
    result = run(tmp_path, ranks, slow={slow_rank: (kind, 0.05)})
    row = result.runs.iloc[0]
    assert row["rank_skew"] == pytest.approx(0.0), "step times are equal: the old step-time rule sees nothing"
    assert row["stragglers"] == str(slow_rank)
    assert row["straggler_nodes"] == "node000"
    assert row["straggler_verdict"].startswith(f"rank {slow_rank} (node node000): {kind}, busy +0.0")
    flags = result.ranks.set_index("rank")
    assert flags["straggler"].tolist() == [r == slow_rank for r in range(ranks)]
    assert flags.loc[slow_rank, "straggler_cause"] == kind
    assert flags.loc[slow_rank, "excess_s"] == pytest.approx(0.05, abs=0.01)
    assert flags.loc[slow_rank, "steps_slower"] == STEPS - WARMUP == flags.loc[slow_rank, "steps_compared"]
    assert flags.loc[slow_rank, "straggler_p"] == pytest.approx(0.5 ** (STEPS - WARMUP))
    table = result.stragglers
    assert table["rank"].tolist() == [slow_rank] and table["straggler_cause"].tolist() == [kind]
    js = result.to_json()
    assert [r["rank"] for r in js["ranks"] if r["straggler"]] == [slow_rank]
    assert js["stragglers"][0]["node"] == "node000"


def test_no_straggler_in_a_balanced_run_and_pipeline_stages_compared_only_with_their_peers(tmp_path):
    result = run(tmp_path, 4, pp_rank=[0, 0, 1, 1])
    row = result.runs.iloc[0]
    assert row["stragglers"] == "" and row["straggler_verdict"].startswith("none: no rank is slower")
    assert not result.ranks["straggler"].any()


def test_slow_own_communication_is_named_as_communication(tmp_path):
    result = run(tmp_path, 4, slow={3: ("communication", 0.05)})
    row = result.runs.iloc[0]
    assert row["stragglers"] == "3", row["straggler_verdict"]
    assert result.ranks.set_index("rank").loc[3, "straggler_cause"] == "communication"


def test_too_few_timed_steps_is_inconclusive_and_no_comm_is_not_measured(tmp_path):
    result = run(tmp_path, 4, slow={2: ("compute", 0.05)}, sample_every=10)
    row = result.runs.iloc[0]
    assert row["stragglers"] == "" and row["straggler_verdict"].startswith("inconclusive: 3 step(s)")
    verdicts, line = stragglers.judge(stragglers.StragglerSample(), 0.1)
    assert verdicts == [] and line.startswith("not measured")


def test_others_median_equals_brute_force():
    rng = np.random.default_rng(3)
    for n in (2, 3, 4, 5, 8):
        x = rng.random((n, 6))
        x[0, 0] = x[1, 0]  # ties
        got = stragglers.others_median(x)
        for i, s in itertools.product(range(n), range(6)):
            assert got[i, s] == pytest.approx(np.median(np.delete(x[:, s], i)))


def test_sign_test():
    assert stragglers.sign_test_p(7, 7) == pytest.approx(0.5 ** 7)
    assert stragglers.sign_test_p(0, 10) == 1.0
    assert stragglers.sign_test_p(9, 10) == pytest.approx(11 / 1024)


def test_status_analyze_and_sweep_rerun_exclude_on_the_command_line(tmp_path, cli):
    import json

    from hpc_tools.sweep.folder import SweepFolder

    st, data, comm = synchronous(4, np.random.default_rng(7), slow={2: ("compute", 0.05)})
    folder = synthetic_run(tmp_path, ["cluster.gpus_per_node=4", "training.global_batch_size=4"], st,
                           data_time_s=data, comm_time_s=comm, state="RUNNING")
    status = cli("status", str(folder.path))
    assert status.returncode == 0, status.stderr
    assert "stragglers rank 2 (node node000): compute, busy +0.0" in status.stdout, status.stdout
    assert "goodput " in status.stdout and "rank-hours" in status.stdout, status.stdout
    out = cli("analyze", str(folder.path), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [r["straggler"] for r in data["ranks"]] == [False, False, True, False]
    assert data["stragglers"][0]["straggler_cause"] == "compute" and data["goodput"][0]["unit"] == "rank"
    cells = [{"id": "c000-r0", "cell": 0, "repeat": 0, "label": "n=4", "params": {}, "overrides": [],
              "run_dir": str(folder.path), "run_id": folder.run_id, "job_id": None, "status": "failed",
              "attempts": []}]
    sweep = SweepFolder.create(tmp_path / "runs", "demo", {"executor": "local", "cells": cells, "invalid": []})
    bad = cli("sweep", "rerun", str(sweep.path), "--failed", "--exclude", "n2", "--executor", "local")
    assert bad.returncode == 2 and "--exclude 'n2': only Slurm places jobs on nodes" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr


def test_sweep_rerun_exclude_reaches_the_slurm_submission(tmp_path, monkeypatch):
    from hpc_tools.executors import slurm
    from hpc_tools.registry import RunFolder
    from hpc_tools.runstate import FAILURE_STATUSES
    from hpc_tools.sweep import runner
    from hpc_tools.sweep.folder import SweepFolder

    submitted = []

    class Job:
        job_id = "4242"

    def fake_submit_run(run, recipe, exclude=None, **kw):
        submitted.append(("run", exclude))
        return Job()

    def fake_submit_array(runs, recipe, exclude=None):
        submitted.append(("array", exclude))
        return [Job() for _ in runs]

    monkeypatch.setattr(slurm, "submit_run", fake_submit_run)
    monkeypatch.setattr(slurm, "submit_array", fake_submit_array)
    sweep = SweepFolder.create(tmp_path / "runs", "demo", {"executor": "slurm", "cells": [], "invalid": []})
    runs = [synthetic_run(sweep.path, ["cluster.gpus_per_node=2"], np.ones((2, 3)), state="FAILED")
            for _ in range(2)]
    cells = [{"id": f"c00{i}-r0", "cell": i, "repeat": 0, "label": f"n={i}", "params": {}, "overrides": [],
              "run_dir": r.run_id, "run_id": r.run_id, "job_id": None, "status": "failed", "attempts": []}
             for i, r in enumerate(runs)]
    with sweep.edit() as d:
        d["cells"] = cells
    ids = runner.rerun(sweep, FAILURE_STATUSES, "slurm", lambda line: None, exclude="n2")
    assert ids == ["c000-r0", "c001-r0"] and submitted == [("array", "n2")]
    new = [RunFolder(sweep.path / c["run_dir"]) for c in sweep.read()["cells"]]
    assert all(r.manifest().get("exclude") == "n2" for r in new)


def test_sample_takes_a_mask_or_a_slice_of_the_measured_records():
    cols = {"step": np.arange(1.0, 11.0), "step_time_s": np.full(10, 1.0), "data_time_s": np.full(10, 0.1),
            "comm_time_s": np.where(np.arange(10) % 2 == 0, 0.3, np.nan)}
    by_mask, by_slice = stragglers.StragglerSample(), stragglers.StragglerSample()
    by_mask.add_rank(0, 0, cols, np.arange(10) >= 2)
    by_slice.add_rank(0, 0, cols, slice(2, 10))
    for a, b in zip(by_mask.ranks[0][1:], by_slice.ranks[0][1:]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(by_slice.ranks[0][1], [3, 5, 7, 9])
    np.testing.assert_allclose(by_slice.ranks[0][2], 0.7)  # busy = step - comm
