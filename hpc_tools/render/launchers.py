"""The launcher table: what each ``cluster.launcher`` adds to the batch shell and to the rank line.

One small frozen dataclass per launcher (``Srun``, ``Ray``) in ``LAUNCHERS``, looked up by the recipe's
``cluster.launcher`` (``of``); ``tests/unit/test_launchers.py`` checks the table holds every value the schema's
``Literal`` allows. Each row reads its launcher's facts from ``hpc_tools.recipe.launchers`` (their one owner, below
this package: the recipe's rules ask it too). Callers ask the row instead of comparing names: ``slurm_params``
whether Slurm signals the ranks before the time limit (``time_limit_stop``), the Slurm and local executors whether
one process drives every rank (``driver``: then the rendered script is submitted, since submitit starts one task per
rank), ``doctor`` the packages a launcher needs (``packages``), ``status`` whether the run started a cluster of its
own (``driver``).

The rendered script (``templates/job.sbatch.j2``) holds one rank-step loop, which a row fills (``steps`` ->
``RankSteps``): the batch shell's lines before the loop (rendezvous, Ray's nodes), each step's lines around its rank
line (placement, the stuck-step watcher), what follows a failed step (the restart controller's new step, or ``break``:
a budget of 0), and the lines after the loop. Plain srun is the restart loop with a budget of 0; Ray's budget is
always 0 there, since Ray Train restarts its own workers (``FailureConfig(max_failures=cluster.restarts)``).

Standard library only at import (the local executor, ``status`` and ``doctor`` read the table); the recipe and its
layout come in as arguments.
"""

from __future__ import annotations

import shlex
import textwrap
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.launchers import LauncherFacts
from hpc_tools.recipe.launchers import of as launcher_facts
from hpc_tools.render.envsetup import (
    host_python,
    is_pyxis,
    rank_argv,
    rank_srun_args,
    restart_policy_args,
    script_python,
    step_count_args,
    step_node_args,
)

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

STOP_SIGNAL = "USR2"  # the time-limit stop's signal; submitit's choice too; NCCL claims USR1

STEP_NODELIST = '${HPC_TOOLS_NODELIST:+"--nodelist=$HPC_TOOLS_NODELIST"}'
# The rank step's srun with the placement's hostfile in its environment only: srun takes SLURM_HOSTFILE as its node
# list whenever it is set, so an exported one would lay out the script's other steps (epilogue, clean-up) too.
PLACED_SRUN = 'env ${HPC_TOOLS_HOSTFILE:+"SLURM_HOSTFILE=$HPC_TOOLS_HOSTFILE"} srun'


@dataclass(frozen=True, slots=True)
class RankSteps:
    """A launcher's part of the rendered script's one rank-step loop (shell lines; ``rank``: the rank line, whose
    exit status the loop keeps in ``SRUN_EXIT``)."""

    comment: list[str]  # what the launcher does, as shell comments before ``begin``
    begin: list[str]  # the batch shell before the loop: the first step's rendezvous, Ray's nodes
    before: list[str]  # each step, before its rank line: placement, the stuck-step watcher
    rank: str
    after: list[str]  # each step, after its rank line
    next: list[str]  # after a failed step: a new step's exports, or ``break`` (a budget of 0)
    end: list[str] = field(default_factory=list)  # the batch shell after the loop


@dataclass(frozen=True, slots=True)
class Launcher:
    """What one launcher writes into the batch script (``steps``), with its facts (``hpc_tools.recipe.launchers``:
    ``name``, ``time_limit_stop``, ``driver``, ``packages``), for every caller that would otherwise compare its
    name."""

    facts: ClassVar[LauncherFacts]

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def time_limit_stop(self) -> bool:  # Slurm signals the ranks cluster.signal_delay_s before the limit
        return self.facts.time_limit_stop

    @property
    def driver(self) -> str | None:  # module whose ``drive`` runs every rank from one process; None: a task per rank
        return self.facts.driver

    @property
    def packages(self) -> tuple[tuple[str, str], ...]:  # (distribution, pip requirement) beyond every job's
        return self.facts.packages

    def steps(self, recipe: Recipe) -> RankSteps:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Srun(Launcher):
    """``cluster.launcher: srun``: one task per GPU, each the rank program; ``cluster.restarts`` is the loop's budget
    of in-job restarts (``hpc_tools.job.restarts``), and ``cluster.place_by_topology`` orders each step's ranks."""

    facts: ClassVar[LauncherFacts] = launcher_facts("srun")

    def steps(self, recipe: Recipe) -> RankSteps:
        c = recipe.cluster
        controller = host_python(c) or script_python(c)
        placed, policy = c.place_by_topology, restart_policy_args(c)
        before = ["# Rank order by topology for this step's nodes (PLACEMENT above).", *placement_lines(recipe)] \
            if placed else []
        before += [f'{controller} -m hpc_tools.job.restarts watch --run-dir "$RUN_DIR" &', "HPC_TOOLS_WATCH=$!"]
        rank = f'{PLACED_SRUN if placed else "srun"} {self.rank_words(recipe)} -m hpc_tools.runtime.rank ' \
               '--run-dir "$RUN_DIR"'
        comment = srun_comment(recipe) + (PLACEMENT_COMMENT if placed else [])
        if not c.restarts:  # a budget of 0: the controller's answer after a failed step is always no, so none is asked
            return RankSteps(comment, ['RENDEZVOUS="$(' + script_python(c) + ' -m hpc_tools.runtime.distenv)"',
                                       'eval "$RENDEZVOUS"'], before, rank, AFTER, ["break"])
        begin = [f'HPC_TOOLS_STEP="$({controller} -m hpc_tools.job.restarts begin --run-dir "$RUN_DIR" {policy})" '
                 '|| HPC_TOOLS_STEP=""', 'eval "$HPC_TOOLS_STEP"']
        after_failure = [f'HPC_TOOLS_STEP="$({controller} -m hpc_tools.job.restarts next --run-dir "$RUN_DIR" '
                         f'--exit-code "$SRUN_EXIT" \\\n        {policy})" \\\n        || break',
                         'eval "$HPC_TOOLS_STEP"']
        return RankSteps(comment, begin, before, rank, AFTER, after_failure)

    @staticmethod
    def rank_words(recipe: Recipe) -> str:
        """srun's options of the rank step and the rank's interpreter (shell text): the CPUs and memory, with a
        budget of restarts the controller's nodes (``--overlap``: a step Slurm still counts on a lost node) and an
        elastic job's counts, the placement's options, ``--label`` (every line of the one batch log starts with its
        rank, which ``logs --rank`` filters on), the pyxis container."""
        c = recipe.cluster
        placed = c.place_by_topology
        words = shlex.join(rank_srun_args(c, step_nodes=not placed))
        if c.restarts:  # each step's nodes, decided by hpc_tools.job.restarts
            words += " --overlap" + ("" if placed else " " + STEP_NODELIST) + step_count_args(c)
        if placed:  # the step's nodes and order, decided by hpc_tools.job.placement
            words += ' "${HPC_TOOLS_PLACE[@]}"'
        words += " --label"
        if is_pyxis(c):
            words += ' "${HPC_TOOLS_CONTAINER[@]}"'
        return words + " " + shlex.join(rank_argv(c))


AFTER = ['kill "$HPC_TOOLS_WATCH" 2>/dev/null || true']


def comment(text: str) -> list[str]:
    """``text`` as shell comment lines of at most 120 characters, each of its own lines (``\\n``) starting one."""
    return [line for part in text.split("\n") for line in textwrap.wrap(
        part, 118, initial_indent="# ", subsequent_indent="# ", break_long_words=False, break_on_hyphens=False)]


def srun_comment(recipe: Recipe) -> list[str]:
    c = recipe.cluster
    text = ("SRUN (cluster.launcher: srun): one task per GPU; each runs the same rank program, with the CPUs sbatch "
            "gave it (srun does not inherit them) and its output lines labelled with its rank in this log (`python "
            f"-m hpc_tools logs --rank N` picks one). Slurm signals every task {c.signal_delay_s} s before the time "
            f"limit ({STOP_SIGNAL}): the ranks checkpoint, the job's last step requeues it, and it resumes from that "
            "checkpoint. Beside each step a watcher cancels it when it outlives a failed rank (srun waits forever for "
            "the tasks of a crashed node).")
    if not c.restarts:
        return comment(text + " No in-job restarts (cluster.restarts: 0, the loop's budget): one step on the "
                       "allocation, its rendezvous decided by hpc_tools.runtime.distenv (the allocation's first node, "
                       "a port derived from the job id); a failed step ends the loop, and the requeue step then "
                       "requeues a job that lost a node.")
    return comment(text + f" In-job restarts (cluster.restarts={c.restarts}, the loop's budget): hpc_tools.job."
                   "restarts decides each step's nodes and rendezvous (the step's first node, a port derived from the "
                   "job id and the start's number). When a step fails (a rank died or hung, a node crashed) it "
                   "records why and prints the exports of a new step in this same job (a failed node left out when a "
                   "spare can take its place), which resumes from the newest complete checkpoint; with the budget "
                   "spent, or too few nodes left (the job is then requeued), the loop ends. Steps overlap (--overlap) "
                   "a step Slurm still counts as running on a lost node.")


PLACEMENT_COMMENT = comment(
    "PLACEMENT (cluster.place_by_topology), before each rank step: hpc_tools.job.placement reads `scontrol show "
    "topology` (tree or block plugin) and, when it lists every node of the step, writes \"$RUN_DIR/hostfile\" with "
    "the nodes leaf switch by leaf switch, one line per rank, and sets srun's arbitrary distribution (rank i on line "
    "i of SLURM_HOSTFILE, given to the rank step only: any srun that sees it lays its tasks out by it) and "
    "MASTER_ADDR (rank 0's node): Megatron's consecutive TP ranks, then its CP and EP groups, share a node, then a "
    "leaf switch. It says so in this log, and names a group this allocation splits across switches. Otherwise the "
    "step keeps Slurm's order (HPC_TOOLS_PLACE: the step's own node options) and the line says why.")


def placement_lines(recipe: Recipe) -> list[str]:
    """The batch shell's placement step before a rank step (``cluster.place_by_topology``): the step's own node
    options as the default ``HPC_TOOLS_PLACE``, then ``hpc_tools.job.placement``'s lines (a hostfile in topology
    order as ``HPC_TOOLS_HOSTFILE``, srun's arbitrary distribution and the rendezvous on rank 0's node) when the
    topology lists every node."""
    c, lay = recipe.cluster, ParallelLayout.from_recipe(recipe)
    default = ([STEP_NODELIST] if c.restarts else []) + [shlex.quote(a) for a in step_node_args(c)]
    sizes = (f"tensor={lay.tensor_size},context={lay.context_size},expert={lay.expert_size},"
             f"expert_tensor={lay.expert_tensor_size},pipeline={lay.pipeline_size},data={lay.data_size}")
    controller = host_python(c) or script_python(c)
    nodes = ' ${HPC_TOOLS_NODELIST:+--nodes "$HPC_TOOLS_NODELIST"}' if c.restarts else ""
    return ["unset HPC_TOOLS_HOSTFILE",
            f"HPC_TOOLS_PLACE=({' '.join(default)})",
            f'HPC_TOOLS_PLACED="$({controller} -m hpc_tools.job.placement --run-dir "$RUN_DIR" --ranks-per-node '
            f'{lay.ranks_per_node} --sizes {sizes}{nodes})" || HPC_TOOLS_PLACED=""',
            'eval "$HPC_TOOLS_PLACED"']


@dataclass(frozen=True, slots=True)
class Ray(Launcher):
    """``cluster.launcher: ray`` (docs/ray.md): a Ray node per node of the allocation and Ray Train's driver on the
    batch host, whose workers run the rank program; no stop signal before the time limit (it would end Ray's own
    processes before any worker checkpoints)."""

    facts: ClassVar[LauncherFacts] = launcher_facts("ray")

    def steps(self, recipe: Recipe) -> RankSteps:
        c, python = recipe.cluster, script_python(recipe.cluster)
        node_step, node_args = self.node_step(recipe)
        begin = [f'HPC_TOOLS_RAY="$({python} -m {self.driver} exports --run-dir "$RUN_DIR")"',
                 'eval "$HPC_TOOLS_RAY"',
                 f'srun {node_step} {python} -m {self.driver} node --run-dir "$RUN_DIR" {node_args} &',
                 "HPC_TOOLS_RAY_NODES=$!"]
        rank = (f'{python} -m {self.driver} drive --run-dir "$RUN_DIR" --address '
                f'"$HPC_TOOLS_RAY_HEAD:$HPC_TOOLS_RAY_PORT" \\\n        --nodes {c.nodes}')
        end = ['touch "$RUN_DIR/ray/stop"  # each node stops Ray and copies its logs; the step is ended after a minute '
               'at most',
               'for _ in $(seq 60); do kill -0 "$HPC_TOOLS_RAY_NODES" 2>/dev/null || break; sleep 1; done',
               'kill -TERM "$HPC_TOOLS_RAY_NODES" 2>/dev/null || true',
               'wait "$HPC_TOOLS_RAY_NODES" || true']
        return RankSteps(ray_comment(recipe), begin, [], rank, [], ["break"], end)

    @staticmethod
    def node_step(recipe: Recipe) -> tuple[str, str]:
        """(srun's options of the step that runs one Ray node per node of the allocation, ``ray_launch node``'s own:
        every CPU and GPU of the node's ranks)."""
        c = recipe.cluster
        cpus = c.gpus_per_node * c.cpus_per_task
        # --ntasks too: the step would otherwise take the allocation's task count (a rank per GPU) over
        # --ntasks-per-node
        step = ["--overlap", f"--nodes={c.nodes}", f"--ntasks={c.nodes}", "--ntasks-per-node=1",
                f"--cpus-per-task={cpus}", "--mem=0"]
        if c.elastic:  # a failed node must not end the other nodes' Ray: Ray Train continues on them (num_workers)
            step.append("--no-kill")
        node = ["--num-cpus", str(cpus), "--num-gpus", str(c.gpus_per_node if c.uses_gpus else 0)]
        return shlex.join(step), shlex.join(node)


def ray_comment(recipe: Recipe) -> list[str]:
    return comment(
        "RAY (cluster.launcher: ray; docs/ray.md): Ray Train starts the ranks. hpc_tools.job.ray_launch derives the "
        "head's address and ports from the job id and writes a token of the job's own for Ray's authentication "
        "(\"$RUN_DIR/ray/auth_token\", owner-only); one task per node runs `ray start --block` (the head on the first "
        "node, this batch host) with a short temporary folder of its own (Ray's socket paths must stay under ~107 "
        "characters) and copies its Ray logs into \"$RUN_DIR/ray/<node>/\" when the step ends. The driver is the "
        "loop's one step, here: it waits for every node, writes the dashboard's address into the manifest and runs "
        "Ray Train's TorchTrainer, whose per-worker loop is the rank program (python -m hpc_tools.runtime.rank, "
        "output in \"$RUN_DIR/logs/rank<R>.out\"). Ray Train restarts a failed worker group (FailureConfig("
        f"max_failures=cluster.restarts={recipe.cluster.restarts})), which resumes from the newest verified "
        "checkpoint: the loop's own budget is 0. Then the Ray nodes are stopped (\"$RUN_DIR/ray/stop\").\nNo stop "
        "signal is asked before the time limit (it would end Ray's own processes before any worker checkpoints): at "
        "the limit the run ends, and `hpc_tools resume` continues it from its newest periodic checkpoint.")


LAUNCHERS: dict[str, Launcher] = {row.name: row for row in (Srun(), Ray())}


def of(name: str) -> Launcher:
    """The row of ``cluster.launcher`` ``name`` (the schema allows no other; a KeyError names a missing row)."""
    return LAUNCHERS[name]
