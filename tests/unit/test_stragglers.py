"""Stragglers by cause (profiling.stragglers) on synthetic synchronous runs: every rank's step time is the same (the
slow rank's peers wait for it in the collectives), so only how a rank spends its step can name it."""

from __future__ import annotations

import itertools
import math
import statistics

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

    def fake_submit_array(runs, recipe, exclude=None, parallelism=None):
        submitted.append(("array", exclude))
        return [Job() for _ in runs]

    monkeypatch.setattr(slurm, "submit_run", fake_submit_run)
    monkeypatch.setattr(slurm, "submit_array", fake_submit_array)
    from hpc_tools.sweep import submit
    from hpc_tools.sweep.limits import SlurmLimits

    monkeypatch.setattr(submit, "read_limits", lambda: SlurmLimits(1001, None, 10000, None, "not enforced", user="u"))
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


# --- property tests: the vectorised verdict against a step-by-step reference ------------------------------------------

def _reference(per_rank: dict[int, tuple[int, dict[int, tuple[float, float, float]]]], step_median_s: float):
    """The module docstring's rule, computed step by step and rank by rank: per_rank = {rank: (pp_rank, {step:
    (busy, data, comm)})}; returns {rank: dict of the verdict's figures}."""
    out = {}
    stages: dict[int, list[int]] = {}
    for rank, (pp, _) in sorted(per_rank.items()):
        stages.setdefault(pp, []).append(rank)
    for ranks in stages.values():
        if len(ranks) < 2:
            out.update({r: {"steps_compared": 0, "straggler": False} for r in ranks})
            continue
        steps = sorted(set.intersection(*(set(per_rank[r][1]) for r in ranks)))
        n = len(steps)
        if n == 0:
            out.update({r: {"steps_compared": 0, "straggler": False} for r in ranks})
            continue

        def value(r, s, what):
            busy, data, comm = per_rank[r][1][s]
            return {"busy": busy, "data": data, "comm": comm, "compute": busy - data}[what]

        def excesses(r, what):
            return [value(r, s, what) - statistics.median(value(o, s, what) for o in ranks if o != r) for s in steps]

        def tail(k):
            return 1.0 if k <= 0 else sum(math.comb(n, j) for j in range(k, n + 1)) / 2 ** n

        got = {}
        for r in ranks:
            e = {w: excesses(r, w) for w in ("busy", "data", "compute", "comm")}
            v = {"steps_compared": n, "busy_median_s": statistics.median(value(r, s, "busy") for s in steps),
                 "compute_median_s": statistics.median(value(r, s, "compute") for s in steps),
                 "excess_s": statistics.median(e["busy"]), "compute_excess_s": statistics.median(e["compute"]),
                 "data_excess_s": statistics.median(e["data"]), "comm_excess_s": statistics.median(e["comm"]),
                 "steps_slower": sum(x > 0 for x in e["busy"])}
            v["p_value"], v["waits_more"] = tail(v["steps_slower"]), sum(x > 0 for x in e["comm"])
            v["straggler"] = (n >= stragglers.MIN_STEPS and v["excess_s"] / step_median_s > stragglers.THRESHOLD
                              and v["p_value"] <= stragglers.P_MAX)
            v["cause"] = ("data" if v["data_excess_s"] > v["compute_excess_s"] else "compute") if v["straggler"] \
                else None
            got[r] = v
        if len(ranks) >= 3:
            meds = [got[r]["busy_median_s"] for r in ranks]
            centre = statistics.median(meds)
            spread = max(1.4826 * statistics.median(abs(m - centre) for m in meds), 0.01 * step_median_s)
            for r in ranks:
                got[r]["z"] = (got[r]["busy_median_s"] - centre) / spread
        if not any(v["straggler"] for v in got.values()):
            for v in got.values():
                p = tail(v["waits_more"])
                if (n >= stragglers.MIN_STEPS and v["comm_excess_s"] / step_median_s > stragglers.THRESHOLD
                        and p <= stragglers.P_MAX and v["excess_s"] > -0.5 * v["comm_excess_s"]):
                    v.update(straggler=True, cause="communication", steps_slower=v["waits_more"], p_value=p)
        out.update(got)
    return out


def _random_job(rng, ranks: int, steps: int, stages: int):
    """Random synchronous-ish records: several pipeline stages, slow ranks of every cause, missing comm samples,
    NaN data times, ties; returns the sample and the reference's input."""
    pp = rng.integers(0, stages, ranks)
    sample, per_rank = stragglers.StragglerSample(), {}
    slow = {int(r): (str(rng.choice(["compute", "data", "comm"])), float(rng.choice([0.01, 0.05, 0.3])))
            for r in rng.choice(ranks, size=min(ranks, int(rng.integers(0, 3))), replace=False)}
    ties = rng.random() < 0.3
    step_no = np.arange(1.0, steps + 1)
    every = int(rng.choice([1, 2, 3]))
    warm = int(rng.integers(0, 3))
    for r in range(ranks):
        compute = 0.1 + 0.04 * pp[r] + 0.01 * rng.random(steps)
        data = 0.01 + 0.002 * rng.random(steps)
        comm = 0.03 + 0.01 * rng.random(steps)
        kind, seconds = slow.get(r, ("compute", 0.0))
        {"compute": compute, "data": data, "comm": comm}[kind][:] += seconds
        if ties:
            compute, data, comm = np.round(compute, 2), np.round(data, 3), np.round(comm, 2)
        timed = (np.arange(steps) % every == 0) & (rng.random(steps) > (0.1 if rng.random() < 0.3 else 0.0))
        data_col = np.where(rng.random(steps) < 0.05, np.nan, data)
        st = compute + np.nan_to_num(data_col) + comm
        cols = {"step": step_no, "step_time_s": st, "data_time_s": data_col,
                "comm_time_s": np.where(timed, comm, np.nan)}
        measured = slice(warm, steps) if rng.random() < 0.5 else np.arange(steps) >= warm
        sample.add_rank(r, int(pp[r]), cols, measured)
        keep = np.flatnonzero(timed & (np.arange(steps) >= warm))
        if keep.size > stragglers.MAX_STEPS:
            keep = keep[:: math.ceil(keep.size / stragglers.MAX_STEPS)]
        per_rank[r] = (int(pp[r]), {int(step_no[i]): (float(st[i] - comm[i]), float(np.nan_to_num(data_col[i])),
                                                      float(comm[i])) for i in keep})
    return sample, per_rank


@pytest.mark.parametrize("seed", range(12))
def test_verdict_equals_a_step_by_step_reference(seed):
    rng = np.random.default_rng(100 + seed)
    for ranks, steps, stages in [(2, 12, 1), (3, 20, 1), (4, 30, 2), (int(rng.integers(5, 12)), 40, 3),
                                 (6, 1200, 2)]:
        sample, per_rank = _random_job(rng, ranks, steps, stages)
        verdicts, line = stragglers.judge(sample, 0.2, lambda r: f"n{r}")
        want = _reference(per_rank, 0.2)
        assert sorted(v.rank for v in verdicts) == sorted(want)
        for v in verdicts:
            w = want[v.rank]
            assert (v.steps_compared, v.straggler) == (w["steps_compared"], w["straggler"]), (v, w)
            if not w["steps_compared"]:
                continue
            assert (v.steps_slower, v.cause) == (w["steps_slower"], w["cause"]), (v, w)
            for k in ("busy_median_s", "compute_median_s", "excess_s", "compute_excess_s", "data_excess_s",
                      "comm_excess_s"):
                assert getattr(v, k) == pytest.approx(w[k], abs=1e-9), k
            assert v.p_value == pytest.approx(w["p_value"], rel=1e-9, abs=1e-300)
            assert v.z == (pytest.approx(w["z"], abs=1e-9) if "z" in w else None)
            assert v.node == (f"n{v.rank}" if v.straggler else None)
        named = [v for v in verdicts if v.straggler]
        assert line.startswith("rank ") == bool(named), line


def test_injected_slow_ranks_are_named_with_their_cause():
    rng = np.random.default_rng(1)
    steps, ranks = 40, 16
    for kind, cause in [("compute", "compute"), ("data", "data")]:
        busy = 0.1 + 0.002 * rng.random((ranks, steps))
        data = 0.01 + 0.001 * rng.random((ranks, steps))
        (busy if kind == "compute" else data)[5] += 0.05
        st = busy + (data if kind == "data" else 0.0) + 0.02
        sample = stragglers.StragglerSample()
        for r in range(ranks):
            sample.add_rank(r, r % 2, {"step": np.arange(1.0, steps + 1), "step_time_s": st[r], "data_time_s": data[r],
                                       "comm_time_s": np.full(steps, 0.02)}, slice(0, steps))
        verdicts, line = stragglers.judge(sample, 0.15)
        assert [(v.rank, v.cause) for v in verdicts if v.straggler] == [(5, cause)], line


def test_sign_test_tail_equals_sign_test_p():
    for n in list(range(0, 40)) + [511, 512]:
        tail = stragglers.sign_test_tail(n)
        assert len(tail) == n + 1
        assert all(tail[k] == stragglers.sign_test_p(k, n) for k in range(n + 1)), n
    assert stragglers.sign_test_tail(20)[15] == pytest.approx(sum(math.comb(20, j) for j in range(15, 21)) / 2**20)


def test_others_median_with_ties_and_many_ranks_equals_brute_force():
    rng = np.random.default_rng(5)
    for n in (2, 3, 6, 7, 16, 17):
        x = np.round(rng.random((n, 25)), 1)  # many ties
        got = stragglers.others_median(x)
        want = np.array([[np.median(np.delete(x[:, s], i)) for s in range(25)] for i in range(n)])
        np.testing.assert_array_equal(got, want)
