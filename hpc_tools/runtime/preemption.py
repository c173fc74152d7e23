"""Preemption and time-limit handling: a signal sets a flag; the trainer finishes its step, saves, and requeues.

Slurm sends SIGUSR2 ``cluster.signal_delay_s`` before the time limit (the rendered script asks for it; submitit uses
USR2 too, and NCCL claims USR1). SIGTERM (scancel, preemption) sets the same flag.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess

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


def requeue_self() -> bool:
    """Ask Slurm to requeue this job (rank 0 only). False when not under Slurm or scontrol refused."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return False
    out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, out.stderr.strip())
        return False
    return True
