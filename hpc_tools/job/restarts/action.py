"""What a decision does: its line in the batch log (``say``), its ``restarts`` entry and state in the manifest
(``record_restart``, ``stop``), the exports of a new step (``step_exports``), a hang verdict set aside, and the
requeue with its node exclusion (``requeue_job``, ``exclude_from_job``, with SIGTERM ignored)."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading

from hpc_tools import slurm_client
from hpc_tools.job.restarts.facts import RESTART_LINE, Policy, step_counts, step_port
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import HANG_MARKER
from hpc_tools.runtime.distenv import RESTART_BASE_ENV


def say(line: str, restart: bool = False) -> None:
    print((RESTART_LINE if restart else "hpc_tools: ") + line, file=sys.stderr, flush=True)


def exports(values: dict[str, str | int]) -> str:
    return "export " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in values.items())


def set_aside_hang(run: RunFolder, n: int) -> None:
    marker = run.path / HANG_MARKER
    if marker.is_file():
        (run.path / "hang").mkdir(exist_ok=True)
        os.replace(marker, run.path / "hang" / f"HANG-restart{n - 1}.txt")


def stop(run: RunFolder, manifest: dict, entry: dict) -> None:
    """Record a refused restart in the manifest's ``restarts`` and say why in one line of the batch log."""
    run.update(restarts=[*manifest.get("restarts", []), entry])
    line = f"no restart: {entry['class']}: {entry['why']}" if not entry["why"].startswith("no progress") else \
        f"no restart: {entry['why']}"
    say(line + (f"; {entry['fix']}" if entry.get("fix") else ""))


def requeue_job(job_id: str | None) -> bool:
    if not job_id:
        return False
    return slurm_client.requeue(job_id) is None


@contextlib.contextmanager
def sigterm_ignored():
    """SIGTERM ignored inside (the main thread only): Slurm's end of the batch step after a requeue signals this
    process too, and the exclusion must still reach slurmctld."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def exclude_from_job(job_id: str, nodes: list[str]) -> str | None:
    """``scontrol update JobId=J ExcNodeList=...`` on the requeued (pending) job, so that Slurm does not give it
    ``nodes`` again: None when Slurm took it, else its words."""
    return slurm_client.exclude_nodes(job_id, nodes)


def record_restart(run: RunFolder, manifest: dict, entry: dict, n: int) -> None:
    """Start ``n`` about to begin: the ended one's hang verdict set aside, ``entry`` appended to the manifest's
    ``restarts``, state STARTING and the ended step's failure fields cleared."""
    set_aside_hang(run, n)
    run.update(event="restarting", state="STARTING", restart_count=n, restarts=[*manifest.get("restarts", []), entry],
               reason=None, failed_ranks=None, failed_nodes=None, exit_code=None, error=None)


def step_exports(base: int, nodes: list[str], excluded: list[str], policy: Policy, job_id: str | None, n: int,
                 hints: dict[str, str | int]) -> str:
    """The exports of start ``n``'s step on ``nodes``: its start number, nodes, rendezvous, counts and ``hints``."""
    return exports({RESTART_BASE_ENV: base, "HPC_TOOLS_NODELIST": ",".join(nodes),
                    "HPC_TOOLS_EXCLUDED": ",".join(excluded), "MASTER_ADDR": nodes[0],
                    "MASTER_PORT": step_port(job_id, n), **step_counts(policy, nodes), **hints})
