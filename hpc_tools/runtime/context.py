"""What a backend's trainer receives on every rank."""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.schema import Recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runtime.distenv import DistEnv
from hpc_tools.runtime.preemption import StopFlag, requeue_self
from hpc_tools.runtime.watchdog import Watchdog

log = logging.getLogger("hpc_tools")


@dataclass
class RankContext:
    """Everything a trainer needs: the resolved recipe, the layout, this rank's place, and the run folder.

    Trainers must: call ``heartbeat(step)`` after every step (hang watchdog); check ``stop_requested`` at step
    boundaries (agreeing across ranks, e.g. an all-reduce MAX of the flag), then save a checkpoint and call
    ``finish_preempted()``; write per-step records through ``profiling``.
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

    @property
    def device_type(self) -> str:
        """`cuda` when the recipe asks for GPUs and torch sees one; otherwise `cpu`."""
        import torch

        return "cuda" if self.recipe.cluster.uses_gpus and torch.cuda.is_available() else "cpu"

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    @property
    def stop_requested(self) -> bool:
        """This rank received a stop signal (trainers must agree across ranks before acting)."""
        return self.stop.requested

    def agree_stop(self, device=None) -> bool:
        """Collective: True on every rank when any rank received a stop signal (all-reduce MAX of the flag).

        Then every rank marks itself stopped, so rank 0 records the run as preempted even if it was not signalled.
        """
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1.0 if self.stop.requested else 0.0], device=device or "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            self.stop.requested = True
            return True
        return False

    def heartbeat(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def info(self, msg: str, *args) -> None:
        """Log on rank 0 only."""
        if self.is_rank0:
            log.info(msg, *args)

    def finish_preempted(self, step: int) -> None:
        """After the checkpoint is saved: rank 0 records the event and asks Slurm to requeue the job."""
        if not self.is_rank0:
            return
        # Only the time-limit signal requeues: SIGTERM comes from scancel (the user wants it stopped) or from Slurm's
        # own preemption, which requeues by itself when the partition says so.
        requeued = self.stop.signum == signal.SIGUSR2 and self.recipe.cluster.requeue and requeue_self()
        self.run.update(event="preempted", state="REQUEUED" if requeued else "PREEMPTED", last_step=step)
        log.warning("checkpoint saved at step %d; %s", step,
                    "job requeued, it will resume from it" if requeued else "not requeued (not under Slurm or requeue off)")
