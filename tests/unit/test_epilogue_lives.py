"""A requeued run's latest life decides what ``status`` says: the batch script's epilogue (``job.epilogue``)
replaces an earlier life's culprit and error with this life's outcome (none, when it completed) and keeps each
life's outcome in the manifest's ``lives``, which ``status`` shows as the earlier starts. The manifests are written
the way the job's own writers write them (open_run's ``batch started``, rank 0's ``started``/``failed``/``completed``,
the watchdog's ``hang``), in the order a requeue after a node failure produces."""

from __future__ import annotations

import time

from hpc_tools.cli import main
from hpc_tools.job.epilogue import TaskFailure, record_end
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import HANG_EXIT_CODE, classify
from hpc_tools.runtime import heartbeat
from hpc_tools.runtime.heartbeat import Beat

LOST = "RuntimeError: Connection closed by peer"


def make_run(tmp_path) -> RunFolder:
    return RunFolder.create(tmp_path, "r", "x: 1\n", "", {"executor": "sbatch", "state": "STARTING",
                                                          "world_size": 4, "restart_count": 0})


def start_life(run: RunFolder, n: int) -> None:
    """What ``job.open_run`` and rank 0 (``runtime.rank``) record when life ``n`` begins."""
    run.update(event="batch started", state="STARTING", restart_count=n)
    run.update(event="started", state="RUNNING", restart_count=n, reason=None, failed_ranks=None, failed_nodes=None)


def lose_n2(run: RunFolder) -> None:
    """Life 0: n2 fails at step 45; rank 0 (on n1) records gloo's words, the heartbeats say who was where."""
    for rank in range(4):
        heartbeat.write(run.path, Beat(rank=rank, node="n1" if rank < 2 else "n2", pid=100 + rank, step=45))
    run.update(event="failed", state="FAILED", error=LOST)


def status_text(run: RunFolder, capsys) -> str:
    capsys.readouterr()
    assert main(["status", str(run.path)]) == 0
    return capsys.readouterr().out


def test_a_requeued_life_that_completes_clears_the_first_lives_error(tmp_path, capsys):
    run = make_run(tmp_path)
    start_life(run, 0)
    lose_n2(run)
    first = record_end(run, 1, failures=[TaskFailure(ranks=[], node="n2", text="node failure", node_failure=True)],
                       restart=0)
    assert first["reason"] == "ranks 2,3 on n2 were lost with their node (srun: node failure)", first["reason"]
    assert classify(run).reason.startswith("ranks 2,3 on n2 were lost")
    start_life(run, 1)  # Slurm requeued the job; the error rank 0 recorded in life 0 is still at the top
    text = status_text(run, capsys)  # while it runs: life 0's error is life 0's, not this life's
    assert f"earlier  start 0 ended FAILED: {first['reason']}; {LOST}" in text and "error    " not in text, text
    assert text.count(LOST) == 1, text
    run.update(event="completed", state="COMPLETED")
    done = record_end(run, 0, restart=1)
    assert done["state"] == "COMPLETED" and done["exit_code"] == 0
    assert [done.get(k) for k in ("reason", "error", "failed_ranks", "failed_nodes")] == [None] * 4, done
    verdict = classify(run)
    assert verdict.status == "completed" and verdict.reason.startswith("finished at"), verdict
    old, new = done["lives"]  # the history: life 0's cause kept, life 1's clean end
    assert (old["restart"], old["state"], old["failed_nodes"], old["error"]) == (0, "FAILED", ["n2"], LOST), old
    assert (new["restart"], new["state"], new["reason"], new["error"]) == (1, "COMPLETED", None, None), new
    text = status_text(run, capsys)
    assert "error    " not in text and "status   completed: finished at" in text, text
    assert f"earlier  start 0 ended FAILED: {first['reason']}; {LOST}" in text, text


def test_a_life_killed_with_its_batch_script_is_kept_and_a_later_failure_wins(tmp_path, capsys):
    run = make_run(tmp_path)
    start_life(run, 0)
    lose_n2(run)  # the batch host went down with the job: no epilogue for life 0
    start_life(run, 1)
    text = status_text(run, capsys)  # while life 1 runs: life 0's error, which only the manifest's top holds
    assert f"earlier  start 0 ended ?: {LOST}" in text and "error    " not in text, text
    heartbeat.write(run.path, Beat(rank=1, node="n1", pid=9, restart=1, step=60,
                                   exit={"code": 1, "error": "ValueError: bad", "time": time.time()}))
    ended = record_end(run, 1, failures=[TaskFailure(ranks=[1], node="n1", code=1)], restart=1)
    assert ended["state"] == "FAILED" and ended["error"] is None, ended  # life 0's gloo error is not life 1's
    assert ended["reason"] == "rank 1 on n1 exited with code 1 after step 60: ValueError: bad", ended["reason"]
    old, new = ended["lives"]
    assert (old["restart"], old["error"], old["reason"]) == (0, LOST, None), old
    assert (new["restart"], new["reason"], new["failed_ranks"]) == (1, ended["reason"], [1]), new
    assert classify(run).reason == ended["reason"]
    text = status_text(run, capsys)
    assert f"earlier  start 0 ended ?: {LOST}" in text and "earlier  start 1" not in text, text


def test_this_lifes_hang_verdict_stands_and_a_late_epilogue_of_an_earlier_life_changes_nothing(tmp_path):
    run = make_run(tmp_path)
    start_life(run, 0)
    start_life(run, 1)
    verdict = "rank 2 (n2) stopped responding in all_reduce (from step), last seen after step 48"
    run.update(event="hang", state="HANG", exit_code=HANG_EXIT_CODE, reason=verdict, failed_ranks=[2],
               failed_nodes=["n2"])
    late = record_end(run, 137, failures=[TaskFailure(ranks=[3], node="n2", signal=9, text="Killed")], restart=0)
    assert (late["state"], late["reason"], late["exit_code"]) == ("HANG", verdict, HANG_EXIT_CODE), late
    assert late["lives"] == [{**late["lives"][0], "restart": 0, "reason": "rank 3 on n2 was killed by signal 9 "
                              "(Killed)", "failed_ranks": [3]}], late["lives"]
    own = record_end(run, HANG_EXIT_CODE, failures=[], restart=1)
    assert (own["state"], own["reason"], own["failed_ranks"]) == ("HANG", verdict, [2]), own
    assert own["lives"][-1]["reason"] == verdict and own["lives"][-1]["state"] == "HANG"
