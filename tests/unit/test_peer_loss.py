"""A surviving rank names the peer it lost (hpc_tools.runtime.peer_loss), from this start's heartbeats: the real
end-to-end case (a SIGKILLed rank of a TP2 x PP2 Megatron job) is tests/integration/test_peer_loss_runs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict

from hpc_tools.runtime import heartbeat
from hpc_tools.runtime.heartbeat import Beat
from hpc_tools.runtime.peer_loss import lost_connection, lost_peer_line

GLOO = ("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:7578: Connection reset by peer. This is typically "
        "caused by a remote worker hanging")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _beats(tmp_path, override: dict[int, dict]) -> None:
    """Heartbeats of ranks 0-3 of start 0 on this node, written now, with ``override``'s fields per rank."""
    here = heartbeat.node_name()
    for rank in range(4):
        beat = asdict(Beat(rank=rank, node=here, pid=os.getpid(), step=7, time=time.time()))
        beat.update(override.get(rank, {}))
        path = heartbeat.heartbeat_path(tmp_path, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(beat))


def test_a_dead_process_on_this_node_is_named_with_where_it_was(tmp_path):
    _beats(tmp_path, {2: {"pid": _dead_pid()}})
    try:
        raise RuntimeError(GLOO)
    except RuntimeError as exc:
        line = lost_peer_line(tmp_path, 3, 0, exc, "distributed_c10d.py:4394 in all_gather_single", 9, wait_s=0)
    assert line.startswith(f"lost rank 2 (node {heartbeat.node_name()}, pid "), line
    assert "last step 7): its process is gone; this rank's collective failed at step 10 in distributed_c10d.py" \
        in line and line.endswith("(Connection reset by peer)"), line
    assert "\n" not in line


def test_a_stopped_heartbeat_elsewhere_and_an_exited_peer_are_named(tmp_path):
    _beats(tmp_path, {1: {"node": "other-node", "pid": 1, "time": time.time() - 60},
                        2: {"exit": {"code": 1, "error": "OutOfMemoryError: CUDA out of memory"}}})
    exc = RuntimeError("wrapped")
    exc.__cause__ = ConnectionError("Connection closed by peer")
    line = lost_peer_line(tmp_path, 0, 0, exc, "comm.py:111 in wait", None, wait_s=0)
    assert line.startswith("lost ranks 1,2: rank 1 (node other-node, pid 1, last step 7) its heartbeat stopped "), line
    assert "rank 2 (" in line and "exited: OutOfMemoryError: CUDA out of memory" in line, line


def test_other_errors_and_peers_that_failed_the_same_way_get_no_blame(tmp_path):
    _beats(tmp_path, {1: {"exit": {"code": 1, "error": "RuntimeError: Connection reset by peer"}}})
    assert lost_connection(ValueError("bad shape")) is None
    assert lost_peer_line(tmp_path, 0, 0, ValueError("bad shape"), "", 3, wait_s=0) is None
    line = lost_peer_line(tmp_path, 0, 0, RuntimeError(GLOO), "x.py:1 in f", 3, wait_s=0)
    assert line.startswith("lost a peer (no heartbeat names it yet"), line  # rank 1 is a victim too, not the culprit
    # ... also once its process has exited (a fast end), and a peer that completed and exited is no culprit either
    _beats(tmp_path, {1: {"pid": _dead_pid(), "exit": {"code": 1, "error": "RuntimeError: Connection reset by peer"}},
                      3: {"pid": _dead_pid(), "exit": {"code": 0, "error": None}}})
    line = lost_peer_line(tmp_path, 0, 0, RuntimeError(GLOO), "x.py:1 in f", 3, wait_s=0)
    assert line.startswith("lost a peer (no heartbeat names it yet"), line
    _beats(tmp_path, {2: {"pid": _dead_pid(), "restart": 1}})
    assert "rank 2" not in lost_peer_line(tmp_path, 0, 0, RuntimeError(GLOO), "", 3, wait_s=0)  # another start's


def test_a_requeued_lifes_culprit_comes_from_its_own_part_of_the_batch_log(tmp_path):
    """Requeued jobs append to one batch log: the first life's out-of-memory line must not name the second's end."""
    from hpc_tools.runstate import from_logs

    log = tmp_path / "batch.log"
    log.write_text("hpc_tools: run folder /runs/x\n[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to "
                   "allocate 2.00 GiB\nsrun: error: n1: task 1: Exited with exit code 1\n"
                   "hpc_tools: run folder /runs/x\nstep 5 ...\nsrun: error: n2: task 3: Killed\n")
    assert from_logs([log]) is None  # the second life names no out-of-memory error
    log.write_text(log.read_text() + "slurmstepd: error: Detected 1 oom_kill event in StepId=1.0\n")
    assert from_logs([log]).status == "out_of_memory"  # its own evidence still counts
