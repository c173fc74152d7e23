"""The facts a restart decision reads: the recipe's cluster section as ``Policy`` (given as options by the batch
script, else read from the run's recipe), the waits and their environment overrides, each start's number and
rendezvous port, and what the manifest's ``restarts`` says is left of the budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpc_tools.registry import RunFolder
from hpc_tools.runtime import elastic
from hpc_tools.runtime.distenv import PORT_BASE, PORT_SPAN, RESTART_BASE_ENV, restart_count

PROBE_WAIT_S = 180.0  # how long a restart waits for a node's slurmd to answer (a crashed node coming back)
# An elastic job (cluster.min_nodes) waits this long for a lost node to answer before it goes on with fewer nodes.
ELASTIC_WAIT_S = 30.0
PROBE_TIMEOUT_S = 20.0  # one probe step
STUCK_STEP_S = 20.0  # a rank exited with an error this long ago and the step still runs: cancel it (``watch``)
RESTART_LINE = "hpc_tools: restart "  # begins a new step's part of the batch log (the epilogue reads from there)
# A site sets these two in the job's environment (cluster.setup.env) where its nodes come back sooner or later, or
# its lost nodes' tasks are known gone at once; the test cluster's elastic test shortens both.
ELASTIC_WAIT_ENV, STUCK_STEP_ENV = "HPC_TOOLS_ELASTIC_WAIT_S", "HPC_TOOLS_STUCK_STEP_S"
ENDED = ("COMPLETED", "REQUEUED", "PREEMPTED", "CANCELLED")  # manifest states after which nothing is restarted


def seconds_from(env: dict[str, str], name: str, default: float) -> float:
    """``env[name]`` as seconds >= 0, else ``default`` (unset, or not a number: the batch script must go on)."""
    try:
        value = float(env.get(name, ""))
    except ValueError:
        return default
    return value if value >= 0 else default


def recipe_of(run: RunFolder):
    from hpc_tools.recipe.load import load_resolved

    return load_resolved(run.recipe_path)


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
        cluster = recipe_of(run).cluster
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


def preflight_requeues(manifest: dict) -> list[dict]:
    return [e for e in manifest.get("restarts", []) if e.get("cause") == "preflight" and e.get("kind") == "requeue"]


def preflight_excluded(manifest: dict) -> list[str]:
    """The nodes earlier lives' preflight requeued the job without."""
    return list(dict.fromkeys(x for e in preflight_requeues(manifest) for x in e.get("nodes_named") or []))


def restarts_left(manifest: dict, policy: Policy) -> int:
    """What is left of ``cluster.restarts``: in-job restarts and the requeues that left a preflight-named node out
    both spend it (a requeue after a lost node does not: ``cluster.requeue`` governs that one)."""
    return policy.budget - len(in_job_restarts(manifest)) - len(preflight_requeues(manifest))


def in_job_restarts(manifest: dict) -> list[dict]:
    """The manifest's in-job restarts (what ``cluster.restarts`` counts)."""
    return [r for r in manifest.get("restarts", []) if r.get("kind", "in-job") == "in-job"]


def next_start(manifest: dict, start: int) -> int:
    """The next start's number: above ``start`` and every start the run has had."""
    seen = [int(e.get("restart_count") or 0) for e in manifest.get("events", []) if e.get("event") == "started"]
    return max([start, *seen]) + 1
