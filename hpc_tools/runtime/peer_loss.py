"""When a collective fails because a peer died (SIGKILL, a lost node), the surviving rank's log should say which rank
it lost and where, in one line, not end in a transport error naming a socket (gloo: ``Connection reset by peer``,
NCCL: the communicator aborted).

The peer is found from this start's heartbeats (``runtime.heartbeat``): a rank on this node whose process is gone
without an exit record (killed), a rank whose heartbeat stopped (older than ``STOPPED_S``; the watchdog rewrites it
about once a second), or a rank that exited with an error of its own. A peer that failed on the same lost connection
and has already exited (its record says so) is a victim too, not the culprit. A failure that is not a lost
connection gets no line: its traceback says what it is.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from hpc_tools.runtime.heartbeat import Beat, node_name, ranks_text, read_all
from hpc_tools.runtime.process_end import pid_alive

# The transport errors a surviving rank sees when a peer's process or node goes away (gloo's tcp pair, NCCL's abort,
# the store's socket).
LOST_CONNECTION = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exited|"
                             r"NCCL communicator was aborted|Connection refused|Socket Timeout", re.IGNORECASE)
STOPPED_S = 3.0  # a heartbeat this old: the rank stopped (beats come about once a second)
WAIT_S = 3.0  # how long to wait for the lost rank's heartbeat to go stale (a rank on another node)


def lost_connection(exc: BaseException) -> str | None:
    """The lost-connection text of ``exc`` or of an exception it was raised from, None when there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        m = LOST_CONNECTION.search(str(exc))
        if m:
            return m.group(0)
        exc = exc.__cause__ or exc.__context__
    return None


def _gone(beat: Beat, here: str) -> bool:
    """The rank's process is known to be gone: on this node, no process with its pid."""
    return beat.node == here and beat.pid > 0 and not pid_alive(beat.pid)


def find_lost(run_dir: Path, me: int, restart: int, wait_s: float = WAIT_S) -> list[tuple[Beat, str]]:
    """(heartbeat, how it was lost) of the peers of this start that are gone; waits up to ``wait_s`` for one."""
    here = node_name()
    deadline = time.monotonic() + wait_s
    while True:
        now = time.time()
        lost = []
        for rank, beat in sorted(read_all(run_dir, restart).items()):
            if rank == me:
                continue
            if beat.exit:  # it ended through its own exit record: lost only to an error of its own
                if beat.exit.get("code") not in (0, None) and not LOST_CONNECTION.search(
                        str(beat.exit.get("error") or "")):
                    lost.append((beat, f"exited: {str(beat.exit.get('error') or '')[:120]}"))
            elif _gone(beat, here):  # gone without a record: killed
                lost.append((beat, "its process is gone"))
            elif not beat.exit and now - beat.time > STOPPED_S:
                lost.append((beat, f"its heartbeat stopped {now - beat.time:.0f} s ago"))
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.2)


def lost_peer_line(run_dir: Path, me: int, restart: int, exc: BaseException, where: str, step: int | None,
                   wait_s: float = WAIT_S) -> str | None:
    """One line for a collective that failed on a lost connection: ``lost rank 2 (node n1, pid 3375, last step 7):
    its process is gone; this rank's collective failed at step 9 in all_gather_single (Connection reset by peer)``;
    None when ``exc`` is not a lost connection."""
    text = lost_connection(exc)
    if text is None:
        return None
    lost = find_lost(Path(run_dir), me, restart, wait_s)
    at = f" at step {step + 1}" if step is not None else ""
    mine = f"this rank's collective failed{at} in {where or '?'} ({text})"
    if not lost:
        return f"lost a peer (no heartbeat names it yet: see the other ranks' logs); {mine}"
    if len(lost) == 1:
        (b, how), = lost
        return f"lost rank {b.rank} (node {b.node}, pid {b.pid}, last step {b.step}): {how}; {mine}"
    who = "; ".join(f"rank {b.rank} (node {b.node}, pid {b.pid}, last step {b.step}) {how}" for b, how in lost)
    return f"lost {ranks_text([b.rank for b, _ in lost])}: {who}; {mine}"
