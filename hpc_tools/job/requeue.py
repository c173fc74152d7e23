"""The batch shell's last step after a stop that is not the user's: requeue the job from the batch host.

At the time-limit signal, or a termination of the step that is not the user's cancel (Slurm ending the step over a
node it takes for failed: ``hpc_tools.runtime.preemption.requeue_reason``), the ranks checkpoint and rank 0 leaves
``REQUEUE_MARKER`` (this job's id, its Slurm life, why) in the run folder (``request_requeue``); it does not run
``scontrol`` itself, since a rank in a container image (pyxis, apptainer) has no Slurm client. A cancel the user asked
for after the ranks stopped (the manifest's ``cancel_requested``) still wins: nothing is requeued.
``python -m hpc_tools.job.requeue --run-dir RUN`` runs in the batch
shell on the batch host (both launch paths; in a pyxis job the host's Python, outside the container) after the
epilogue, as the job's last command: ``scontrol requeue`` ends the batch shell (this step ignores the SIGTERM). A
requeue Slurm refuses is recorded (state PREEMPTED, the reason) and said in one line of the batch log. Standard
library and hpc_tools' job side only.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from hpc_tools import slurm_client
from hpc_tools.job.epilogue import find_own_run
from hpc_tools.runtime.preemption import REQUEUE_MARKER, TIME_LIMIT, read_marker


def requeue(run_dir: Path, env: dict[str, str], run_command=subprocess.run) -> str | None:
    """Requeue this job when its rank 0 asked for it (the marker holds this job's id and Slurm life) or when its
    step lost a node (``lost_node``); returns the line said, or None when nothing was asked. The marker is removed
    first: the next life must not requeue on a stale one."""
    run = find_own_run(run_dir, env)
    job_id = env.get("SLURM_JOB_ID")
    if run is None or not job_id:
        return None
    marker = run.path / REQUEUE_MARKER
    try:
        asked, life, why = read_marker(marker.read_text())
        marker.unlink()
    except OSError:
        asked, life, why = "", None, ""
    manifest = run.manifest()
    if manifest.get("state") == "COMPLETED":  # an in-job restart's later step finished the run after that stop
        return None
    if asked != job_id or (life is not None and life != str(env.get("SLURM_RESTART_COUNT") or 0)):
        lost = lost_node(run, manifest)  # no request of this life: a lost node is the only other reason
        if lost is None:
            return None
        why, stop = LOST_NODE, f"its step lost {lost}"
    else:
        stop = "the time-limit stop" if why == TIME_LIMIT else "its step was terminated (not by the user's cancel)"
    if manifest.get("cancel_requested"):
        return f"job {job_id} not requeued: its cancel was asked for"
    try:
        error = slurm_client.requeue(job_id, run_command)
    except (OSError, subprocess.SubprocessError) as exc:
        error = str(exc)
    if error is None:
        if why != TIME_LIMIT:  # the ranks said PREEMPTED or the epilogue FAILED / NODE_FAIL: this life goes on
            run.update(event="requeued", soft=True, state="REQUEUED", requeue_reason=f"{stop}; requeued by the "
                       "batch shell")
        return f"job {job_id} requeued after {stop}; it resumes from its checkpoint"
    reason = f"scontrol requeue {job_id} failed on the batch host: {error.splitlines()[0]}"
    run.update(event="requeue failed", soft=True, state="PREEMPTED", reason=reason)
    return reason + "; resume it with `hpc_tools resume`"


LOST_NODE = "lost-node"


def lost_node(run, manifest: dict) -> str | None:
    """"node nX" when this life's step ended because a node was lost (its ranks there left no exit record: the node
    crashed, or Slurm took it for failed), which no in-job restart recovered: with ``cluster.restarts: 0`` (or its
    budget spent) the run is requeued, as Slurm requeues a job whose node failed; None for any other end (an error
    of the ranks themselves ends the run, as it would again)."""
    from hpc_tools.job.restarts.evidence import culprit

    code = manifest.get("exit_code")
    if not code:
        return None
    found = culprit(run, int(code), int(manifest.get("restart_count") or 0))
    if found["cause"] not in ("node failure", "lost"):
        return None
    return f"node {found['node']}" if found.get("node") else "a node"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.job.requeue", description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", required=True, type=Path, help="the run folder (or an array's runs root)")
    args = parser.parse_args(argv)
    # The requeue ends the batch step (SIGTERM now, SIGKILL after KillWait): this step still says what it did.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        line = requeue(args.run_dir, dict(os.environ))
    except Exception as exc:  # the job's last step: say why, never fail the batch script for it
        line = f"requeue step failed: {type(exc).__name__}: {exc}"
    if line:
        print(f"hpc_tools: {line}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
