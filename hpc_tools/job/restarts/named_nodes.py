"""After a step whose preflight or health check named nodes (``hpc_tools.runtime.preflight.leave_out``'s marker of
this start, its ``source``: ``preflight`` before step 1, ``health`` while training, ``hpc_tools.runtime.health``): no
failure to classify, but nodes to leave out. A new step without them on spare nodes (or, for an elastic job, on the
most nodes left), else the job requeued excluding them, both while ``cluster.restarts`` has one left; else ``auto``
starts the step again told to train on them and ``strict`` stops."""

from __future__ import annotations

from dataclasses import dataclass

from hpc_tools.job.failure_class import INFRA, STOP
from hpc_tools.job.restarts import action
from hpc_tools.job.restarts import nodes as hosts
from hpc_tools.job.restarts.facts import (
    PROBE_WAIT_S,
    Policy,
    elastic_counts,
    in_job_restarts,
    next_start,
    preflight_excluded,
    restarts_left,
)
from hpc_tools.registry import RunFolder
from hpc_tools.runtime.distenv import restart_count
from hpc_tools.runtime.preflight import leave_out


def namer(marker: dict) -> str:
    """Who named the nodes: ``preflight`` (before step 1) or ``the health check`` (while training: the marker's
    ``source`` is ``health``, ``hpc_tools.runtime.health``)."""
    return "the health check" if marker.get("source") == "health" else "preflight"


def named_words(marker: dict) -> str:
    """"n2 slow (GEMM 0.1 TFLOP/s is 0.2x the node median ...)": each named node with its verdict and reasons."""
    about = marker.get("details") or {}
    return "; ".join(f"{x} {about.get(x, {}).get('verdict', 'named')}" +
                     (f" ({'; '.join(about[x]['reasons'])})" if about.get(x, {}).get("reasons") else "")
                     for x in marker["nodes"])


@dataclass
class Named:
    """One leave-out decision: the run, its manifest before it, the job's environment and cluster facts, the nodes
    preflight named (``marker``), the allocation and the nodes excluded before, the next start's number ``n`` and
    the ``restarts`` entry being written."""

    run: RunFolder
    manifest: dict
    env: dict[str, str]
    policy: Policy
    marker: dict
    allocation: list[str]
    excluded: list[str]
    n: int
    entry: dict

    @property
    def named(self) -> list[str]:
        return list(self.marker["nodes"])

    @property
    def them(self) -> str:
        return ", ".join(self.named)

    @property
    def job_id(self) -> str | None:
        return self.env.get("SLURM_JOB_ID")

    @property
    def base(self) -> int:
        return self.n - int(self.env.get("SLURM_RESTART_COUNT", "0") or 0)

    def hints(self, nodes: list[str], excluded: list[str], accept: list[str]) -> dict[str, str | int]:
        return hosts.preflight_hints(self.allocation, nodes, excluded, self.policy, self.run.manifest(), self.job_id,
                                     accept, env=self.env, run_dir=self.run.path)


def leave_out_step(run: RunFolder, manifest: dict, marker: dict, env: dict[str, str], policy: Policy, at: str,
                   prober=hosts.probe, wait_s: float = PROBE_WAIT_S, requeue=None) -> str | None:
    """After a step whose preflight (or health check) named nodes (``leave_out``'s marker): a new step without them
    on spare nodes (an in-job restart), else the job requeued excluding them (``scontrol requeue``, then ``scontrol
    update ExcNodeList`` on the pending job), both while ``cluster.restarts`` has one left; else ``auto`` starts the
    step again on the same nodes, told to train on them, and ``strict`` stops. Each is a ``restarts`` entry of class
    infrastructure, cause ``preflight`` (``named_by``: ``preflight`` or ``health``), with the nodes, their figures and
    reasons."""
    job_id = env.get("SLURM_JOB_ID")
    named = list(marker["nodes"])
    # cause "preflight" for both namers: the budget (failure_class) and the requeue exclusions (facts) treat a
    # health check's leave-out exactly as preflight's; ``named_by`` tells them apart
    entry = {"at": at, "cause": "preflight", "named_by": marker.get("source") or "preflight", "rank": None,
             "node": named[0], "nodes_named": named, "reason": f"{namer(marker)} named {named_words(marker)}",
             "job_id": job_id, "restart": None, "from_iteration": None, "time_to_first_step_s": None, "class": INFRA,
             "signature": None, "preflight": marker.get("details") or {}}
    case = Named(run, manifest, env, policy, marker, hosts.allocation_nodes(job_id, env),
                 [x for x in env.get("HPC_TOOLS_EXCLUDED", "").split(",") if x],
                 next_start(manifest, restart_count(env)), entry)
    if restarts_left(manifest, policy) > 0:
        line = on_other_nodes(case, prober, wait_s)
        if line is not None:
            return line
        if policy.requeue and job_id and requeue_without(case, requeue):
            return None
    return nothing_replaces(case)


def on_other_nodes(case: Named, prober, wait_s: float) -> str | None:
    """A spare takes the named nodes' place; else (no spare) an elastic job goes on without them, on the most nodes
    left. The exports of the new step, or None when neither can be had."""
    policy, entry, need, words = case.policy, case.entry, case.policy.nodes, named_words(case.marker)
    for k in [need, *elastic_counts(case.run.path, policy)]:
        nodes, out = hosts.choose_nodes(case.allocation, case.excluded + case.named, None, k,
                                        wait_s=wait_s if k == need else 0.0, prober=prober, say=action.say)
        if len(nodes) < k:
            continue
        entry.update(kind="in-job", restart=case.n, nodes=nodes, decision="leave out",
                     why=f"a spare node takes the place of {case.them}")
        if k < need:
            entry.update(layout_nodes=k, why=f"no spare node for {case.them}: training goes on with {k} of {need} "
                                             f"node(s) (cluster.min_nodes={policy.min_nodes}) in the layout the "
                                             "planner chose for them")
        action.record_restart(case.run, case.manifest, entry, case.n)
        action.say(f"{len(in_job_restarts(case.manifest)) + 1} of {policy.budget} in this run ({namer(case.marker)} "
                   f"named {words}; infrastructure): {case.them} left out, a new step on {','.join(nodes)}"
                   + (f" (elastic: {k} of {need} nodes)" if k < need else ""), restart=True)
        return action.step_exports(case.base, nodes, out, policy, case.job_id, case.n,
                                   case.hints(nodes, out, leave_out.accepted(case.env)))
    return None


def requeue_without(case: Named, requeue=None) -> bool:
    """The job requeued without the named nodes (``ExcNodeList``, with those earlier lives excluded); whether Slurm
    requeued it."""
    named, them, entry, manifest = case.named, case.them, case.entry, case.manifest
    keep_out = list(dict.fromkeys([*preflight_excluded(manifest), *named]))
    # The requeue ends this batch script (SIGTERM now, SIGKILL after KillWait): the exclusion and the record
    # are made with SIGTERM ignored. Slurm takes ExcNodeList for a pending job only (job_mgr.c:
    # ESLURM_JOB_NOT_PENDING), and a requeued job is pending (and completing) at once: the exclusion follows.
    with action.sigterm_ignored():
        if not (requeue or action.requeue_job)(case.job_id):
            return False
        refused = action.exclude_from_job(case.job_id, keep_out)
        entry.update(kind="requeue", nodes=None, decision="requeue",
                     why=f"no spare node for {them}: the job is requeued without "
                         f"{'it' if len(named) == 1 else 'them'}")
        case.run.update(event="requeued", state="REQUEUED", restarts=[*manifest.get("restarts", []), entry],
                        requeued_after=entry["reason"])
        action.say(f"{namer(case.marker)} named {named_words(case.marker)}; no spare node can take the place of "
                   f"{them}: job requeued with " + (f"ExcNodeList={','.join(keep_out)}" if refused is None else
                                       f"Slurm refusing ExcNodeList ({refused}): its next life leaves {them} out of "
                                       "its steps when its allocation holds enough other nodes"))
        return True


def nothing_replaces(case: Named) -> str | None:
    """Nothing can replace the named nodes: ``strict`` stops; ``auto`` starts the step again on the same nodes, told
    to train on them (the exports), or None when the step's nodes are not known."""
    named, entry, words = case.named, case.entry, named_words(case.marker)
    nothing = "nothing could replace " + ("it" if len(named) == 1 else "them") + \
        " (no spare node outside the step, no in-job restart or requeue left)"
    if case.marker.get("mode", "auto") == "strict":
        entry.update(kind="stop", decision=STOP, why=f"preflight (cluster.preflight=strict) named {words}; {nothing}")
        action.stop(case.run, case.manifest, entry)
        return None
    step_nodes = [x for x in case.env.get("HPC_TOOLS_NODELIST", "").split(",") if x]
    nodes = step_nodes or [x for x in case.allocation if x not in case.excluded][:case.policy.nodes]
    if not nodes:
        action.say(f"no restart: preflight named {words}; {nothing}, and the step's nodes are not known")
        return None
    entry.update(kind="preflight", restart=case.n, nodes=nodes, decision="train on", why=nothing)
    case.run.update(event="restarting", state="STARTING", restart_count=case.n,
                    restarts=[*case.manifest.get("restarts", []), entry], reason=None, failed_ranks=None,
                    failed_nodes=None, exit_code=None, error=None)
    action.say(f"preflight named {words}; {nothing}: training goes on with {case.them} (cluster.preflight=auto)",
               restart=True)
    accept = list(dict.fromkeys([*leave_out.accepted(case.env), *named]))
    return action.step_exports(case.base, nodes, case.excluded, case.policy, case.job_id, case.n,
                               case.hints(nodes, case.excluded, accept))
