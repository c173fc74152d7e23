"""Preemption and time-limit handling: a signal sets a flag; the trainer finishes its step, saves, and asks for a
requeue.

Slurm sends SIGUSR2 ``cluster.signal_delay_s`` before the time limit (the rendered script asks for it; submitit uses
USR2 too, and NCCL claims USR1). SIGTERM sets the same flag; what it means is ``requeue_reason``'s: the user's cancel
(``hpc_tools cancel`` records it in the manifest before it signals) stops the run, any other termination of the step
(Slurm ending it over a node it takes for failed, srun, a preemption that does not requeue by itself) leads to a
requeue, as the time limit does: a run is stopped only by its time limit's end or its user. A plain ``scancel`` of the
whole job ends the batch shell as well, so no requeue step runs after it.

The requeue itself is the batch shell's (``hpc_tools.job.requeue``, after the epilogue): a rank may run inside a
container image (pyxis, apptainer), which has no Slurm client, so rank 0 only leaves ``REQUEUE_MARKER`` in the run
folder.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from hpc_tools.registry import atomic_write

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopFlag:
    """Set by a stop signal; trainers read ``requested`` at step boundaries and agree on it across ranks."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signum = signum
        log.warning("received %s: will checkpoint at the end of this step and exit", signal.Signals(signum).name)


REQUEUE_MARKER = "requeue-requested"  # in the run folder: "<job id> <restart> <why>", for the batch shell's requeue
TIME_LIMIT = "time-limit"
TERMINATED = "terminated"


def requeue_reason(signum: int | None, manifest: dict) -> str | None:
    """Why a stop by ``signum`` asks for a requeue (``TIME_LIMIT``, ``TERMINATED``), or None when the user's cancel
    ends the run (the manifest's ``cancel_requested``). ``signum`` None: this rank stopped because a peer was
    signalled (the stop agreement), which is a termination too."""
    if signum == signal.SIGUSR2:
        return TIME_LIMIT
    return None if manifest.get("cancel_requested") else TERMINATED


def request_requeue(run_dir: Path, env: dict[str, str] | None = None, why: str = TIME_LIMIT) -> bool:
    """Ask the batch shell to requeue this job once the ranks have ended (rank 0 only): write ``REQUEUE_MARKER``
    with the job id, its Slurm life (``SLURM_RESTART_COUNT``: a marker a killed batch shell never read must not
    requeue a later life of the same job id) and ``why``. False when not under Slurm (nothing to requeue)."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return False
    atomic_write(Path(run_dir) / REQUEUE_MARKER, f"{job_id} {env.get('SLURM_RESTART_COUNT') or 0} {why}\n")
    return True


def read_marker(text: str) -> tuple[str, str | None, str]:
    """(job id, Slurm life, why) of a marker's text; a marker of an older release holds the job id alone (life None:
    not checked; the time limit's)."""
    parts = text.split()
    if len(parts) >= 3:
        return parts[0], parts[1], parts[2]
    return (parts[0] if parts else ""), None, TIME_LIMIT
