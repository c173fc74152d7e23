"""What a backend's trainer receives on every rank."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_tools import backends
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.schema import Recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runtime.distenv import DistEnv
from hpc_tools.runtime.hang_bounds import DEFAULT_CAP_MIN
from hpc_tools.runtime.preemption import TIME_LIMIT, StopFlag, request_requeue, requeue_reason
from hpc_tools.runtime.watchdog import Watchdog

if TYPE_CHECKING:
    import torch

log = logging.getLogger("hpc_tools")
WATCHDOG_MARGIN_S = 300


def _read_flag(work, host, event) -> float:
    """The stop flag an ``agree_stop`` all-reduce left: wait for it (CPU: the gloo work; GPU: the copy's event)."""
    if work is not None:
        work.wait()
    if event is not None:
        event.synchronize()
    return float(host[0])


def cuda_unusable(gpu_type: str) -> str:
    """One line: why torch sees no usable GPU although the recipe asks for ``gpu_type`` GPUs."""
    import torch

    build = torch.version.cuda
    if build is None:
        why = f"torch {torch.__version__} is a CPU-only build (install the CUDA wheel)"
    else:
        why = (f"torch {torch.__version__} is built for CUDA {build} but finds no usable GPU (a driver older than "
               f"CUDA {build} needs, no GPU allocated to this task, or CUDA_VISIBLE_DEVICES empty; check nvidia-smi)")
    return (f"cluster.gpu_type={gpu_type} asks for GPUs but torch.cuda.is_available() is False on this node: {why}; "
            "set cluster.gpu_type: cpu to train on CPU")


@dataclass
class RankContext:
    """Everything a trainer needs: the resolved recipe, the layout, this rank's place and device, and the run folder.

    The duties it serves (``heartbeat(step)`` after every step, ``agree_stop()`` at every step boundary, then a
    checkpoint and ``finish_preempted(step)``) are kept in one place for every backend: the loop of
    ``hpc_tools.train.loop``.
    """

    recipe: Recipe
    layout: ParallelLayout
    dist: DistEnv
    run: RunFolder
    stop: StopFlag = field(default_factory=StopFlag)
    watchdog: Watchdog | None = None
    full_nodes: int = 0  # cluster.nodes of the run's own recipe (an elastic step on fewer nodes has fewer in recipe)
    _stop_pending: tuple | None = field(default=None, init=False, repr=False)  # agree_stop's all-reduce in flight

    @property
    def rank(self) -> int:
        return self.dist.rank

    def note_layout(self, from_iteration: int) -> None:
        """Rank 0: the manifest's ``layouts`` get this start's layout when it differs from the last one recorded (an
        elastic run on fewer nodes, or regrown; ``hpc_tools.runtime.elastic``)."""
        if self.is_rank0:
            from hpc_tools.runtime import elastic

            full = self.full_nodes or self.recipe.cluster.nodes
            elastic.note(self.run, self.recipe, self.layout, from_iteration, full)

    @property
    def is_rank0(self) -> bool:
        return self.dist.rank == 0

    @property
    def run_dir(self) -> Path:
        return self.run.path

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.recipe.checkpoint.dir) if self.recipe.checkpoint.dir else self.run.checkpoints_dir

    @cached_property
    def device(self) -> "torch.device":
        """This rank's device, decided once: ``cpu`` when the recipe's ``cluster.gpu_type`` is ``cpu`` (the local
        profiles say so explicitly), else ``cuda:<local rank % visible GPUs>``: one rank per GPU of the node, or one
        visible GPU per rank where the site binds them (``--gpus-per-task``: every rank sees its own as device 0).

        A recipe that asks for GPUs on a node where CUDA is unusable fails here with the reason (``cuda_unusable``)
        instead of training on CPU over gloo. Before the first CUDA call it also sets what the backend's layout relies
        on (the backend table's ``rank_setup``: ``CUDA_DEVICE_MAX_CONNECTIONS`` for Megatron's communication
        overlap)."""
        import torch

        if not self.recipe.cluster.uses_gpus:
            return torch.device("cpu")
        if not torch.cuda.is_available():
            from hpc_tools.errors import UserError

            raise UserError(cuda_unusable(self.recipe.cluster.gpu_type))
        setup = backends.of(self.recipe).rank_setup
        for key, value in (backends.load(setup)(self.recipe, self.layout) if setup else {}).items():
            os.environ.setdefault(key, value)
        return torch.device("cuda", self.dist.local_rank % torch.cuda.device_count())

    @property
    def device_type(self) -> str:
        """``cuda`` or ``cpu``: the type of ``device``."""
        return self.device.type

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def stop_requested(self) -> bool:
        """This rank received a stop signal (trainers must agree across ranks before acting)."""
        return self.stop.requested

    def agree_stop(self, final: bool = False) -> bool:
        """Collective, called by every rank at every step boundary: True on every rank, at the same step, when any
        rank received a stop signal (an all-reduce MAX of the flag, on this rank's device: nccl reduces only CUDA
        tensors). Then every rank marks itself stopped, so rank 0 records the run as preempted even if it was not
        signalled.

        Off the step's critical path: the all-reduce of step s's flag is started at step s and read at step s+1
        (done by then: no wait, and on GPU the flag comes back through a pinned copy and a CUDA event, not a
        device-wide sync), so a stop acts one step after the signal, on every rank alike. ``final`` (the last
        step) reads at once, leaving nothing in flight when the process group ends.
        """
        import torch
        import torch.distributed as dist

        pending, self._stop_pending = self._stop_pending, None
        if pending is not None and _read_flag(*pending) > 0:
            self.stop.requested = True
            return True
        flag = torch.tensor([1.0 if self.stop.requested else 0.0], device=self.device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)
        host, event = flag, None
        if flag.is_cuda:
            host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
            work.wait()  # orders the copy after the all-reduce on the current stream; the host does not block
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            work = None
        if final:
            if _read_flag(work, host, event) > 0:
                self.stop.requested = True
                return True
            return False
        self._stop_pending = (work, host, event)
        return False

    def heartbeat(self, step: int) -> None:
        """Step ``step`` completed: the hang watchdog's clock restarts and the rank's heartbeat shows the step."""
        if self.watchdog is not None:
            first = self.watchdog.started_step is None
            self.watchdog.beat(step)
            if first and self.is_rank0 and self.dist.restart_count and self.recipe.cluster.restarts:
                from hpc_tools.runtime.recovery import first_step

                first_step(self.run, self.dist.restart_count, step)  # the restart's record: from, time to this step

    @property
    def collective_timeout(self) -> "timedelta | None":
        """The process group's timeout: longer than the hang watchdog's (its cap when calibrated, by
        ``WATCHDOG_MARGIN_S``), so that the watchdog, which names the culprit, fires before NCCL's or gloo's own
        abort; None (torch's default) without a watchdog."""
        minutes = self.recipe.cluster.hang_timeout_min
        if minutes is None:  # calibrated: every phase's bound is at most the cap
            minutes = DEFAULT_CAP_MIN
        return timedelta(seconds=minutes * 60 + WATCHDOG_MARGIN_S) if minutes > 0 else None

    def info(self, msg: str, *args) -> None:
        """Log on rank 0 only."""
        if self.is_rank0:
            log.info(msg, *args)

    def finish_preempted(self, step: int) -> None:
        """After the agreed stop (and the checkpoint of ``step``, for a backend that keeps them): rank 0 records the
        event and asks the batch shell to requeue the job (``hpc_tools.job.requeue``, on the batch host: a rank in a
        container image has no ``scontrol``)."""
        if not self.is_rank0:
            return
        # The user's cancel stops the run; the time limit and any other termination of the step requeue it
        # (runtime.preemption.requeue_reason). A termination is told REQUEUED only by the batch shell's requeue.
        why = requeue_reason(self.stop.signum, self.run.manifest())
        requeued = why is not None and self.recipe.cluster.requeue and request_requeue(self.run.path, why=why)
        state = "REQUEUED" if requeued and why == TIME_LIMIT else "PREEMPTED"
        self.run.update(event="preempted", state=state, last_step=step)
        log.warning("stopped after step %d; %s", step, "the batch shell requeues the job, which resumes from its "
                    "checkpoint" if requeued else "not requeued (" + (
                        "not under Slurm or requeue off" if why else "cancelled by the user") + ")")
