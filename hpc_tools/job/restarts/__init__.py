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

The package, along those seams: ``facts`` (the cluster facts as ``Policy``, the waits, each start's number and
port, what is left of the budget), ``evidence`` (the culprit and the class of the failure: steps 2 and 3),
``nodes`` (the allocation, the probe step, the choice of nodes, what could replace a named node: step 4),
``decision`` (``begin``, ``next_step``, ``local_restart``), ``named_nodes`` (the step after preflight named
nodes: ``leave_out_step``), ``action`` (the record, the batch log's line, the exports, the requeue: steps 5 and 6),
``stuck`` (the stuck-step watcher, ``watch``) and ``cli`` (the batch script's calls).
"""

from hpc_tools.job.restarts.action import (
    exclude_from_job,
    exports,
    record_restart,
    requeue_job,
    say,
    set_aside_hang,
    sigterm_ignored,
    step_exports,
    stop,
)
from hpc_tools.job.restarts.cli import main
from hpc_tools.job.restarts.decision import begin, local_restart, new_step_nodes, next_step, no_room, restart_on
from hpc_tools.job.restarts.evidence import culprit, judge, kernel_oom
from hpc_tools.job.restarts.facts import (
    ELASTIC_WAIT_ENV,
    ELASTIC_WAIT_S,
    ENDED,
    PROBE_TIMEOUT_S,
    PROBE_WAIT_S,
    RESTART_LINE,
    STUCK_STEP_ENV,
    STUCK_STEP_S,
    Policy,
    elastic_counts,
    in_job_restarts,
    life_number,
    next_start,
    preflight_excluded,
    preflight_requeues,
    recipe_of,
    restarts_left,
    seconds_from,
    step_counts,
    step_port,
)
from hpc_tools.job.restarts.named_nodes import leave_out_step, named_words
from hpc_tools.job.restarts.nodes import (
    allocation_nodes,
    choose_nodes,
    hostnames,
    partition_nodes,
    preflight_hints,
    probe,
    requeue_room,
)
from hpc_tools.job.restarts.stuck import rank_steps, watch

__all__ = ["ELASTIC_WAIT_ENV", "ELASTIC_WAIT_S", "ENDED", "PROBE_TIMEOUT_S", "PROBE_WAIT_S", "RESTART_LINE",
           "STUCK_STEP_ENV", "STUCK_STEP_S", "Policy", "allocation_nodes", "begin", "choose_nodes", "culprit",
           "elastic_counts", "exclude_from_job", "exports", "hostnames", "in_job_restarts", "judge", "kernel_oom",
           "leave_out_step", "life_number", "local_restart", "main", "named_words", "new_step_nodes", "next_start",
           "next_step", "no_room", "partition_nodes", "preflight_excluded", "preflight_hints", "preflight_requeues",
           "probe", "rank_steps", "recipe_of", "record_restart", "requeue_job", "requeue_room", "restart_on",
           "restarts_left", "say", "seconds_from", "set_aside_hang", "sigterm_ignored", "step_counts",
           "step_exports", "step_port", "stop", "watch"]
