"""The local executor ends what its ranks leave behind (``executors.local.end_groups``): a child forked by a rank
(a checkpoint writer, a data worker) outlives a rank killed with SIGKILL, holding CPU, memory and the rank's output
pipe, unless the rank's process group is ended as Slurm ends a step's cgroup."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from hpc_tools.executors.local import end_groups


def alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def rank_with_child(exit_how: str) -> tuple[subprocess.Popen, int]:
    """A 'rank' (its own session, as the executor starts ranks) that forked a long-lived child, then ended."""
    body = {"exits": "exit 0", "killed": "kill -9 $$"}[exit_how]
    proc = subprocess.Popen(["sh", "-c", f"sleep 300 & echo $!; {body}"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    proc.wait(timeout=30)
    return proc, child


def test_a_killed_ranks_children_are_ended():
    proc, child = rank_with_child("killed")
    assert proc.returncode == -signal.SIGKILL and alive(child)  # the orphan the executor used to leave
    end_groups([proc])
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_a_rank_that_exits_leaves_nothing_running_and_a_running_rank_is_left_alone():
    done, child = rank_with_child("exits")
    running = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        end_groups([done, running])
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child)
        assert running.poll() is None  # still running: stop_ranks' job, not this one
    finally:
        running.kill()
        running.wait()
