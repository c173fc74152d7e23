"""Every failure recorded with its rank: the batch script's epilogue (srun's reports, heartbeats, the manifest), the
hang verdict (who stopped, who waited), and manifest writes that survive a full disk and never fail a reader."""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
import time

import pytest

from hpc_tools import registry
from hpc_tools.job.epilogue import failures_from_exit_codes, record_end, srun_failures, this_life
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import HANG_EXIT_CODE, classify, note_restart
from hpc_tools.runtime import heartbeat
from hpc_tools.runtime.heartbeat import Beat, describe_frames
from hpc_tools.runtime.watchdog import hang_verdict

# srun's own words after `kill -9` of task 2 (recorded on the 2-node test cluster): the first report is the culprit,
# the later ones are the ranks that --kill-on-bad-exit stopped.
SRUN_KILL_LOG = """\
hpc_tools: run folder /runs/cc-j91
old life: srun: error: n1: task 0: Exited with exit code 1
hpc_tools: run folder /runs/cc-j91
rank 0 step 47
srun: error: n2: task 2: Killed
srun: launch/slurm: _step_signal: Terminating StepId=92.0
slurmstepd-n1: error: *** STEP 92.0 ON n1 CANCELLED AT 2026-11-23T13:59:06 ***
srun: error: n2: task 3: Exited with exit code 1
srun: error: n1: tasks 0-1: Exited with exit code 1
srun: Force Terminated StepId=92.0
"""


def make_run(tmp_path, state="RUNNING", **manifest) -> RunFolder:
    return RunFolder.create(tmp_path, "r", "x: 1\n", "", {"executor": "sbatch", "state": state, "world_size": 4,
                                                          "restart_count": 0, **manifest})


def beat(run: RunFolder, rank: int, node: str, step: int, exit: dict | None = None, **kw) -> None:
    heartbeat.write(run.path, Beat(rank=rank, node=node, pid=100 + rank, step=step, exit=exit, **kw))


def test_srun_reports_parsed_in_order_and_only_from_the_latest_life():
    failures = srun_failures(this_life(SRUN_KILL_LOG))
    assert [(f.ranks, f.node, f.signal, f.code) for f in failures] == [
        ([2], "n2", 9, None), ([3], "n2", None, 1), ([0, 1], "n1", None, 1)]
    assert srun_failures("srun: error: Node failure on n2\n")[0].node_failure


def test_killed_rank_is_named_with_node_signal_and_step(tmp_path):
    run = make_run(tmp_path)
    log = tmp_path / "batch.log"
    log.write_text(SRUN_KILL_LOG)
    run.update(batch_log=str(log))
    for rank in range(4):  # rank 2 left no exit record; the others raised after it died
        beat(run, rank, "n1" if rank < 2 else "n2", 48 if rank == 2 else 49,
             exit=None if rank == 2 else {"code": 1, "error": "RuntimeError: Connection closed by peer",
                                          "time": time.time()})
    manifest = record_end(run, 137)
    assert manifest["state"] == "FAILED" and manifest["exit_code"] == 137
    assert manifest["failed_ranks"] == [2] and manifest["failed_nodes"] == ["n2"]
    assert manifest["reason"] == "rank 2 on n2 was killed by signal 9 (Killed) after step 48"
    assert manifest["events"][-1]["event"] == "batch ended"
    verdict = classify(run)
    assert verdict.status == "failed" and verdict.reason.startswith("rank 2 on n2 was killed by signal 9")


def test_rank0s_own_failure_report_gets_the_culprit(tmp_path):
    # rank 0 saw its peer vanish and recorded FAILED with gloo's words first; the epilogue adds who it was
    run = make_run(tmp_path, state="FAILED", error="RuntimeError: Connection closed by peer")
    (tmp_path / "batch.log").write_text("srun: error: n1: task 1: Exited with exit code 1\n")
    run.update(batch_log=str(tmp_path / "batch.log"))
    beat(run, 1, "n1", 7, exit={"code": 1, "error": "ValueError: bad batch", "time": time.time()})
    manifest = record_end(run, 1)
    assert manifest["state"] == "FAILED" and manifest["failed_ranks"] == [1]
    assert manifest["reason"] == "rank 1 on n1 exited with code 1 after step 7: ValueError: bad batch"


def test_without_srun_the_heartbeats_name_the_silent_rank(tmp_path):
    run = make_run(tmp_path)
    beat(run, 0, "n1", 5, exit={"code": 1, "error": "RuntimeError: peer", "time": time.time() + 1})
    beat(run, 1, "n2", 4)  # no exit record: killed by a signal
    manifest = record_end(run, 1, failures=[])
    assert manifest["failed_ranks"] == [0]  # a Python error came first here...
    run2 = make_run(tmp_path / "b")
    beat(run2, 0, "n1", 5, exit={"code": 0, "error": None, "time": time.time()})
    beat(run2, 1, "n2", 4)
    assert record_end(run2, 1, failures=[])["failed_ranks"] == [1]  # ...and here only the silent rank is left


def test_first_terminal_state_and_the_hang_verdict_stand(tmp_path):
    run = make_run(tmp_path, state="HANG", reason="rank 2 (n2) stopped in x.py:1 in f after step 3")
    manifest = record_end(run, HANG_EXIT_CODE, failures=[])
    assert manifest["state"] == "HANG" and manifest["reason"].startswith("rank 2 (n2) stopped")
    done = make_run(tmp_path / "c")
    assert record_end(done, 0)["state"] == "COMPLETED"
    requeued = make_run(tmp_path / "d", state="REQUEUED")
    assert record_end(requeued, 0)["state"] == "REQUEUED"


def test_local_exit_codes_become_the_same_record(tmp_path):
    run = make_run(tmp_path, executor="local")
    beat(run, 3, "host", 12)
    manifest = record_end(run, 137, failures_from_exit_codes({3: -9}))
    assert manifest["reason"] == "rank 3 on host was killed by signal 9 (Killed) after step 12"
    # seen in the same poll: the rank that died of a signal, not the peer that raised because of it, comes first
    assert [f.ranks for f in failures_from_exit_codes({0: 1, 1: -9})] == [[1], [0]]


def test_requeue_after_an_unrecorded_end_is_an_event(tmp_path):
    run = make_run(tmp_path)
    run.update(event="started", restart_count=0)
    note_restart(run, 1, None)
    event = run.manifest()["events"][-1]
    assert event["event"] == "requeued" and "no record" in event["requeued_after"]
    run.update(event="started", restart_count=1)
    run.update(event="batch ended", state="NODE_FAIL", reason="node n2 failed (srun: node failure)")
    note_restart(run, 2, None)
    assert run.manifest()["events"][-1]["requeued_after"] == "NODE_FAIL: node n2 failed (srun: node failure)"
    run.update(event="started", restart_count=2)
    run.update(event="preempted", state="REQUEUED")
    note_restart(run, 3, None)  # the job requeued itself: already recorded
    assert run.manifest()["events"][-1]["event"] == "preempted"


# -- hang verdict ------------------------------------------------------------------------------------------------------
def b(rank, step, age, collective=None, frame="loop.py:10 in train", node=None) -> Beat:
    return Beat(rank=rank, node=node or f"n{rank // 2 + 1}", pid=rank, step=step, time=1000.0 - age, frame=frame,
                collective=collective)


def test_stopped_rank_is_the_culprit_and_the_others_waited():
    beats = {r: b(r, 48, 1, "all_reduce (from step)") for r in (0, 1, 3)}
    beats[2] = b(2, 48, 20, "all_reduce (from step)")
    v = hang_verdict(beats, 1000.0, 4)
    assert v.culprits == [2] and v.nodes == ["n2"] and v.waiting == [0, 1, 3]
    assert v.line == ("rank 2 (n2) stopped responding in all_reduce (from step), last seen after step 48 (no heartbeat"
                      " for 20 s); ranks 0,1,3 waited in all_reduce (from step) after step 48")


def test_busy_rank_outside_collectives_is_the_culprit():
    beats = {0: b(0, 9, 1, "barrier (from train)"), 1: b(1, 9, 1, frame="model.py:77 in forward")}
    v = hang_verdict(beats, 1000.0, 3)
    assert v.culprits == [1, 2] and v.waiting == [0]
    assert v.line.startswith("rank 1 (n1) stopped in model.py:77 in forward after step 9; rank 2 never reported")


def test_when_all_wait_the_lowest_step_is_named():
    beats = {0: b(0, 9, 1, "all_reduce (from step)"), 1: b(1, 8, 1, "broadcast (from step)")}
    assert hang_verdict(beats, 1000.0, 2).culprits == [1]


def test_frames_tell_a_collective_from_compute():
    code = compile("def all_reduce(fn):\n    return fn()\n", "/site-packages/torch/distributed/distributed_c10d.py",
                   "exec")
    scope: dict = {}
    exec(code, scope)

    def agree_stop():
        return scope["all_reduce"](sys._getframe)

    where, collective = describe_frames(agree_stop())
    assert collective == "all_reduce (from agree_stop)" and where.endswith("in all_reduce")
    assert describe_frames(sys._getframe())[1] is None


def test_heartbeat_thread_reports_the_main_threads_collective(tmp_path):
    from hpc_tools.runtime.watchdog import Watchdog

    dog = Watchdog(0, tmp_path, rank=0).start()
    try:
        # the main thread's innermost frame: while it sleeps, this test; a beat sampled while it reads the beats
        # names heartbeat.py instead (a loaded machine lands there), so wait for one that names the test
        deadline, frames = time.monotonic() + 20, []
        while time.monotonic() < deadline and not any("test_epilogue.py" in f for f in frames):
            time.sleep(0.2)
            frames.append(heartbeat.read_all(tmp_path)[0].frame or "")
        assert any("test_epilogue.py" in f for f in frames), frames[-5:]
    finally:
        dog.stop(exit_code=0)
    assert heartbeat.read_all(tmp_path)[0].exit["code"] == 0
    assert threading.main_thread().is_alive()


# -- manifest writes on a full or read-only disk -----------------------------------------------------------------------
def test_full_disk_spends_the_reserve_then_readers_stay_soft(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    assert (run.path / registry.RESERVE).stat().st_size == registry.RESERVE_BYTES
    real, calls = registry.atomic_write, []

    def full_once(path, text):
        calls.append(path)
        if len(calls) == 1 and (run.path / registry.RESERVE).exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, text)

    monkeypatch.setattr(registry, "atomic_write", full_once)
    assert run.update(event="x", state="FAILED")["state"] == "FAILED"
    assert not (run.path / registry.RESERVE).exists() and json.loads((run.path / "manifest.json").read_text())[
        "state"] == "FAILED"

    def read_only(path, text):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(registry, "atomic_write", read_only)
    with pytest.raises(OSError):
        run.update(event="y", slurm_state="FAILED")
    merged = run.update(event="y", soft=True, slurm_state="FAILED", state="COMPLETED")
    assert merged["slurm_state"] == "FAILED" and merged["state"] == "FAILED"  # merged in memory, rule kept
    assert "slurm_state" not in run.manifest()


# -- the watchdog fires before the process group's own timeout; the NCCL flight recorder lands in the run folder ----
def test_process_group_timeout_outlasts_the_watchdog():
    from types import SimpleNamespace

    from hpc_tools.runtime.context import RankContext

    def timeout(minutes):
        return RankContext.collective_timeout.fget(SimpleNamespace(recipe=SimpleNamespace(
            cluster=SimpleNamespace(hang_timeout_min=minutes))))

    assert timeout(30).total_seconds() > 30 * 60 and timeout(0.25).total_seconds() > 15
    assert timeout(0) is None  # no watchdog: torch's default


def test_flight_recorder_variables_point_into_the_run_folder(tmp_path, monkeypatch):
    from hpc_tools.runtime.rank import nccl_flight_recorder

    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                 "TORCH_FR_DUMP_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's value wins
    nccl_flight_recorder(tmp_path)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "hang" / "nccl_trace_rank_")
    assert (tmp_path / "hang").is_dir()


def test_an_array_tasks_epilogue_finds_its_run_by_job_id(tmp_path):
    from hpc_tools.job.epilogue import find_own_run

    RunFolder.create(tmp_path, "a", "x: 1\n", "", {"job_id": "123_3"})
    mine = RunFolder.create(tmp_path, "b", "x: 1\n", "", {"job_id": "123_4"})
    env = {"SLURM_JOB_ID": "130", "SLURM_ARRAY_JOB_ID": "123", "SLURM_ARRAY_TASK_ID": "4"}
    assert find_own_run(tmp_path, env).path == mine.path and find_own_run(mine.path, {}).path == mine.path
    assert find_own_run(tmp_path, {"SLURM_JOB_ID": "7"}) is None


def test_the_exit_record_is_the_heartbeats_last_word_even_with_a_beat_in_flight(tmp_path, monkeypatch):
    """The watcher thread serializes a beat, and its write lands (fsync, rename: slow on a loaded machine) after the
    main thread wrote the exit record: the file must still hold the exit record, or the restart controller reads
    "exited without a Python error" and restarts an out-of-memory error (seen on the test cluster). Here the
    watcher's write is made slow on purpose, and stop() comes while it is in flight."""
    import profiling.files as files
    from hpc_tools.runtime import watchdog as wd

    real = files.atomic_write
    in_flight = threading.Event()

    def slow_from_the_watcher(path, text):
        if threading.current_thread().name == "hpc_tools-watchdog" and not in_flight.is_set():
            in_flight.set()
            time.sleep(1.0)  # the beat is serialized (text): its rename comes after stop() below
        real(path, text)

    monkeypatch.setattr(files, "atomic_write", slow_from_the_watcher)
    monkeypatch.setattr(wd, "CHECK_S", 0.05)
    dog = wd.Watchdog(0, tmp_path, rank=2).start()
    assert in_flight.wait(30)
    dog.stop(exit_code=1, error="OutOfMemoryError: CUDA out of memory", types=["OutOfMemoryError"])
    time.sleep(1.5)  # any write still in flight has landed
    beat = heartbeat.read_all(tmp_path)[2]
    assert beat.exit and beat.exit["types"] == ["OutOfMemoryError"], beat
