"""Preemption and time-limit handling: a signal sets a flag; the trainer finishes its step, saves, and asks for a
requeue.

Slurm sends SIGUSR2 ``cluster.signal_delay_s`` before the time limit (the rendered script asks for it; submitit uses
USR2 too, and NCCL claims USR1). SIGTERM (scancel, preemption) sets the same flag.

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


REQUEUE_MARKER = "requeue-requested"  # in the run folder: this job id, for the batch shell's requeue step


def request_requeue(run_dir: Path, env: dict[str, str] | None = None) -> bool:
    """Ask the batch shell to requeue this job once the ranks have ended (rank 0 only): write ``REQUEUE_MARKER``
    with the job id. False when not under Slurm (nothing to requeue)."""
    job_id = (os.environ if env is None else env).get("SLURM_JOB_ID")
    if not job_id:
        return False
    atomic_write(Path(run_dir) / REQUEUE_MARKER, job_id + "\n")
    return True
