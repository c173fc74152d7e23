"""Stragglers and goodput on real local runs (the trainers or the whole rank program, gloo collectives, the real
collector and loop).

- comm_check on 3 ranks with one rank slowed by a test-only injected sleep (``HPC_TOOLS_TEST_SLOW_RANK``) before
  its step's work, or inside its data loading: every rank's step time comes out equal (its peers wait for it in the
  all-reduce), and that rank, and only it, is named with the cause "compute" or "data". Both cases share ONE launch
  of 3 ranks (``hpc_tools.testing.matrix``: comm_check's real ``run(ctx)``, collector included, in its own run folder
  per case, one after the other in the same processes, each with its own injected delay), not two.
- A DP-only Megatron run killed after a step past its last checkpoint and launched again: the steps it recomputes are
  lost work, the checkpoint saves and the load are measured by the loop, and the pause between the two lives is
  requeue wait.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from hpc_tools.analysis.analyze import analyse
from hpc_tools.executors.local import run_local
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from hpc_tools.submission import new_run
from hpc_tools.testing import matrix
from profiling.collector import SLOW_RANK_ENV
from tests.helpers import REPO, local_rank_pids, wait_for

COMM_CHECK = REPO / "recipes" / "comm_check.yaml"
GPT = REPO / "recipes" / "gpt_3d.yaml"
STEPS = 16
DELAY_S = 0.3


INJECTED = [(2, "compute"), (1, "data")]


@pytest.fixture(scope="module")
def comm_check_runs(tmp_path_factory) -> dict[tuple[int, str], str]:
    """(slow rank, cause) -> its comm_check run folder, both from one launch of 3 ranks."""
    recipe = load_recipe(COMM_CHECK, [f"training.train_iters={STEPS}", "cluster.gpus_per_node=3",
                                      "profiling.communication_sample_interval=1", "profiling.warmup_steps=2"],
                         profile="local").model_dump(mode="json", exclude={"local", "sweep"})
    variants = [{"name": f"rank{rank}-{cause}", "recipe": recipe, "env": {SLOW_RANK_ENV: f"{rank}:{cause}:{DELAY_S}"}}
                for rank, cause in INJECTED]
    results = matrix.launch(variants, 3, tmp_path_factory.mktemp("stragglers"))
    return {(rank, cause): results[f"rank{rank}-{cause}"]["run_dir"] for rank, cause in INJECTED}


@pytest.mark.parametrize("slow_rank,cause", INJECTED)
def test_an_injected_straggler_is_named_with_its_cause(comm_check_runs, slow_rank, cause):
    result = analyse([comm_check_runs[(slow_rank, cause)]])
    row = result.runs.iloc[0]
    ranks = result.ranks.set_index("rank")
    # The step times of the ranks are within a fraction of the delay: the old step-time rule cannot tell.
    spread = ranks["step_time_median_s"].max() - ranks["step_time_median_s"].min()
    assert spread < DELAY_S / 3, ranks["step_time_median_s"].tolist()
    assert row["stragglers"] == str(slow_rank), row["straggler_verdict"]
    assert ranks["straggler"].tolist() == [r == slow_rank for r in range(3)]
    assert ranks.loc[slow_rank, "straggler_cause"] == cause
    assert ranks.loc[slow_rank, "node"] == os.uname().nodename
    assert DELAY_S * 0.7 < ranks.loc[slow_rank, "excess_s"] < DELAY_S * 2
    assert ranks.loc[slow_rank, "straggler_p"] <= 0.01
    print(f"\ninjected {slow_rank}:{cause}:{DELAY_S}: {row['straggler_verdict']}")


@pytest.mark.megatron
@pytest.mark.slow
def test_goodput_of_a_killed_and_relaunched_run(tmp_path):
    recipe = load_recipe(GPT, ["parallel.tensor_size=1", "parallel.pipeline_size=1",
                               "parallel.sequence_parallel=false", "cluster.gpus_per_node=2",
                               "training.train_iters=9", "checkpoint.interval_iters=4"], profile="local")
    run = new_run(recipe, tmp_path, "local", source=str(GPT))
    world = ParallelLayout.from_recipe(recipe).world_size
    records0 = run.records_dir / "rank00000.jsonl"
    killed: list[int] = []

    def kill_after_step_6():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not killed:
            if records0.exists() and len(records0.read_text().splitlines()) >= 6:
                for pid in local_rank_pids(run.path):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_after_step_6, daemon=True)
    watcher.start()
    assert run_local(run, world) != 0
    watcher.join()
    assert killed
    first_life = [json.loads(line)["step"] for line in records0.read_text().splitlines()]
    time.sleep(2.0)  # the pause before the relaunch: requeue wait
    assert run_local(run, world) == 0, (run.logs_dir / "rank00000.out").read_text()[-3000:]
    steps = [json.loads(line)["step"] for line in records0.read_text().splitlines()]
    recomputed = [s for s in first_life if s > 4]  # the relaunch resumed from the checkpoint of step 4
    assert steps == first_life + list(range(5, 10))

    result = analyse([str(run.path)])
    g = result.goodput.iloc[0]
    assert g["lives"] == 2 and g["unit"] == "rank"
    assert g["recomputed_steps"] == len(recomputed) >= 2
    lost = sum(json.loads(line)["step_time_s"] for line in records0.read_text().splitlines()[:len(first_life)]
               if json.loads(line)["step"] > 4)
    assert g["lost_work_s"] == pytest.approx(lost)
    assert g["checkpoint_saves"] == 3  # steps 4 | 8 and 9
    assert g["checkpoint_save_s"] > 0 and g["checkpoint_load_s"] > 0 and g["startup_s"] > 0
    assert 1.0 <= g["requeue_wait_s"] <= 10.0
    assert 0 < g["goodput"] < 1
    shares = sum(r["share"] for r in result.goodput_buckets[run.run_id] if r["share"] is not None)
    assert shares == pytest.approx(1.0)
    print("\ngoodput table (seconds, rank-hours, share):")
    for r in result.goodput_buckets[run.run_id]:
        share = "" if r["share"] is None else f"{100 * r['share']:.1f} %"
        print(f"  {r['bucket']:<16} {r['seconds']:8.2f} s {r['hours']:.6f} h {share}")


@pytest.mark.slurm
@pytest.mark.multinode
def test_an_injected_straggler_on_two_slurm_nodes_is_named_with_its_node(slurm_multinode, tmp_path):
    """comm_check on 2 nodes x 2 ranks through Slurm: rank 3 (the second node's second rank) slowed in compute."""
    import subprocess

    from hpc_tools.registry import RunFolder
    from hpc_tools.runstate import TERMINAL_STATES
    from tests.helpers import run_cli, wait_for

    out = run_cli("submit", str(COMM_CHECK), "--profile", "local", "--executor", "slurm", "--json",
                  "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=2",
                  "--set", f"training.train_iters={STEPS}", "--set", "profiling.communication_sample_interval=1",
                  "--runs-dir", str(tmp_path / "runs"), env={**os.environ, SLOW_RANK_ENV: f"3:compute:{DELAY_S}"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    try:
        run = RunFolder(data["run_dir"])

        def ended() -> bool:
            state = json.loads(run_cli("status", str(run.path), "--json").stdout).get("state")
            return state in TERMINAL_STATES

        wait_for(ended, timeout_s=300, what=f"Slurm job {data['job_id']} to end", poll_s=3)
        assert run.manifest()["state"] == "COMPLETED", run.manifest().get("events", [])[-3:]
        result = analyse([str(run.path)])
        row = result.runs.iloc[0]
        ranks = result.ranks.set_index("rank")
        assert row["stragglers"] == "3", row["straggler_verdict"]
        assert ranks["straggler"].tolist() == [False, False, False, True]
        assert ranks.loc[3, "straggler_cause"] == "compute"
        # Block distribution puts ranks 2 and 3 on the second node; the test cluster's nodes have their own hostnames
        # (or, in its fallback mode, the host's).
        assert ranks.loc[3, "node"] in ("n2", os.uname().nodename) and row["straggler_nodes"] == ranks.loc[3, "node"]
        print(f"\nSlurm 2 nodes, injected 3:compute:{DELAY_S}: {row['straggler_verdict']}")
    finally:
        subprocess.run(["scancel", str(data["job_id"])], capture_output=True, timeout=30)


@pytest.mark.megatron
@pytest.mark.slow
def test_a_rank_stopped_half_of_the_time_is_the_one_straggler_host_stalled(tmp_path):
    """A DP-only Megatron run on 2 ranks, rank 1 stopped for 0.15 s of every 0.3 s (SIGSTOP/SIGCONT from a thread here)
    from its first steps on: its peer waits for it in the collectives, the stall lands inside them as often as not, and
    its busy time alone cannot tell, nor, on a busy machine (its peer descheduled outside the collectives), its
    lateness. ``analyze --json`` names it, and only it, with the cause "host stalled", from the time the host kept it
    from running (``host_stall_s``); so does ``status`` while the job runs."""
    from hpc_tools.analysis.live import stragglers_and_goodput
    from tests.helpers import in_process

    steps, victim = 36, 1
    recipe = load_recipe(GPT, ["parallel.tensor_size=1", "parallel.pipeline_size=1",
                               "parallel.sequence_parallel=false", "cluster.gpus_per_node=2",
                               f"training.train_iters={steps}", "training.eval_interval=null",
                               f"checkpoint.interval_iters={steps}"], profile="local")
    run = new_run(recipe, tmp_path, "local", source=str(GPT))
    records = run.records_dir / f"rank{victim:05d}.jsonl"
    opened = run.records_dir / f"events_rank{victim:05d}.jsonl"  # its collector's start: the steps follow
    done, stops, live = threading.Event(), [], {}

    def stop_half_of_the_time():
        while not done.is_set() and not opened.exists():
            time.sleep(0.02)
        pid = wait_for(lambda: (local_rank_pids(run.path) or [None] * (victim + 1))[victim], timeout_s=60,
                       what="the ranks' pids in the manifest")
        while pid and not done.is_set():
            try:
                os.kill(pid, signal.SIGSTOP)
                stops.append(pid)
                time.sleep(0.15)
                os.kill(pid, signal.SIGCONT)
                if not live and records.exists() and len(records.read_text().splitlines()) >= steps - 8:
                    live.update(stragglers_and_goodput(run))  # what `status` shows while the job runs
                else:
                    time.sleep(0.15)
            except (ProcessLookupError, FileNotFoundError):  # the rank ended (its records compacted)
                break

    stopper = threading.Thread(target=stop_half_of_the_time, daemon=True)
    stopper.start()
    try:
        assert run_local(run, 2) == 0, (run.logs_dir / "rank00000.out").read_text()[-3000:]
    finally:
        done.set()
        stopper.join()
    assert len(stops) >= 10
    result = json.loads(in_process("analyze", str(run.path), "--json"))  # reads the folder: no process start
    verdict = result["runs"][0]["straggler_verdict"]
    assert [(s["rank"], s["straggler_cause"]) for s in result["stragglers"]] == [(victim, "host stalled")], verdict
    assert [r["rank"] for r in result["ranks"] if r["straggler"]] == [victim]
    stalled = next(r for r in result["ranks"] if r["rank"] == victim)
    assert stalled["steps_compared"] >= steps - 4  # every measured step, not the sampled ones
    # Its own evidence (host_stall_s): kept from running about half of the time, which its lateness at the
    # collectives shows only where a stall landed outside them; and no busier on its CPU than its peer.
    assert stalled["stall_excess_s"] > 0.03, stalled
    assert abs(stalled["cpu_excess_s"]) < 0.5 * stalled["stall_excess_s"], stalled
    assert verdict.startswith(f"rank {victim} (node {os.uname().nodename}): host stalled"), verdict
    assert live.get("straggler_causes") == {str(victim): "host stalled"}, live.get("straggler_verdict")
    print(f"\nstopped half of the time: {verdict}\nlive (status): {live['straggler_verdict']}")
