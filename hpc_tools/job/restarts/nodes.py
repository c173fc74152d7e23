"""The nodes of a new step: the allocation as Slurm holds it now, the probe step that tells a node that answers, the
choice among them (``choose_nodes``), the partition's room for a requeue, and what could replace a node preflight
names (``preflight_hints``, exported for every step)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpc_tools import slurm_client
from hpc_tools.job.restarts.facts import (
    PROBE_TIMEOUT_S,
    PROBE_WAIT_S,
    Policy,
    elastic_counts,
    preflight_excluded,
    restarts_left,
)
from hpc_tools.runtime.preflight import leave_out


def hostnames(nodelist: str) -> list[str]:
    return slurm_client.hostnames(nodelist)


def allocation_nodes(job_id: str | None, env: dict[str, str]) -> list[str]:
    """The job's nodes as Slurm holds them now (a node Slurm removed from a ``--no-kill`` job is gone)."""
    if job_id:
        fields = slurm_client.show_job(job_id)
        if fields.get("NodeList") not in (None, "", "(null)"):
            return hostnames(fields["NodeList"])
    return hostnames(env.get("SLURM_JOB_NODELIST", ""))


def probe(node: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``node``'s slurmd runs a step of this job (``srun true`` there)."""
    return slurm_client.probe(node, timeout_s)


def choose_nodes(allocation: list[str], excluded: list[str], failed: str | None, need: int,
                 wait_s: float = PROBE_WAIT_S, prober=probe, say=None,
                 unanswered: set[str] | None = None) -> tuple[list[str], list[str]]:
    """(the nodes of the new step, the nodes excluded from now on). The failed node is excluded when the allocation
    holds ``need`` nodes without it; nodes that do not answer the probe within ``wait_s`` are excluded too when
    enough others answer. Fewer than ``need`` nodes returned: the allocation cannot hold the layout."""
    excluded = list(dict.fromkeys(excluded))
    usable = [n for n in allocation if n not in excluded]
    if failed and failed in usable and len(usable) - 1 >= need:
        excluded.append(failed)
        usable.remove(failed)
    if len(usable) < need:
        return [], excluded
    deadline = time.monotonic() + wait_s
    while True:
        with ThreadPoolExecutor(max(1, min(len(usable), 16))) as pool:
            answers = dict(zip(usable, pool.map(prober, usable)))
        good = [n for n in usable if answers[n]]
        if unanswered is not None:
            unanswered.update(n for n in usable if not answers[n])
        if len(good) >= need and (len(good) == len(usable) or time.monotonic() >= deadline or
                                  len(usable) > need):
            return good[:need], excluded + [n for n in usable if not answers[n]]
        if time.monotonic() >= deadline:
            return [], excluded + [n for n in usable if not answers[n]]
        if say:
            say(f"waiting for {', '.join(n for n in usable if not answers[n])} to answer")
        time.sleep(2.0)


def partition_nodes(env: dict[str, str]) -> list[str]:
    """The nodes of the job's partition (``sinfo``), whatever their state; [] when Slurm does not answer."""
    return slurm_client.partition_nodes(env.get("SLURM_JOB_PARTITION"), job_side=True)


def requeue_room(policy: Policy, manifest: dict, env: dict[str, str]) -> int:
    """How many nodes a requeued job could take instead of named ones: the partition's nodes beyond the job's own
    count, less those earlier lives' preflight already excluded. A requeue that excludes more than this would leave
    the job pending for ever (a 2-node job on a 2-node partition)."""
    return max(0, len(partition_nodes(env)) - policy.nodes - len(preflight_excluded(manifest)))


def preflight_hints(allocation: list[str], nodes: list[str], excluded: list[str], policy: Policy, manifest: dict,
                    job_id: str | None, accept: list[str] | None = None,
                    env: dict[str, str] | None = None, run_dir: Path | None = None) -> dict[str, str | int]:
    """What could replace a node the step's preflight names (``hpc_tools.runtime.preflight.leave_out``): the spare
    nodes (outside the step, not excluded), how many of the step's nodes an elastic job may go on without (down to
    the fewest node count its ``elastic.json`` in ``run_dir`` has a layout for), and whether a requeue may leave it out
    and for how many nodes (the partition's room: ``requeue_room``), all only while a restart is left; ``accept``:
    nodes nothing could replace before (the step trains on them)."""
    left = restarts_left(manifest, policy) > 0
    spares = len([x for x in allocation if x not in nodes and x not in excluded]) if left else 0
    counts = elastic_counts(run_dir, policy) if left and run_dir is not None else []
    fewer = max(0, len(nodes) - min(counts)) if counts else 0
    room = requeue_room(policy, manifest, dict(os.environ) if env is None else env) \
        if left and policy.requeue and job_id else 0
    return {leave_out.SPARES_ENV: spares, leave_out.FEWER_ENV: fewer, leave_out.REQUEUE_ENV: int(room > 0),
            leave_out.ROOM_ENV: room, leave_out.ACCEPT_ENV: ",".join(accept or [])}
