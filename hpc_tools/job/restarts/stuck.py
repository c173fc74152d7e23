"""The stuck-step watcher beside each rank step (``watch``): a step that outlives a failed rank (a lost node's tasks
never report their end) is cancelled, so that srun returns and the restart goes on."""

from __future__ import annotations

import time
from pathlib import Path

from hpc_tools import slurm_client
from hpc_tools.job.restarts.action import say
from hpc_tools.job.restarts.facts import STUCK_STEP_ENV, STUCK_STEP_S, seconds_from
from hpc_tools.runtime import heartbeat
from hpc_tools.runtime.distenv import restart_count


def rank_steps(job_id: str) -> list[str]:
    """The job's running rank steps (``JOB.N``; not its batch or extern step)."""
    return [s for s in slurm_client.job_steps(job_id) if s.split(".")[-1].isdigit()]


def _cancel_step(step: str) -> None:
    """Cancel one step from the job's own batch host; a step Slurm no longer knows is nothing to cancel."""
    slurm_client.call(["scancel", step], 30, job_side=True)


def watch(run_dir: Path, env: dict[str, str], grace_s: float | None = None, poll_s: float = 1.0,
          cancel=None) -> str | None:
    """Beside a rank step (the batch shell starts it in the background and stops it when srun returns): when a rank
    of this start has exited with an error and the step is still running ``grace_s`` later (default
    ``HPC_TOOLS_STUCK_STEP_S`` from ``env``, else ``STUCK_STEP_S``), cancel the step.

    After a node crash srun waits for the lost node's tasks to report their end, which never comes (measured on the
    test cluster: still waiting minutes after the node's slurmd was back); cancelling the step makes srun give up
    within seconds, and the restart goes on. Returns the line it printed, or None when it had nothing to do."""
    job_id = env.get("SLURM_JOB_ID")
    start = restart_count(env)
    grace_s = seconds_from(env, STUCK_STEP_ENV, STUCK_STEP_S) if grace_s is None else grace_s
    failed_at = None
    while job_id:
        beats = heartbeat.read_all(run_dir, start)
        failed = sorted(r for r, b in beats.items() if b.exit and b.exit.get("code"))
        if failed and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at >= grace_s:
            steps = rank_steps(job_id)
            for step in steps:
                (cancel or _cancel_step)(step)
            if steps:
                line = (f"the rank step did not end {grace_s:.0f} s after rank {failed[0]} failed (a lost node's "
                        f"tasks never report their end): step {', '.join(steps)} cancelled")
                say(line)
                return line
            return None
        time.sleep(poll_s)
    return None
