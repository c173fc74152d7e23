"""What a backend's trainer receives on every rank."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.schema import Recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runtime.distenv import DistEnv
from hpc_tools.runtime.preemption import StopFlag, requeue_self
from hpc_tools.runtime.watchdog import Watchdog

if TYPE_CHECKING:
    import torch

log = logging.getLogger("hpc_tools")
WATCHDOG_MARGIN_S = 300


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

    @property
    def rank(self) -> int:
        return self.dist.rank

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
        """This rank's device, decided once: ``cuda:<local rank>`` when the recipe asks for GPUs and torch sees one
        (the launcher starts one rank per GPU of the node), otherwise ``cpu``."""
        import torch

        if self.recipe.cluster.uses_gpus and torch.cuda.is_available():
            return torch.device("cuda", self.dist.local_rank)
        return torch.device("cpu")

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

    def agree_stop(self) -> bool:
        """Collective: True on every rank when any rank received a stop signal (all-reduce MAX of the flag, on this
        rank's device: nccl reduces only CUDA tensors).

        Then every rank marks itself stopped, so rank 0 records the run as preempted even if it was not signalled.
        """
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.stop.requested else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            self.stop.requested = True
            return True
        return False

    def heartbeat(self, step: int) -> None:
        """Step ``step`` completed: the hang watchdog's clock restarts and the rank's heartbeat shows the step."""
        if self.watchdog is not None:
            self.watchdog.beat(step)

    @property
    def collective_timeout(self) -> "timedelta | None":
        """The process group's timeout: longer than the hang watchdog's (by ``WATCHDOG_MARGIN_S``), so that the
        watchdog, which names the culprit, fires before NCCL's or gloo's own abort; None (torch's default) without a
        watchdog."""
        minutes = self.recipe.cluster.hang_timeout_min
        return timedelta(seconds=minutes * 60 + WATCHDOG_MARGIN_S) if minutes > 0 else None

    def info(self, msg: str, *args) -> None:
        """Log on rank 0 only."""
        if self.is_rank0:
            log.info(msg, *args)

    def finish_preempted(self, step: int) -> None:
        """After the agreed stop (and the checkpoint of ``step``, for a backend that keeps them): rank 0 records the
        event and asks Slurm to requeue the job."""
        if not self.is_rank0:
            return
        # Only the time-limit signal requeues: SIGTERM comes from scancel (the user wants it stopped) or from Slurm's
        # own preemption, which requeues by itself when the partition says so.
        requeued = self.stop.signum == signal.SIGUSR2 and self.recipe.cluster.requeue and requeue_self()
        self.run.update(event="preempted", state="REQUEUED" if requeued else "PREEMPTED", last_step=step)
        log.warning("stopped after step %d; %s", step, "job requeued, it will resume from its checkpoint" if requeued
                    else "not requeued (not under Slurm or requeue off)")
