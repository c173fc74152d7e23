"""The "host stalled" verdict (profiling.stragglers) on synthetic per-rank records with the host figures of every step
(cpu_time_s, involuntary_switches, collective_wait_s): a rank stopped from outside half of the time is named, and only
it; a rank slow in its own compute keeps its busy-time verdict; a clean run names nobody; a stall that travels down
the pipeline names the stalled rank, not its neighbour in the next stage."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.testing.synthetic import synthetic_run
from profiling import stragglers

STEPS = 200
WARMUP = 2
SAMPLE_EVERY = 20  # collectives timed on 10 steps: the busy-time rule alone would compare 9 of them


def job(ranks: int, rng, *, stalled: int | None = None, slow_compute: int | None = None, pp_rank=None,
        outside_share: float = 0.5, descheduled: float = 0.0, host_stall: bool = False):
    """ranks x steps records of a synchronous job whose step is compute, then one collective of the stage's ranks.

    ``stalled``: that rank is stopped (SIGSTOP) for 0.15 s on half of the steps, half of the time before it reaches
    the collective (it arrives late, off its CPU) and half of the time inside it (every rank is held alike).
    ``slow_compute``: that rank computes 0.05 s more per step (on its CPU). ``pp_rank``: two stages, stage 1's rank
    i receives its input from stage 0's rank i (a pipeline recv before its compute). ``outside_share``: the share of
    the stalls that land before the collective. ``descheduled``: every rank is descheduled outside the collective on
    half of the steps, for up to that long (a busy machine). ``host_stall``: the records have ``host_stall_s`` (how
    long the host kept each rank from running: its stops and its descheduling)."""
    compute = 0.10 + 0.005 * rng.random((ranks, STEPS))
    data = 0.001 + 0.0005 * rng.random((ranks, STEPS))
    outside = np.zeros((ranks, STEPS))
    inside = np.zeros(STEPS)
    kept = np.zeros((ranks, STEPS))
    if descheduled:
        outside += descheduled * rng.random((ranks, STEPS)) * (rng.random((ranks, STEPS)) < 0.5)
        kept += outside
    if stalled is not None:
        hit = rng.random(STEPS) < 0.5
        where = rng.random(STEPS) < outside_share
        outside[stalled, hit & where] += 0.15
        inside[hit & ~where] = 0.15
        kept[stalled, hit] += 0.15
    if slow_compute is not None:
        compute[slow_compute] += 0.05
    cpu = compute + 0.002 * rng.random((ranks, STEPS))  # what its own code used; a stop uses none
    p2p = np.zeros((ranks, STEPS))
    stage = np.zeros(ranks, int) if pp_rank is None else np.asarray(pp_rank)
    arrive = np.zeros((ranks, STEPS))
    for s in sorted(set(stage.tolist())):
        rows = np.flatnonzero(stage == s)
        if s > 0:  # waits in its pipeline recv for its neighbour of the previous stage to arrive
            prev = np.flatnonzero(stage == s - 1)
            p2p[rows] = 0.01 + outside[prev] + 0.001 * rng.random((rows.size, STEPS))
        arrive[rows] = data[rows] + compute[rows] + outside[rows] + p2p[rows]
    end = arrive.max(axis=0) + 0.02 + inside
    wait = end[None, :] - arrive
    step = np.repeat(end[None, :], ranks, axis=0)
    comm = wait + p2p
    sampled = np.zeros(STEPS, bool)
    sampled[SAMPLE_EVERY - 1::SAMPLE_EVERY] = True
    comm[:, ~sampled] = np.nan
    columns = {"data_time_s": data, "cpu_time_s": cpu, "collective_wait_s": wait, "comm_time_s": comm,
               "involuntary_switches": rng.integers(0, 5, (ranks, STEPS))}
    if host_stall:
        columns["host_stall_s"] = kept
    if pp_rank is not None:
        columns["pp_rank"] = np.repeat(stage[:, None], STEPS, axis=1)
        columns["pp_wait_s"] = p2p
    return step, columns


def analysed(tmp_path, ranks: int, seed: int = 5, **kw):
    step, columns = job(ranks, np.random.default_rng(seed), **kw)
    folder = synthetic_run(tmp_path, [f"cluster.gpus_per_node={ranks}", f"training.global_batch_size={ranks}"],
                           step, **columns)
    return analyse([str(folder.path)], warmup=WARMUP)


@pytest.mark.parametrize("ranks,rank", [(4, 1), (2, 0), (8, 6)])
def test_a_rank_stopped_half_of_the_time_is_the_one_straggler_and_host_stalled(tmp_path, ranks, rank):
    result = analysed(tmp_path, ranks, stalled=rank)
    row = result.runs.iloc[0]
    flags = result.ranks.set_index("rank")
    # Its busy time on the sampled steps says nothing either way (the stall lands inside the collective as often).
    assert row["stragglers"] == str(rank), row["straggler_verdict"]
    assert flags["straggler"].tolist() == [r == rank for r in range(ranks)]
    assert flags.loc[rank, "straggler_cause"] == "host stalled"
    assert row["straggler_verdict"].startswith(f"rank {rank} (node node000): host stalled, late at collectives +0.0")
    # Compared over every measured step, not the sampled ones: a quarter of them carried a 0.15 s stall outside.
    assert flags.loc[rank, "steps_compared"] == STEPS - WARMUP
    assert flags.loc[rank, "late_s"] == pytest.approx(0.15 / 4, rel=0.35)
    assert abs(flags.loc[rank, "cpu_excess_s"]) < 0.005
    assert flags.loc[rank, "straggler_p"] <= 1e-6
    js = result.to_json()
    assert [s["straggler_cause"] for s in js["stragglers"]] == ["host stalled"]


def test_a_rank_slow_in_its_own_compute_keeps_the_compute_verdict(tmp_path):
    step, columns = job(4, np.random.default_rng(2), slow_compute=2)
    columns["comm_time_s"] = columns["collective_wait_s"]  # collectives timed on every step
    folder = synthetic_run(tmp_path, ["cluster.gpus_per_node=4", "training.global_batch_size=4"], step, **columns)
    result = analyse([str(folder.path)], warmup=WARMUP)
    row = result.runs.iloc[0]
    flags = result.ranks.set_index("rank")
    assert row["stragglers"] == "2", row["straggler_verdict"]
    assert flags.loc[2, "straggler_cause"] == "compute"
    assert flags.loc[2, "late_s"] == pytest.approx(0.05, abs=0.01)  # late, and its extra CPU time says why
    assert flags.loc[2, "cpu_excess_s"] == pytest.approx(0.05, abs=0.01)
    assert row["straggler_verdict"].startswith("rank 2 (node node000): compute, busy +0.0")


def test_a_clean_run_names_nobody_over_every_step(tmp_path):
    result = analysed(tmp_path, 4)
    row = result.runs.iloc[0]
    assert row["stragglers"] == "", row["straggler_verdict"]
    assert not result.ranks["straggler"].any()
    assert row["straggler_verdict"].startswith(
        f"none: no rank is slower than its peers or late at their collectives (over {STEPS - WARMUP} steps")


def test_a_stall_down_the_pipeline_names_the_stalled_rank_not_its_neighbour(tmp_path):
    # Rank 1 (stage 0) stalls; rank 3 (stage 1) waits for its activations and arrives late at stage 1's collective.
    result = analysed(tmp_path, 4, stalled=1, pp_rank=[0, 0, 1, 1])
    row = result.runs.iloc[0]
    flags = result.ranks.set_index("rank")
    assert row["stragglers"] == "1", row["straggler_verdict"]
    assert flags.loc[3, "late_s"] > 0.02 and not flags.loc[3, "straggler"]


def test_a_rank_stopped_inside_the_collectives_on_a_busy_machine_is_named_by_its_own_stall_time(tmp_path):
    """Its stalls land inside the collectives (its peer waits there as long as it is stopped) and the machine
    deschedules both ranks outside them: lateness cannot tell (the failure of a loaded machine), host_stall_s can."""
    kw = {"outside_share": 0.1, "descheduled": 0.1}
    late_only = analysed(tmp_path / "a", 2, stalled=1, **kw)
    assert late_only.runs.iloc[0]["stragglers"] == "", late_only.runs.iloc[0]["straggler_verdict"]
    result = analysed(tmp_path / "b", 2, stalled=1, host_stall=True, **kw)
    row = result.runs.iloc[0]
    flags = result.ranks.set_index("rank")
    assert row["stragglers"] == "1" and flags.loc[1, "straggler_cause"] == "host stalled", row["straggler_verdict"]
    assert flags.loc[1, "stall_excess_s"] == pytest.approx(0.15 / 2, rel=0.3)
    assert flags.loc[1, "late_share"] < stragglers.THRESHOLD  # lateness alone was below the threshold
    assert row["straggler_verdict"].startswith("rank 1 (node node000): host stalled, kept from running +0.0")
    assert flags.loc[1, "straggler_p"] <= 1e-6


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_busy_machine_that_deschedules_every_rank_alike_names_nobody(tmp_path, seed):
    result = analysed(tmp_path, 4, seed=seed, descheduled=0.1, host_stall=True)
    row = result.runs.iloc[0]
    assert row["stragglers"] == "", row["straggler_verdict"]
    assert result.ranks["stall_excess_s"].abs().max() < 0.02


def test_mean_above_zero_p():
    assert stragglers.mean_above_zero_p(np.array([0.1] * 10)) == 0.0
    assert stragglers.mean_above_zero_p(np.array([-1.0, 1.0] * 10)) == pytest.approx(0.5)
    spike = np.zeros(40)
    spike[7] = 10.0  # one long pause is not a pattern
    assert stragglers.mean_above_zero_p(spike) > 0.1
    assert stragglers.mean_above_zero_p(np.array([0.2, 0.0] * 20) - 0.01) < 1e-4
