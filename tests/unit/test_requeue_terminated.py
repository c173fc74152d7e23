"""A stop that is neither the time limit nor the user's cancel requeues the job (issue 48: a node crash with
``restarts: 0``, whose second life Slurm ended with SIGTERM while it still took the node for not responding, was left
FAILED with "not requeued"). The ranks' part (``runtime.preemption.requeue_reason``, ``RankContext.finish_preempted``)
and the batch shell's (``job.requeue``) run for real; the batch script runs against test_requeue_host.py's stand-ins
(Slurm's commands recording each call)."""

from __future__ import annotations

import signal

import pytest

from hpc_tools.job.requeue import requeue
from hpc_tools.recipe.load import resolve
from hpc_tools.runtime.preemption import REQUEUE_MARKER, TERMINATED, TIME_LIMIT, request_requeue, requeue_reason
from tests.unit import test_requeue_host
from tests.unit.test_render import small_recipe
from tests.unit.test_restarts_pyxis import calls

pyxis_host = test_requeue_host.pyxis_host  # the batch host's stand-ins (a fixture)

pytestmark = pytest.mark.slurm_client

# Rank 0 stopped by SIGTERM (what Slurm sends a step it ends): the loop's last call after the stop's checkpoint.
# FAKE_CANCEL: the user's `hpc_tools cancel` recorded its request first.
TERM_RANK = """import os, signal, sys
from types import SimpleNamespace
from hpc_tools.registry import RunFolder
from hpc_tools.runtime.context import RankContext
from hpc_tools.runtime.preemption import StopFlag
run = RunFolder(sys.argv[1])
if os.environ.get("FAKE_CANCEL"):
    run.update(event="cancel requested", cancel_requested="2026-01-01T00:00:00+00:00")
stop = StopFlag().install()
os.kill(os.getpid(), signal.SIGTERM)
assert stop.requested
ctx = SimpleNamespace(is_rank0=True, stop=stop, recipe=SimpleNamespace(cluster=SimpleNamespace(requeue=True)), run=run)
RankContext.finish_preempted(ctx, 9)
"""


def test_what_a_stop_signal_means():
    assert requeue_reason(signal.SIGUSR2, {}) == TIME_LIMIT
    assert requeue_reason(signal.SIGTERM, {}) == TERMINATED
    assert requeue_reason(None, {}) == TERMINATED  # a peer's signal, through the stop agreement
    assert requeue_reason(signal.SIGTERM, {"cancel_requested": "2026-01-01T00:00:00"}) is None
    assert requeue_reason(signal.SIGUSR2, {"cancel_requested": "2026-01-01T00:00:00"}) == TIME_LIMIT


@pytest.mark.parametrize("cancelled", [False, True])
def test_a_terminated_step_is_requeued_unless_the_user_cancelled(tmp_path, pyxis_host, monkeypatch, cancelled):
    monkeypatch.setattr(test_requeue_host, "RANK", TERM_RANK)
    env = {**pyxis_host, **({"FAKE_CANCEL": "1"} if cancelled else {})}
    out, run = test_requeue_host.batch_job(tmp_path, env, "sbatch", "pyxis", monkeypatch)
    batch_log = (tmp_path / "batch.out").read_text()
    assert out.returncode == 0, batch_log[-3000:]
    requeues = [c for c in calls(tmp_path / "calls") if c["cmd"] == "scontrol" and c["argv"][:1] == ["requeue"]]
    manifest = run.manifest()
    assert not (run.path / REQUEUE_MARKER).exists()
    if cancelled:
        assert requeues == [] and manifest["state"] == "PREEMPTED", (requeues, manifest)
        assert "not requeued (cancelled by the user)" in batch_log
        return
    assert [(c["where"], c["argv"]) for c in requeues] == [("host", ["requeue", "4242"])]
    assert manifest["state"] == "REQUEUED" and manifest["last_step"] == 9, manifest
    events = [e["event"] for e in manifest["events"]]
    assert events.index("preempted") < events.index("batch ended") < events.index("requeued"), events
    assert "hpc_tools: job 4242 requeued after its step was terminated (not by the user's cancel)" in batch_log


def test_a_marker_of_an_earlier_life_or_a_completed_run_requeues_nothing(tmp_path):
    from hpc_tools.submission import new_run

    run = new_run(resolve(small_recipe()), tmp_path / "runs", "slurm", "job.yaml")
    ran = []
    # the batch shell of life 0 was killed before its requeue step: Slurm's own requeue keeps the job id
    assert request_requeue(run.path, {"SLURM_JOB_ID": "77"}, why=TERMINATED)
    assert requeue(run.path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"},
                   run_command=lambda *a, **k: ran.append(a)) is None
    # an in-job restart finished the run after the stop
    assert request_requeue(run.path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, why=TERMINATED)
    run.update(event="completed", state="COMPLETED")
    assert requeue(run.path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"},
                   run_command=lambda *a, **k: ran.append(a)) is None
    assert ran == [] and not (run.path / REQUEUE_MARKER).exists()


def _lost_run(tmp_path, rank1_exit: dict | None):
    """A 2-rank life that ended with srun's exit code 1: rank 0 (n1) raised when its peer's connection closed; rank 1
    (n2) left ``rank1_exit`` (None: no exit record, its node crashed)."""
    import subprocess

    from hpc_tools.runtime import heartbeat
    from hpc_tools.runtime.heartbeat import Beat
    from hpc_tools.submission import new_run

    run = new_run(resolve(small_recipe()), tmp_path / "runs", "slurm", "job.yaml")
    run.update(event="batch ended", state="FAILED", exit_code=1, restart_count=0, world_size=2)
    heartbeat.write(run.path, Beat(rank=0, node="n1", pid=100, step=20, exit={"code": 1, "time": 2.0,
                                   "error": "RuntimeError: Connection closed by peer"}))
    heartbeat.write(run.path, Beat(rank=1, node="n2", pid=101, step=20, exit=rank1_exit))
    calls_made: list = []

    def scontrol(argv, **kw):
        calls_made.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    return run, calls_made, scontrol


def test_a_step_that_lost_a_node_is_requeued(tmp_path):
    run, made, scontrol = _lost_run(tmp_path, None)
    line = requeue(run.path, {"SLURM_JOB_ID": "55"}, run_command=scontrol)
    assert line == "job 55 requeued after its step lost node n2; it resumes from its checkpoint", line
    assert made == [["scontrol", "requeue", "55"]]
    m = run.manifest()
    assert m["state"] == "REQUEUED" and m["requeue_reason"].startswith("its step lost node n2"), m


def test_an_error_of_the_ranks_themselves_is_not_requeued(tmp_path):
    run, made, scontrol = _lost_run(tmp_path, {"code": 1, "time": 1.0, "error": "ValueError: bad batch"})
    assert requeue(run.path, {"SLURM_JOB_ID": "55"}, run_command=scontrol) is None
    assert made == [] and run.manifest()["state"] == "FAILED"
