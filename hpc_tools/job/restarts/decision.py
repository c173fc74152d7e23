"""The decisions: ``begin`` (the first rank step of a life), ``next_step`` (after a failed rank step: a new step,
a requeue or none, in the order the package docstring numbers) and ``local_restart`` (the local executor's)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from hpc_tools.job.failure_class import STOP
from hpc_tools.job.restarts import action, evidence, named_nodes
from hpc_tools.job.restarts import nodes as hosts
from hpc_tools.job.restarts.facts import (
    ELASTIC_WAIT_ENV,
    ELASTIC_WAIT_S,
    ENDED,
    PROBE_WAIT_S,
    Policy,
    elastic_counts,
    in_job_restarts,
    life_number,
    next_start,
    preflight_excluded,
    recipe_of,
    seconds_from,
    step_counts,
    step_port,
)
from hpc_tools.registry import RunFolder
from hpc_tools.runtime import elastic
from hpc_tools.runtime.distenv import RESTART_BASE_ENV, restart_count
from hpc_tools.runtime.preflight import leave_out


def begin(run_dir: Path, env: dict[str, str], policy: Policy | None = None) -> str:
    """Exports of the first rank step of this life: its start number, nodes and rendezvous."""
    run = RunFolder(run_dir)
    policy = policy or Policy.of_run(run)
    job_id = env.get("SLURM_JOB_ID")
    manifest = run.manifest()
    n = life_number(manifest, env)
    allocation = hosts.allocation_nodes(job_id, env)
    # nodes an earlier life's preflight left out by a requeue (should Slurm not have kept them out of this allocation)
    excluded = [x for x in preflight_excluded(manifest) if x in allocation]
    if len(allocation) - len(excluded) < policy.nodes:
        excluded = []
    nodes = [x for x in allocation if x not in excluded][:policy.nodes]
    values: dict[str, str | int] = {RESTART_BASE_ENV: n - int(env.get("SLURM_RESTART_COUNT", "0") or 0),
                                    "HPC_TOOLS_NODELIST": ",".join(nodes), "HPC_TOOLS_EXCLUDED": ",".join(excluded),
                                    **hosts.preflight_hints(allocation, nodes, excluded, policy, manifest, job_id,
                                                            env=env, run_dir=run.path)}
    if nodes:
        values.update(MASTER_ADDR=nodes[0], MASTER_PORT=step_port(job_id, n), **step_counts(policy, nodes))
    return action.exports(values)


def next_step(run_dir: Path, exit_code: int, env: dict[str, str], prober=hosts.probe, wait_s: float = PROBE_WAIT_S,
              requeue=None, policy: Policy | None = None) -> str | None:
    """The exports of a new rank step after one that ended with ``exit_code``, or None (no restart: the caller
    records the end). Records the restart (or the requeue) in the manifest."""
    at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")  # the step's end, as near the fault as known
    run = RunFolder(run_dir)
    manifest = run.manifest()
    policy = policy or Policy.of_run(run)
    if exit_code == 0 or manifest.get("state") in ENDED or manifest.get("cancel_requested"):
        return None
    start = restart_count(env)
    marker = leave_out.read(run.path, start)
    if marker is not None:  # preflight named nodes that a spare or a requeue can replace: no failure to classify
        return named_nodes.leave_out_step(run, manifest, marker, env, policy, at, prober=prober, wait_s=wait_s,
                                          requeue=requeue)
    found = evidence.culprit(run, exit_code, start)
    if len(in_job_restarts(manifest)) >= policy.budget:
        action.say(f"no restart: the budget of {policy.budget} in-job restart(s) (cluster.restarts) is spent")
        return None
    job_id = env.get("SLURM_JOB_ID")
    verdict = evidence.judge(run, found, start, manifest)
    if verdict["decision"] == STOP:
        action.stop(run, manifest, {"at": at, **found, "job_id": job_id, "restart": None, "kind": "stop",
                                    "nodes": None, "from_iteration": None, "time_to_first_step_s": None, **verdict})
        return None
    allocation = hosts.allocation_nodes(job_id, env)
    nodes, excluded, fewer = new_step_nodes(run, env, policy, allocation, found, prober, wait_s)
    n = next_start(manifest, start)  # the next start's number: above every start the run has had
    entry = {"at": at, **found, "job_id": job_id, "restart": n, "from_iteration": None,
             "time_to_first_step_s": None, **verdict}
    if len(nodes) < (fewer or policy.nodes):
        no_room(run, manifest, entry, found, policy, len(allocation) - len(excluded), requeue)
        return None
    return restart_on(run, manifest, entry, found, env, policy, exit_code, allocation, nodes, excluded, fewer)


def new_step_nodes(run: RunFolder, env: dict[str, str], policy: Policy, allocation: list[str], found: dict, prober,
                   wait_s: float) -> tuple[list[str], list[str], int | None]:
    """(the new step's nodes, the nodes excluded from now on, the node count below the layout's an elastic job goes
    on with, else None). The culprit's cause in ``found`` becomes ``node failure`` when its node does not answer."""
    before = [n for n in env.get("HPC_TOOLS_EXCLUDED", "").split(",") if n]
    need = policy.nodes
    silent: set[str] = set()
    nodes, excluded = hosts.choose_nodes(allocation, before, found["node"], need,
                                         wait_s=min(wait_s, seconds_from(env, ELASTIC_WAIT_ENV, ELASTIC_WAIT_S))
                                         if policy.elastic else wait_s, prober=prober,
                                         say=action.say, unanswered=silent)
    fewer = None  # an elastic job's node count below the layout's
    for k in (elastic_counts(run.path, policy) if len(nodes) < need else []):
        nodes, excluded = hosts.choose_nodes(allocation, before + sorted(silent), found["node"], k, wait_s=0.0,
                                             prober=prober, say=action.say, unanswered=silent)
        if len(nodes) >= k:
            fewer = k
            break
    if found["node"] in silent and found["cause"] in ("lost", "killed", "failed"):
        found["cause"] = "node failure"  # its slurmd did not answer either: the node went down with the rank
    return nodes, excluded, fewer


def no_room(run: RunFolder, manifest: dict, entry: dict, found: dict, policy: Policy, usable: int, requeue) -> None:
    """The allocation holds ``usable`` nodes, too few for the layout: the job requeued (``cluster.requeue``, its next
    allocation has every node again), else no restart."""
    need = policy.nodes
    if policy.requeue and (requeue or action.requeue_job)(entry["job_id"]):
        entry.update(kind="requeue", nodes=None)
        run.update(event="requeued", state="REQUEUED", restarts=[*manifest.get("restarts", []), entry],
                   requeued_after=found["reason"])
        action.say(f"the allocation holds {usable} usable node(s) of the {need} the layout needs: job requeued")
    else:
        action.say(f"no restart: the allocation holds {usable} usable node(s) of the {need} the layout needs")


def restart_on(run: RunFolder, manifest: dict, entry: dict, found: dict, env: dict[str, str], policy: Policy,
               exit_code: int, allocation: list[str], nodes: list[str], excluded: list[str],
               fewer: int | None) -> str:
    """The in-job restart on ``nodes``: recorded, said in the batch log, and the new step's exports."""
    need, n, job_id = policy.nodes, entry["restart"], entry["job_id"]
    entry.update(kind="in-job", nodes=nodes)
    if fewer is not None:
        entry.update(layout_nodes=fewer, decision="fewer nodes",
                     why=f"{need - fewer} of {need} node(s) lost and no spare: training goes on with {fewer} "
                         f"(cluster.min_nodes={policy.min_nodes}) in the layout the planner chose for them")
    action.record_restart(run, manifest, entry, n)
    why = found["reason"] or f"exit code {exit_code}"
    action.say(f"{len(in_job_restarts(manifest)) + 1} of {policy.budget} in this run ({found['cause']}: {why}; "
               f"{entry['class']}); a new step on {','.join(nodes)} "
               + (f"(elastic: {len(nodes)} of {need} nodes, cluster.min_nodes={policy.min_nodes}; the layout for "
                  f"them in {elastic.ELASTIC_FILE}) " if fewer is not None else "")
               + "resumes from the newest complete checkpoint", restart=True)
    return action.step_exports(n - int(env.get("SLURM_RESTART_COUNT", "0") or 0), nodes, excluded, policy, job_id, n,
                               hosts.preflight_hints(allocation, nodes, excluded, policy, run.manifest(), job_id,
                                                     leave_out.accepted(env), env=env, run_dir=run.path))


def local_restart(run: RunFolder, exit_codes: dict[int, int], start: int) -> int | None:
    """The local executor's in-job restart: after start ``start`` of the ranks failed (rank -> return code of the
    first failing ranks), the number of the next start, recorded in the manifest's ``restarts`` (None: no restart,
    the budget ``cluster.restarts`` is spent, or the ranks completed or were stopped)."""
    from hpc_tools.job.epilogue import failures_from_exit_codes

    at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    manifest = run.manifest()
    budget = recipe_of(run).cluster.restarts
    done = in_job_restarts(manifest)
    if not budget or manifest.get("state") in ENDED or manifest.get("cancel_requested") or len(done) >= budget:
        return None
    code = next(iter(exit_codes.values()), 1)
    found = evidence.culprit(run, 128 - code if code < 0 else code, start, failures_from_exit_codes(exit_codes))
    verdict = evidence.judge(run, found, start, manifest)
    if verdict["decision"] == STOP:
        action.stop(run, manifest, {"at": at, **found, "job_id": None, "restart": None, "kind": "stop", "nodes": None,
                                    "from_iteration": None, "time_to_first_step_s": None, **verdict})
        return None
    n = next_start(manifest, start)
    entry = {"at": at, **found, "job_id": None, "restart": n, "kind": "in-job", "nodes": None, "from_iteration": None,
             "time_to_first_step_s": None, **verdict}
    action.record_restart(run, manifest, entry, n)
    action.say(f"{len(done) + 1} of {budget} in this run ({found['cause']}: {found['reason']}); the ranks start again "
               "from the newest complete checkpoint", restart=True)
    return n
