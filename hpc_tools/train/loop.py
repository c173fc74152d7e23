"""The one training loop every backend runs (Megatron, DeepSpeed, comm_check), driving a small ``Engine`` protocol.

What the loop owns, in this order for each step ``s`` of ``start+1 .. training.train_iters``::

    collector.start_step(s); batch = engine.batch(s) (timed as data time); result = engine.step(s, batch)
    collector.end_step(s, ...); ctx.heartbeat(s); rank 0 logs result.note at training.log_interval
    stop = ctx.agree_stop()                          # collective: every rank takes the same branch below
    save(s) if stop, or s is the last step, or s % checkpoint.interval_iters == 0 (at most one save per step)
    if stop: ctx.finish_preempted(s) and return      # the checkpoint of step s exists before the requeue

Before the first step: the resume source (``checkpoint_dirs.resume_source``) is handed to ``engine.resume``, whose
step the run continues from (steps are 1-based and continue across resumes; records are appended). Whatever
happens, the collector is closed and then the engine, in a ``finally``. ``run`` adds the process group around it all.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from hpc_tools.train.checkpoint_dirs import CheckpointDirs, resume_source

if TYPE_CHECKING:
    from hpc_tools.runtime.context import RankContext

log = logging.getLogger("hpc_tools")


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step reports to the records (``profiling.collector.StepCollector.end_step``) and the log."""

    loss: float | None = None
    """Mean loss over the whole global batch (every microbatch, every data-parallel rank): the same on every rank.
    None for a step without a model (comm_check)."""
    grad_norm: float | None = None
    """Global gradient norm before clipping, when the backend computes one."""
    lr: float | None = None
    """Learning rate the optimizer step used."""
    skipped: bool | None = None
    """True when the optimizer skipped the update (fp16 loss-scale overflow); None when the backend cannot tell."""
    note: str | None = None
    """A progress detail of this step, logged by rank 0 every ``training.log_interval`` steps and at the last one."""


class Engine(Protocol):
    """One rank's share of a job as the loop drives it. Every method except ``describe`` and ``coords`` may be a
    collective: all ranks call it at the same point."""

    checkpoints: bool
    """False for a backend without state to save (comm_check): the loop then neither resumes nor saves."""

    def describe(self) -> str:
        """One line for rank 0's log: backend, layout, precision..."""

    def coords(self) -> dict[str, int]:
        """This rank's place for its records: keyword arguments of ``StepCollector.for_rank`` (tp/pp/dp_rank)."""

    def resume(self, source: Path) -> int:
        """Load the checkpoint at ``source``; returns the step it holds (the last completed one)."""

    def batch(self, step: int) -> Any:
        """This rank's input of ``step`` (the loop times it as data time)."""

    def step(self, step: int, batch: Any) -> StepResult:
        """Forward, backward and optimizer step of ``step`` on ``batch``."""

    def save(self, step: int) -> Path:
        """Write a complete checkpoint of ``step`` under ``ctx.checkpoint_dir``; returns its folder."""

    def close(self) -> None:
        """Release what the engine holds (called once, also after an error)."""


def run(ctx: "RankContext", build: Callable[["RankContext"], Engine]) -> None:
    """A backend's ``run(ctx)``: join the process group on this rank's device, build the engine, ``train`` it."""
    with process_group(ctx):
        train(ctx, build(ctx))


@contextlib.contextmanager
def process_group(ctx: "RankContext") -> Iterator[None]:
    """torch.distributed over ``ctx.dist_backend`` (gloo on CPU, nccl on GPU) for the duration.

    A group that already exists (a harness running many jobs in one process group) is used and left up. On success
    the ranks leave together (a barrier); after an error this rank leaves at once, so that its peers fail fast
    instead of waiting for it.
    """
    import torch
    import torch.distributed as dist

    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(ctx.dist_backend, rank=ctx.rank, world_size=ctx.dist.world_size)
    try:
        yield
        dist.barrier()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def default_collector(ctx: "RankContext", **coords: int):
    """The records of this rank: ``profiling.collector.StepCollector`` configured from the recipe."""
    from profiling.collector import StepCollector

    return StepCollector.for_rank(ctx, **coords)


def resume(ctx: "RankContext", engine: Engine) -> int:
    """Load the checkpoint the recipe asks for into ``engine``; the last completed step (0 for a fresh start)."""
    if not engine.checkpoints:
        return 0
    ck = ctx.recipe.checkpoint
    source = resume_source(CheckpointDirs(ctx.checkpoint_dir, keep_last=ck.keep_last), resume=ck.resume,
                           load_path=ck.load_path)
    if source is None:
        return 0
    step = engine.resume(source)
    ctx.info("resumed from %s at step %d", source, step)
    return step


def save_due(step: int, last: int, interval: int | None, stop: bool) -> bool:
    """Whether step ``step`` ends with a checkpoint: on a stop, at the last step, and every ``interval`` steps."""
    return stop or step == last or bool(interval and step % interval == 0)


def train(ctx: "RankContext", engine: Engine, collector_for: Callable[..., Any] = default_collector) -> None:
    """Steps ``resume+1 .. training.train_iters`` of ``engine`` with records, heartbeats, the stop agreement and
    the saves (see the module docstring); closes the collector, then the engine, whatever happens."""
    collector = None
    try:
        first = resume(ctx, engine) + 1
        training, interval = ctx.recipe.training, ctx.recipe.checkpoint.interval_iters
        last = training.train_iters
        ctx.info("%s; steps %d..%d", engine.describe(), first, last)
        collector = collector_for(ctx, **engine.coords())
        for step in range(first, last + 1):
            collector.start_step(step)
            with collector.data_timer():
                batch = engine.batch(step)
            result = engine.step(step, batch)
            collector.end_step(step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm,
                               skipped=result.skipped)
            ctx.heartbeat(step)
            if result.note and (step % training.log_interval == 0 or step == last):
                ctx.info("%s", result.note)
            stop = ctx.agree_stop()
            if engine.checkpoints and save_due(step, last, interval, stop):
                ctx.info("checkpoint saved: %s", engine.save(step))
            if stop:
                ctx.finish_preempted(step)
                return
        if first > last:
            ctx.info("nothing to do: the checkpoint is at step %d and training.train_iters=%d", first - 1, last)
    finally:
        try:
            if collector is not None:
                collector.close()
        finally:
            engine.close()
