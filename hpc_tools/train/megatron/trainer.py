"""backend.kind: megatron — what every rank runs: ``run(ctx)`` (called by hpc_tools.runtime.rank).

Resume order: the newest complete checkpoint in ``ctx.checkpoint_dir`` (when checkpoint.resume), else
``checkpoint.load_path``, else a fresh model. Steps are 1-based and continue across resumes; the data of a step is a
pure function of the step, so no data position is saved. A stop signal (time limit, preemption) is agreed across
ranks at each step boundary; then the job saves, asks for a requeue and returns.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hpc_tools.runtime.context import RankContext
from hpc_tools.train.checkpoint_dirs import CheckpointDirs

log = logging.getLogger("hpc_tools.megatron")


def run(ctx: RankContext) -> None:
    import torch
    import torch.distributed as dist

    _quiet_megatron()
    if ctx.device_type == "cuda":
        torch.cuda.set_device(ctx.dist.local_rank)
    dist.init_process_group(ctx.dist_backend, rank=ctx.rank, world_size=ctx.dist.world_size)
    engine = None
    try:
        from hpc_tools.train.megatron.engine import Engine

        engine = Engine(ctx.recipe, ctx.layout, ctx.device_type)
        ctx.info("megatron: %s, %s, %s on %s", ctx.layout.describe(), ctx.recipe.model.family,
                 ctx.recipe.training.precision, ctx.device_type)
        train(ctx, engine)
    finally:
        if engine is not None:
            engine.close()
        dist.destroy_process_group()


def start_step(ctx: RankContext, engine, dirs: CheckpointDirs) -> int:
    """Load the checkpoint the recipe asks for; returns the last completed step (0 for a fresh start)."""
    from hpc_tools.errors import UserError
    from hpc_tools.train.megatron import checkpoint

    ck = ctx.recipe.checkpoint
    source: Path | None = dirs.newest() if ck.resume else None
    if source is None and ck.load_path:
        given = Path(ck.load_path)
        source = given if CheckpointDirs(given.parent).is_complete(given) else CheckpointDirs(given).newest()
        if source is None:
            raise UserError(f"checkpoint.load_path={ck.load_path} holds no complete checkpoint (give an iter_N "
                            "folder or a folder of them written by hpc_tools)")
    if source is None:
        return 0
    step = checkpoint.load(engine, source)
    ctx.info("resumed from %s at step %d", source, step)
    return step


def train(ctx: RankContext, engine) -> None:
    """The training loop: steps start+1..train_iters, records, heartbeats, interval/final/preemption saves."""
    from hpc_tools.train.data import build_samples, microbatches_for_step
    from hpc_tools.train.megatron import checkpoint
    from profiling.collector import StepCollector

    recipe, layout, c = ctx.recipe, ctx.layout, engine.coords
    dirs = CheckpointDirs(ctx.checkpoint_dir, keep_last=recipe.checkpoint.keep_last)
    first = start_step(ctx, engine, dirs) + 1
    samples = build_samples(recipe)
    collector = StepCollector.for_rank(ctx, tp_rank=c.tp_rank, pp_rank=c.pp_rank, dp_rank=c.dp_rank)
    interval, last = recipe.checkpoint.interval_iters, recipe.training.train_iters
    step = first - 1
    try:
        for step in range(first, last + 1):
            collector.start_step(step)
            t0 = time.perf_counter()
            batches = microbatches_for_step(samples, step, c.dp_rank, layout)
            collector.add_data_time(time.perf_counter() - t0)
            result = engine.train_step(step, batches)
            collector.end_step(step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm, skipped=result.skipped)
            ctx.heartbeat(step)
            stop = ctx.agree_stop(_device(ctx))
            if stop or step == last or (interval and step % interval == 0):
                checkpoint.save(engine, dirs, step)
            if stop:
                ctx.finish_preempted(step)
                return
        if first > last:
            ctx.info("nothing to do: the checkpoint is at step %d and training.train_iters=%d", first - 1, last)
    finally:
        collector.close()


def _device(ctx: RankContext):
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if ctx.device_type == "cuda" else torch.device("cpu")


def _quiet_megatron() -> None:
    # Megatron logs every bucket's parameter list and its whole config at INFO, and warns at import that apex and
    # Transformer Engine are missing (expected on CPU); keep rank logs readable.
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    for name in ("megatron.core", "megatron.core.distributed", "megatron.core.optimizer"):
        logging.getLogger(name).setLevel(logging.WARNING)
