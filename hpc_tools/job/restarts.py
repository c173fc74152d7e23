"""Recovery inside the allocation (``cluster.restarts``, ``cluster.spare_nodes``): a new srun step in the same job.

``python -m hpc_tools.job.restarts begin --run-dir RUN`` runs in the batch shell before the first rank step and
prints shell exports for it; ``... next --run-dir RUN --exit-code N`` runs after a rank step that failed and either
prints the exports of a new step (exit 0: the batch script starts it) or exits 1 (the script goes on to its epilogue,
which records the end as before). Both launch paths use it: the rendered sbatch script's loop around its ``srun`` line
and submitit's teardown (``hpc_tools.executors.slurm``), on the batch host (never inside a pyxis container, which has
no Slurm client), with the recipe's cluster facts as options (``Policy``), so it needs the standard library only.

What ``next`` does, in order:

1. Nothing to recover: the step succeeded, the ranks completed or were stopped by a signal (time limit: they
   checkpointed and requeued the job; scancel), or the budget is spent (``cluster.restarts`` in-job restarts per
   run, counted in the manifest's ``restarts``): exit 1.
   A step that preflight ended to leave named nodes out (``hpc_tools.runtime.preflight.leave_out``'s marker of
   this start) is no failure: ``leave_out_step`` starts the next step without them on spare nodes, or requeues the
   job excluding them, or (nothing can replace them) starts the step again told to train on them (``auto``) or stops
   (``strict``); ``begin`` and every new step export what could replace a node (``preflight_hints``).
2. The culprit of the step, from the same evidence as the epilogue (srun's reports of this step in the batch log,
   the heartbeats of this start, the hang watchdog's verdict): its rank, node and cause (``killed``, ``exited``,
   ``hang``, ``node failure``, ``cancelled``).
3. The class of the failure (``hpc_tools.job.failure_class``: user error, oom, infrastructure, transient) and
   the no-progress guard: a user error, an OOM, or a third fault from the same checkpoint iteration stops here
   (exit 1), with one line why in the batch log and a ``restarts`` entry of kind ``stop``.
4. The nodes of the new step: the allocation's nodes (as Slurm holds them now: a node Slurm removed is gone) minus
   those excluded before, minus the culprit's node when a spare can take its place (``cluster.spare_nodes``); the
   first ``cluster.nodes`` of them that answer a probe step (``srun true`` on each; a crashed node's slurmd may be
   coming back: the probe is retried for up to ``PROBE_WAIT_S``). An elastic job (``cluster.min_nodes``) waits
   ``ELASTIC_WAIT_S`` only (``HPC_TOOLS_ELASTIC_WAIT_S`` in the job's environment), then goes on with the most
   nodes that answer among the counts the planner found a layout for (``elastic.json``, written by
   ``hpc_tools.planner.elastic``), at least ``min_nodes``: the step's counts are exported
   (``HPC_TOOLS_STEP_NODES``/``_TASKS``) and its ranks train in that count's layout. When the allocation cannot
   hold the layout (or the fewest nodes of an elastic one), the job is requeued (``scontrol requeue``, with
   ``cluster.requeue``; its next allocation has every node again: the run regrows) and this exits 1.
5. The record: the manifest's ``restarts`` gets ``{at, cause, rank, node, reason, job_id, restart, nodes,
   from_iteration, time_to_first_step_s, class, decision, why, signature}`` (``from_iteration`` and
   ``time_to_first_step_s`` filled by rank 0 of the new start: the step it resumed from and the seconds from ``at``
   to its first completed step), state STARTING; a hang verdict (``HANG.txt``) of
   the ended step is moved to ``hang/HANG-restart<N>.txt`` so it does not speak for the new start.
6. The exports: the new start's number (``HPC_TOOLS_RESTART_BASE``, so its records, heartbeats and checkpoints'
   ``restart`` differ from the ended one's), its rendezvous (the first node of the step, a port derived from the job
   id and the start number: the ended step's port may still be held) and ``HPC_TOOLS_NODELIST``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hpc_tools.job.failure_class import INFRA, KERNEL_OOM, RESTART, STOP, classify, no_progress, signature
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import HANG_EXIT_CODE, HANG_MARKER
from hpc_tools.runtime import elastic, heartbeat
from hpc_tools.runtime.distenv import PORT_BASE, PORT_SPAN, RESTART_BASE_ENV, restart_count
from hpc_tools.runtime.preflight import leave_out

PROBE_WAIT_S = 180.0  # how long a restart waits for a node's slurmd to answer (a crashed node coming back)
# An elastic job (cluster.min_nodes) waits this long for a lost node to answer before it goes on with fewer nodes.
ELASTIC_WAIT_S = 30.0
PROBE_TIMEOUT_S = 20.0  # one probe step
STUCK_STEP_S = 20.0  # a rank exited with an error this long ago and the step still runs: cancel it (``watch``)
RESTART_LINE = "hpc_tools: restart "  # begins a new step's part of the batch log (the epilogue reads from there)
# A site sets these two in the job's environment (cluster.setup.env) where its nodes come back sooner or later, or
# its lost nodes' tasks are known gone at once; the test cluster's elastic test shortens both.
ELASTIC_WAIT_ENV, STUCK_STEP_ENV = "HPC_TOOLS_ELASTIC_WAIT_S", "HPC_TOOLS_STUCK_STEP_S"


def seconds_from(env: dict[str, str], name: str, default: float) -> float:
    """``env[name]`` as seconds >= 0, else ``default`` (unset, or not a number: the batch script must go on)."""
    try:
        value = float(env.get(name, ""))
    except ValueError:
        return default
    return value if value >= 0 else default


def hostnames(nodelist: str) -> list[str]:
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    return out.stdout.split() if out.returncode == 0 else []


def allocation_nodes(job_id: str | None, env: dict[str, str]) -> list[str]:
    """The job's nodes as Slurm holds them now (a node Slurm removed from a ``--no-kill`` job is gone)."""
    if job_id:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)
        if out.returncode == 0 and fields.get("NodeList") not in (None, "", "(null)"):
            return hostnames(fields["NodeList"])
    return hostnames(env.get("SLURM_JOB_NODELIST", ""))


def probe(node: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``node``'s slurmd runs a step of this job (``srun true`` there)."""
    try:
        out = subprocess.run(["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
                              "--cpus-per-task=1", "--mem=0", "--kill-on-bad-exit=1", "true"], capture_output=True,
                             text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def step_port(job_id: str | None, start: int) -> int:
    """The rendezvous port of start ``start`` of job ``job_id``: the job's port (``distenv.port_for_job``) for start
    0 of the job, another one for each restart (the ended step's store may still hold its port)."""
    base = int(str(job_id or 0).split("_")[0])
    return PORT_BASE + (base + 211 * start) % PORT_SPAN


def life_number(manifest: dict, env: dict[str, str]) -> int:
    """The number of the start about to begin: Slurm's requeue count plus ``HPC_TOOLS_RESTART_BASE``, or one more than
    any start the manifest holds (in-job restarts of an earlier life of a requeued job numbered theirs on top)."""
    n = restart_count(env)
    seen = [int(e.get("restart_count") or 0) for e in manifest.get("events", []) if e.get("event") == "started"]
    requeued = int(env.get("SLURM_RESTART_COUNT", "0") or 0) > 0 or int(env.get(RESTART_BASE_ENV, "0") or 0) > 0
    if requeued and seen and n <= max(seen):
        n = max(seen) + 1
    return n


def exports(values: dict[str, str | int]) -> str:
    return "export " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in values.items())


@dataclass(frozen=True)
class Policy:
    """What a restart decision reads of the recipe's cluster section: the layout's node count (``cluster.nodes``),
    the budget of in-job restarts (``cluster.restarts``) and whether a job too small for the layout is requeued
    (``cluster.requeue``). A batch script passes them as options (``--nodes``, ``--budget``, ``--requeue``;
    ``hpc_tools.render.envsetup.restart_policy_args``), so the controller runs with the standard library only, on a
    batch host outside the job's container; without them they are read from the run's recipe."""

    nodes: int
    budget: int
    requeue: bool
    min_nodes: int | None = None  # cluster.min_nodes of an elastic job (fewer than nodes); None: not elastic
    ranks_per_node: int = 1  # cluster.gpus_per_node: the task count of a step on fewer nodes

    @classmethod
    def of_run(cls, run: RunFolder) -> "Policy":
        cluster = _recipe(run).cluster
        return cls(nodes=cluster.nodes, budget=cluster.restarts, requeue=cluster.requeue,
                   min_nodes=cluster.fewest_nodes if cluster.elastic else None, ranks_per_node=cluster.gpus_per_node)

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nodes


def step_counts(policy: Policy, nodes: list[str]) -> dict[str, str | int]:
    """The node and task counts of an elastic job's step (``render.envsetup.STEP_COUNTS`` reads them); {} for a job
    that is not elastic (its steps keep the rendered counts)."""
    if not policy.elastic:
        return {}
    return {"HPC_TOOLS_STEP_NODES": len(nodes), "HPC_TOOLS_STEP_TASKS": len(nodes) * policy.ranks_per_node}


def elastic_counts(run_dir: Path, policy: Policy) -> list[int]:
    """The node counts below ``cluster.nodes`` an elastic job may continue on, most first: those the planner found a
    layout for (``elastic.json``), at least ``min_nodes``."""
    if not policy.elastic:
        return []
    return sorted((k for k in elastic.planned(run_dir) if policy.min_nodes <= k < policy.nodes), reverse=True)


def begin(run_dir: Path, env: dict[str, str], policy: Policy | None = None) -> str:
    """Exports of the first rank step of this life: its start number, nodes and rendezvous."""
    run = RunFolder(run_dir)
    policy = policy or Policy.of_run(run)
    job_id = env.get("SLURM_JOB_ID")
    manifest = run.manifest()
    n = life_number(manifest, env)
    allocation = allocation_nodes(job_id, env)
    # nodes an earlier life's preflight left out by a requeue (should Slurm not have kept them out of this allocation)
    excluded = [x for x in preflight_excluded(manifest) if x in allocation]
    if len(allocation) - len(excluded) < policy.nodes:
        excluded = []
    nodes = [x for x in allocation if x not in excluded][:policy.nodes]
    values: dict[str, str | int] = {RESTART_BASE_ENV: n - int(env.get("SLURM_RESTART_COUNT", "0") or 0),
                                    "HPC_TOOLS_NODELIST": ",".join(nodes), "HPC_TOOLS_EXCLUDED": ",".join(excluded),
                                    **preflight_hints(allocation, nodes, excluded, policy, manifest, job_id, env=env,
                                                     run_dir=run.path)}
    if nodes:
        values.update(MASTER_ADDR=nodes[0], MASTER_PORT=step_port(job_id, n), **step_counts(policy, nodes))
    return exports(values)


def preflight_requeues(manifest: dict) -> list[dict]:
    return [e for e in manifest.get("restarts", []) if e.get("cause") == "preflight" and e.get("kind") == "requeue"]


def preflight_excluded(manifest: dict) -> list[str]:
    """The nodes earlier lives' preflight requeued the job without."""
    return list(dict.fromkeys(x for e in preflight_requeues(manifest) for x in e.get("nodes_named") or []))


def restarts_left(manifest: dict, policy: Policy) -> int:
    """What is left of ``cluster.restarts``: in-job restarts and the requeues that left a preflight-named node out
    both spend it (a requeue after a lost node does not: ``cluster.requeue`` governs that one)."""
    done = [r for r in manifest.get("restarts", []) if r.get("kind", "in-job") == "in-job"]
    return policy.budget - len(done) - len(preflight_requeues(manifest))


def partition_nodes(env: dict[str, str]) -> list[str]:
    """The nodes of the job's partition (``sinfo``), whatever their state; [] when Slurm does not answer."""
    partition = env.get("SLURM_JOB_PARTITION")
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N", *(["-p", partition] if partition else [])],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return list(dict.fromkeys(out.stdout.split())) if out.returncode == 0 else []


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


@contextlib.contextmanager
def _sigterm_ignored():
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
    out = subprocess.run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(nodes)}"],
                         capture_output=True, text=True, timeout=30)
    if out.returncode == 0:
        return None
    words = (out.stderr or out.stdout).strip().splitlines()
    return words[-1] if words else f"exit {out.returncode}"


def _recipe(run: RunFolder):
    from hpc_tools.recipe.load import load_resolved

    return load_resolved(run.recipe_path)


def culprit(run: RunFolder, exit_code: int, start: int, failures: list | None = None) -> dict:
    """The ended step's culprit: {cause, rank, node, reason} from the launcher's ``failures`` (the local executor's
    exit codes) or srun's reports, the heartbeats and a hang verdict."""
    from hpc_tools.job.epilogue import decide, from_heartbeats, read_srun_reports

    manifest = run.manifest()
    beats = heartbeat.read_all(run.path, start)
    failures = failures or read_srun_reports(run) or from_heartbeats(beats, manifest.get("world_size"))
    silent = sorted(r for r, b in beats.items() if not b.exit)
    if failures and failures[0].signal is None and not failures[0].node_failure and silent and \
            all(r in beats and beats[r].exit for r in failures[0].ranks):
        # the ranks srun names first exited with an error (their peer's connection closed) while another rank left
        # no exit record: that one died first, with its node or by a signal (a peer's death makes the others raise)
        from hpc_tools.job.epilogue import TaskFailure

        # The first to go stopped beating first (a peer srun killed after it beat on): its node, and its ranks there.
        node = beats[min(silent, key=lambda r: (beats[r].time, r))].node
        ranks = [r for r in silent if beats[r].node == node]
        failures = [TaskFailure(ranks=ranks, node=node, text="ended without an exit record")]
    ending = decide(exit_code, failures, beats, {**manifest, "state": "RUNNING"})
    hang = manifest.get("state") == "HANG" or exit_code == HANG_EXIT_CODE
    first = failures[0] if failures else None
    if hang:
        cause = "hang"
    elif ending.state == "NODE_FAIL":
        cause = "node failure"
    elif first is not None and first.signal is not None:
        cause = "killed"
    elif first is not None and first.code is not None:
        cause = "exited"
    elif first is not None and first.text == "ended without an exit record":
        cause = "lost"
    else:
        cause = "failed"
    ranks = (manifest.get("failed_ranks") if hang else None) or ending.failed_ranks
    nodes = (manifest.get("failed_nodes") if hang else None) or ending.failed_nodes
    reason = (manifest.get("reason") if hang else None) or ending.reason
    return {"cause": cause, "rank": ranks[0] if ranks else None, "node": nodes[0] if nodes else None,
            "reason": reason}


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


def next_step(run_dir: Path, exit_code: int, env: dict[str, str], prober=probe, wait_s: float = PROBE_WAIT_S,
              requeue=None, policy: Policy | None = None) -> str | None:
    """The exports of a new rank step after one that ended with ``exit_code``, or None (no restart: the caller
    records the end). Records the restart (or the requeue) in the manifest."""
    from datetime import datetime, timezone

    at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")  # the step's end, as near the fault as known
    say = _say
    run = RunFolder(run_dir)
    manifest = run.manifest()
    policy = policy or Policy.of_run(run)
    budget = policy.budget
    state = manifest.get("state")
    if exit_code == 0 or state in ("COMPLETED", "REQUEUED", "PREEMPTED", "CANCELLED") or \
            manifest.get("cancel_requested"):
        return None
    done = [r for r in manifest.get("restarts", []) if r.get("kind", "in-job") == "in-job"]
    start = restart_count(env)
    marker = leave_out.read(run.path, start)
    if marker is not None:  # preflight named nodes that a spare or a requeue can replace: no failure to classify
        return leave_out_step(run, manifest, marker, env, policy, at, prober=prober, wait_s=wait_s, requeue=requeue)
    found = culprit(run, exit_code, start)
    if len(done) >= budget:
        say(f"no restart: the budget of {budget} in-job restart(s) (cluster.restarts) is spent")
        return None
    job_id = env.get("SLURM_JOB_ID")
    verdict = judge(run, found, start, manifest)
    if verdict["decision"] == STOP:
        stop(run, manifest, {"at": at, **found, "job_id": job_id, "restart": None, "kind": "stop", "nodes": None,
                             "from_iteration": None, "time_to_first_step_s": None, **verdict})
        return None
    excluded = [n for n in env.get("HPC_TOOLS_EXCLUDED", "").split(",") if n]
    allocation = allocation_nodes(job_id, env)
    need = policy.nodes
    silent: set[str] = set()
    before = list(excluded)
    nodes, excluded = choose_nodes(allocation, before, found["node"], need,
                                   wait_s=min(wait_s, seconds_from(env, ELASTIC_WAIT_ENV, ELASTIC_WAIT_S))
                                   if policy.elastic else wait_s, prober=prober,
                                   say=say, unanswered=silent)
    fewer = None  # an elastic job's node count below the layout's
    for k in (elastic_counts(run.path, policy) if len(nodes) < need else []):
        nodes, excluded = choose_nodes(allocation, before + sorted(silent), found["node"], k, wait_s=0.0,
                                       prober=prober, say=say, unanswered=silent)
        if len(nodes) >= k:
            fewer = k
            break
    if found["node"] in silent and found["cause"] in ("lost", "killed", "failed"):
        found["cause"] = "node failure"  # its slurmd did not answer either: the node went down with the rank
    seen = [int(e.get("restart_count") or 0) for e in manifest.get("events", []) if e.get("event") == "started"]
    n = max([start, *seen]) + 1  # the next start's number: above every start the run has had
    entry = {"at": at, **found, "job_id": job_id, "restart": n, "from_iteration": None,
             "time_to_first_step_s": None, **verdict}
    if len(nodes) < (fewer or need):
        if policy.requeue and (requeue or requeue_job)(job_id):
            entry.update(kind="requeue", nodes=None)
            run.update(event="requeued", state="REQUEUED", restarts=[*manifest.get("restarts", []), entry],
                       requeued_after=found["reason"])
            say(f"the allocation holds {len(allocation) - len(excluded)} usable node(s) of the {need} the layout "
                f"needs: job requeued")
        else:
            say(f"no restart: the allocation holds {len(allocation) - len(excluded)} usable node(s) of the {need} "
                "the layout needs")
        return None
    entry.update(kind="in-job", nodes=nodes)
    if fewer is not None:
        entry.update(layout_nodes=fewer, decision="fewer nodes",
                     why=f"{need - fewer} of {need} node(s) lost and no spare: training goes on with {fewer} "
                         f"(cluster.min_nodes={policy.min_nodes}) in the layout the planner chose for them")
    _set_aside_hang(run, n)
    run.update(event="restarting", state="STARTING", restart_count=n, restarts=[*manifest.get("restarts", []), entry],
               reason=None, failed_ranks=None, failed_nodes=None, exit_code=None, error=None)
    why = found["reason"] or f"exit code {exit_code}"
    say(f"{len(done) + 1} of {budget} in this run ({found['cause']}: {why}; {verdict['class']}); a new step on "
        f"{','.join(nodes)} "
        + (f"(elastic: {len(nodes)} of {need} nodes, cluster.min_nodes={policy.min_nodes}; the layout for them in "
           f"{elastic.ELASTIC_FILE}) " if fewer is not None else "")
        + "resumes from the newest complete checkpoint", restart=True)
    return exports({RESTART_BASE_ENV: n - int(env.get("SLURM_RESTART_COUNT", "0") or 0),
                    "HPC_TOOLS_NODELIST": ",".join(nodes), "HPC_TOOLS_EXCLUDED": ",".join(excluded),
                    "MASTER_ADDR": nodes[0], "MASTER_PORT": step_port(job_id, n), **step_counts(policy, nodes),
                    **preflight_hints(allocation, nodes, excluded, policy, run.manifest(), job_id,
                                      leave_out.accepted(env), env=env, run_dir=run.path)})


def named_words(marker: dict) -> str:
    """"n2 slow (GEMM 0.1 TFLOP/s is 0.2x the node median ...)": each named node with its verdict and reasons."""
    about = marker.get("details") or {}
    return "; ".join(f"{x} {about.get(x, {}).get('verdict', 'named')}" +
                     (f" ({'; '.join(about[x]['reasons'])})" if about.get(x, {}).get("reasons") else "")
                     for x in marker["nodes"])


def leave_out_step(run: RunFolder, manifest: dict, marker: dict, env: dict[str, str], policy: Policy, at: str,
                   prober=probe, wait_s: float = PROBE_WAIT_S, requeue=None) -> str | None:
    """After a step whose preflight named nodes (``leave_out``'s marker): a new step without them on spare nodes
    (an in-job restart), else the job requeued excluding them (``scontrol requeue``, then ``scontrol update
    ExcNodeList`` on the pending job), both while ``cluster.restarts`` has one left; else ``auto`` starts the step
    again on the same nodes, told to train on them, and ``strict`` stops. Each is a ``restarts`` entry of class
    infrastructure, cause ``preflight``, with the nodes, their figures and reasons."""
    job_id = env.get("SLURM_JOB_ID")
    named, mode = list(marker["nodes"]), marker.get("mode", "auto")
    start = restart_count(env)
    step_nodes = [x for x in env.get("HPC_TOOLS_NODELIST", "").split(",") if x]
    excluded = [x for x in env.get("HPC_TOOLS_EXCLUDED", "").split(",") if x]
    accept = leave_out.accepted(env)
    allocation = allocation_nodes(job_id, env)
    need = policy.nodes
    seen = [int(e.get("restart_count") or 0) for e in manifest.get("events", []) if e.get("event") == "started"]
    n = max([start, *seen]) + 1
    them = ", ".join(named)
    words = named_words(marker)
    entry = {"at": at, "cause": "preflight", "rank": None, "node": named[0], "nodes_named": named,
             "reason": f"preflight named {words}", "job_id": job_id, "restart": None, "from_iteration": None,
             "time_to_first_step_s": None, "class": INFRA, "signature": None, "preflight": marker.get("details") or {}}
    done = [r for r in manifest.get("restarts", []) if r.get("kind", "in-job") == "in-job"]
    base = n - int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    if restarts_left(manifest, policy) > 0:
        # a spare takes their place; else (no spare) an elastic job goes on without them, on the most nodes left
        for k in [need, *elastic_counts(run.path, policy)]:
            nodes, out = choose_nodes(allocation, excluded + named, None, k, wait_s=wait_s if k == need else 0.0,
                                      prober=prober, say=_say)
            if len(nodes) < k:
                continue
            entry.update(kind="in-job", restart=n, nodes=nodes, decision="leave out",
                         why=f"a spare node takes the place of {them}")
            if k < need:
                entry.update(layout_nodes=k, why=f"no spare node for {them}: training goes on with {k} of {need} "
                                                 f"node(s) (cluster.min_nodes={policy.min_nodes}) in the layout the "
                                                 "planner chose for them")
            _set_aside_hang(run, n)
            run.update(event="restarting", state="STARTING", restart_count=n,
                       restarts=[*manifest.get("restarts", []), entry], reason=None, failed_ranks=None,
                       failed_nodes=None, exit_code=None, error=None)
            _say(f"{len(done) + 1} of {policy.budget} in this run (preflight named {words}; infrastructure): {them} "
                 f"left out, a new step on {','.join(nodes)}"
                 + (f" (elastic: {k} of {need} nodes)" if k < need else ""), restart=True)
            return exports({RESTART_BASE_ENV: base, "HPC_TOOLS_NODELIST": ",".join(nodes),
                            "HPC_TOOLS_EXCLUDED": ",".join(out), "MASTER_ADDR": nodes[0],
                            "MASTER_PORT": step_port(job_id, n), **step_counts(policy, nodes),
                            **preflight_hints(allocation, nodes, out, policy, run.manifest(), job_id, accept, env=env,
                                              run_dir=run.path)})
        if policy.requeue and job_id:
            keep_out = list(dict.fromkeys([*preflight_excluded(manifest), *named]))
            # The requeue ends this batch script (SIGTERM now, SIGKILL after KillWait): the exclusion and the record
            # are made with SIGTERM ignored. Slurm takes ExcNodeList for a pending job only (job_mgr.c:
            # ESLURM_JOB_NOT_PENDING), and a requeued job is pending (and completing) at once: the exclusion follows.
            with _sigterm_ignored():
                if (requeue or requeue_job)(job_id):
                    refused = exclude_from_job(job_id, keep_out)
                    entry.update(kind="requeue", nodes=None, decision="requeue",
                                 why=f"no spare node for {them}: the job is requeued without "
                                     f"{'it' if len(named) == 1 else 'them'}")
                    run.update(event="requeued", state="REQUEUED", restarts=[*manifest.get("restarts", []), entry],
                               requeued_after=entry["reason"])
                    _say(f"preflight named {words}; no spare node can take the place of {them}: job requeued with "
                         + (f"ExcNodeList={','.join(keep_out)}" if refused is None else
                            f"Slurm refusing ExcNodeList ({refused}): its next life leaves {them} out of its steps "
                            "when its allocation holds enough other nodes"))
                    return None
    nothing = "nothing could replace " + ("it" if len(named) == 1 else "them") + \
        " (no spare node outside the step, no in-job restart or requeue left)"
    if mode == "strict":
        entry.update(kind="stop", decision=STOP, why=f"preflight (cluster.preflight=strict) named {words}; {nothing}")
        stop(run, manifest, entry)
        return None
    nodes = step_nodes or [x for x in allocation if x not in excluded][:need]
    if not nodes:
        _say(f"no restart: preflight named {words}; {nothing}, and the step's nodes are not known")
        return None
    entry.update(kind="preflight", restart=n, nodes=nodes, decision="train on", why=nothing)
    run.update(event="restarting", state="STARTING", restart_count=n, restarts=[*manifest.get("restarts", []), entry],
               reason=None, failed_ranks=None, failed_nodes=None, exit_code=None, error=None)
    _say(f"preflight named {words}; {nothing}: training goes on with {them} (cluster.preflight=auto)", restart=True)
    return exports({RESTART_BASE_ENV: base, "HPC_TOOLS_NODELIST": ",".join(nodes),
                    "HPC_TOOLS_EXCLUDED": ",".join(excluded), "MASTER_ADDR": nodes[0],
                    "MASTER_PORT": step_port(job_id, n), **step_counts(policy, nodes),
                    **preflight_hints(allocation, nodes, excluded, policy, run.manifest(), job_id,
                                      list(dict.fromkeys([*accept, *named])), env=env, run_dir=run.path)})


def kernel_oom(run: RunFolder) -> bool:
    """Whether the kernel's OOM killer ended a task of the latest rank step (slurmstepd's note in the batch log,
    after the last restart line)."""
    from hpc_tools.job.epilogue import LOG_TAIL_BYTES, log_files, log_tail, this_life

    for path in log_files(run):
        text = this_life(log_tail(path, LOG_TAIL_BYTES) or "")
        if KERNEL_OOM.search(text.rsplit(RESTART_LINE, 1)[-1]):
            return True
    return False


def judge(run: RunFolder, found: dict, start: int, manifest: dict) -> dict:
    """The class of the ended step's failure and the decision (``hpc_tools.job.failure_class``), as the keys of its
    ``restarts`` entry: class, decision, why, signature (the exception, to tell a recurring one), fix (oom)."""
    beats = heartbeat.read_all(run.path, start)
    record = beats[found["rank"]].exit if found.get("rank") in beats else None
    previous = manifest.get("restarts") or []
    oom = kernel_oom(run)
    verdict = classify(found["cause"], record, previous, kernel_oom=oom)
    out: dict = {}
    if verdict.decision == RESTART and found["cause"] in ("lost", "exited", "failed"):
        # A rank that raised an error of its own (not a communication error) was not brought down by a peer's death,
        # while srun's --kill-on-bad-exit kills its peers without an exit record: that rank is the culprit (a rank
        # srun saw killed by a signal first, a hang or a lost node stays the culprit).
        # Only while every rank without an exit record was still beating when it raised (a peer that died first, its
        # heartbeat stale, is the culprit whatever the survivor raised).
        raised = sorted((b for b in beats.values() if b.exit and b.exit.get("code") and b.exit.get("error")),
                        key=lambda b: b.exit.get("time") or 0.0)
        silent = [b.time for b in beats.values() if not b.exit]
        for beat in raised:
            own = classify("exited", beat.exit, previous, kernel_oom=oom)
            alive = all(t >= (beat.exit.get("time") or 0.0) - heartbeat.INTERVAL_S - 0.5 for t in silent)
            if own.decision == STOP and alive:
                verdict, record = own, beat.exit
                out = {"cause": "exited", "rank": beat.rank, "node": beat.node,
                       "reason": f"rank {beat.rank} on {beat.node} raised {own.why}"}
                break
    out.update({"class": verdict.cls, "decision": verdict.decision, "why": verdict.why,
                "signature": signature(record)})
    if verdict.fix:
        out["fix"] = verdict.fix
    guard = no_progress(previous)
    if verdict.decision == RESTART and guard is not None:
        out.update(decision=STOP, why=f"no progress: the last two restarts both resumed from checkpoint iteration "
                                      f"{guard} ({verdict.why})")
    return out


def stop(run: RunFolder, manifest: dict, entry: dict) -> None:
    """Record a refused restart in the manifest's ``restarts`` and say why in one line of the batch log."""
    run.update(restarts=[*manifest.get("restarts", []), entry])
    line = f"no restart: {entry['class']}: {entry['why']}" if not entry["why"].startswith("no progress") else \
        f"no restart: {entry['why']}"
    _say(line + (f"; {entry['fix']}" if entry.get("fix") else ""))


def _set_aside_hang(run: RunFolder, n: int) -> None:
    marker = run.path / HANG_MARKER
    if marker.is_file():
        (run.path / "hang").mkdir(exist_ok=True)
        os.replace(marker, run.path / "hang" / f"HANG-restart{n - 1}.txt")


def requeue_job(job_id: str | None) -> bool:
    if not job_id:
        return False
    out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=30)
    return out.returncode == 0


def _say(line: str, restart: bool = False) -> None:
    print((RESTART_LINE if restart else "hpc_tools: ") + line, file=sys.stderr, flush=True)


def rank_steps(job_id: str) -> list[str]:
    """The job's running rank steps (``JOB.N``; not its batch or extern step)."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], capture_output=True, text=True, timeout=30)
    return [s for s in out.stdout.split() if s.split(".")[-1].isdigit()] if out.returncode == 0 else []


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
                (cancel or (lambda s: subprocess.run(["scancel", s], capture_output=True, timeout=30)))(step)
            if steps:
                line = (f"the rank step did not end {grace_s:.0f} s after rank {failed[0]} failed (a lost node's "
                        f"tasks never report their end): step {', '.join(steps)} cancelled")
                _say(line)
                return line
            return None
        time.sleep(poll_s)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_tools.job.restarts", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("begin", help="exports of this life's first rank step")
    b.add_argument("--run-dir", required=True, type=Path)
    n = sub.add_parser("next", help="after a failed rank step: exports of a new step (exit 0) or none (exit 1)")
    n.add_argument("--run-dir", required=True, type=Path)
    n.add_argument("--exit-code", required=True, type=int)
    for p in (b, n):  # the recipe's cluster facts, given by the batch script (else read from the run's recipe)
        p.add_argument("--nodes", type=int, default=None, help="cluster.nodes")
        p.add_argument("--budget", type=int, default=None, help="cluster.restarts")
        p.add_argument("--requeue", action=argparse.BooleanOptionalAction, default=None, help="cluster.requeue")
        p.add_argument("--min-nodes", type=int, default=None, help="cluster.min_nodes (elastic)")
        p.add_argument("--ranks-per-node", type=int, default=1, help="cluster.gpus_per_node (elastic)")
    w = sub.add_parser("watch", help="beside a rank step: cancel it when it outlives a failed rank (a lost node)")
    w.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    env = dict(os.environ)
    given = [getattr(args, k, None) for k in ("nodes", "budget", "requeue")]
    policy = Policy(*given, min_nodes=getattr(args, "min_nodes", None),
                    ranks_per_node=getattr(args, "ranks_per_node", 1)) if None not in given else None
    try:
        if args.what == "begin":
            print(begin(args.run_dir, env, policy))
            return 0
        if args.what == "watch":
            watch(args.run_dir, env)
            return 0
        line = next_step(args.run_dir, args.exit_code, env, policy=policy)
    except Exception as exc:  # the batch script must reach its epilogue whatever happens here
        print(f"hpc_tools restarts: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if line is None:
        return 1
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def local_restart(run: RunFolder, exit_codes: dict[int, int], start: int) -> int | None:
    """The local executor's in-job restart: after start ``start`` of the ranks failed (rank -> return code of the
    first failing ranks), the number of the next start, recorded in the manifest's ``restarts`` (None: no restart,
    the budget ``cluster.restarts`` is spent, or the ranks completed or were stopped)."""
    from datetime import datetime, timezone

    from hpc_tools.job.epilogue import failures_from_exit_codes

    at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    manifest = run.manifest()
    budget = _recipe(run).cluster.restarts
    done = [r for r in manifest.get("restarts", []) if r.get("kind", "in-job") == "in-job"]
    if not budget or manifest.get("state") in ("COMPLETED", "REQUEUED", "PREEMPTED", "CANCELLED") or \
            manifest.get("cancel_requested") or len(done) >= budget:
        return None
    code = next(iter(exit_codes.values()), 1)
    found = culprit(run, 128 - code if code < 0 else code, start, failures_from_exit_codes(exit_codes))
    verdict = judge(run, found, start, manifest)
    if verdict["decision"] == STOP:
        stop(run, manifest, {"at": at, **found, "job_id": None, "restart": None, "kind": "stop", "nodes": None,
                             "from_iteration": None, "time_to_first_step_s": None, **verdict})
        return None
    seen = [int(e.get("restart_count") or 0) for e in manifest.get("events", []) if e.get("event") == "started"]
    n = max([start, *seen]) + 1
    entry = {"at": at, **found, "job_id": None, "restart": n, "kind": "in-job", "nodes": None, "from_iteration": None,
             "time_to_first_step_s": None, **verdict}
    _set_aside_hang(run, n)
    run.update(event="restarting", state="STARTING", restart_count=n, restarts=[*manifest.get("restarts", []), entry],
               reason=None, failed_ranks=None, failed_nodes=None, exit_code=None, error=None)
    _say(f"{len(done) + 1} of {budget} in this run ({found['cause']}: {found['reason']}); the ranks start again "
         "from the newest complete checkpoint", restart=True)
    return n
