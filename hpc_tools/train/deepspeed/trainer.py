"""backend.kind: deepspeed — ``run(ctx)`` on every rank: a Hugging Face causal LM under a DeepSpeed engine.

One step = ``layout.num_microbatches`` forward/backward passes (gradient accumulation inside the engine) and one
optimizer step; the pipeline engine (``parallel.pipeline_size > 1``) does the same through ``train_batch``. Data comes
from ``hpc_tools.train.data`` (the step is the data position), checkpoints go through ``CheckpointDirs`` (a save is
visible only once complete), records through ``StepCollector``.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpc_tools.errors import UserError
from hpc_tools.runtime.context import RankContext
from hpc_tools.train.checkpoint_dirs import CheckpointDirs
from hpc_tools.train.data import build_samples, microbatches_for_step
from hpc_tools.train.deepspeed.ds_config import build_ds_config, write_ds_config
from hpc_tools.train.deepspeed.model import build_model
from hpc_tools.train.schedule import lr_at
from profiling.collector import StepCollector

RNG_FILE = "rng_rank{rank:05d}.pt"
log = logging.getLogger("hpc_tools")


def run(ctx: RankContext) -> None:
    """Train the recipe on this rank (joins torch.distributed unless the caller already did)."""
    import torch.distributed as dist

    created = init_distributed(ctx)
    try:
        DeepSpeedJob(ctx).train()
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(ctx: RankContext) -> bool:
    """Join the process group ourselves (gloo on CPU, nccl on GPU); True when this call created it.

    DeepSpeed's own init_distributed would compile a shared-memory all-reduce op on CPU (~47 s here) that training
    never uses; it is marked incompatible so that DeepSpeed keeps plain torch.distributed collectives.
    """
    import torch
    import torch.distributed as dist

    if ctx.device_type == "cuda":
        torch.cuda.set_device(ctx.dist.local_rank)
    else:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if dist.is_initialized():
        return False
    dist.init_process_group(ctx.dist_backend, rank=ctx.rank, world_size=ctx.dist.world_size)
    return True


class DeepSpeedJob:
    """The engine, the data and the step loop of one run on one rank."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.recipe = ctx.recipe
        self.layout = ctx.layout
        self.pipeline = ctx.layout.pipeline_size > 1
        self.dirs = CheckpointDirs(ctx.checkpoint_dir, keep_last=self.recipe.checkpoint.keep_last)
        self.config = build_ds_config(self.recipe, self.layout)
        self.engine = None
        self._keepalive = None

    # -- set-up ---------------------------------------------------------------------------------------------------------
    def build_engine(self) -> None:
        import deepspeed
        from torch.optim.lr_scheduler import LambdaLR

        t0 = time.perf_counter()
        if self.ctx.is_rank0:
            write_ds_config(self.config, self.ctx.run_dir)
        model, self._keepalive = build_model(self.recipe, self.config)
        t_model = time.perf_counter() - t0
        if self.pipeline:
            from hpc_tools.train.deepspeed.pipeline import build_pipeline

            model = build_pipeline(self.recipe, model, self.layout.pipeline_size)
        training = self.recipe.training

        def schedule(optimizer):
            # LambdaLR's counter is the number of completed steps: step k (1-based) runs at lr_at(k).
            return LambdaLR(optimizer, lambda done: lr_at(training, done + 1) / training.lr)

        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                                   if p.requires_grad],
                                                    config=self.config, lr_scheduler=schedule,
                                                    dist_init_required=False)
        self.ctx.info("engine ready in %.1f s (model %.1f s)", time.perf_counter() - t0, t_model)
        if self.ctx.is_rank0 and self.recipe.backend.deepspeed.zero_stage == 0 and \
                self.recipe.training.precision != "fp32":
            log.warning("backend.deepspeed.zero_stage=0 with %s: DeepSpeed updates the %s weights directly, without "
                          "fp32 master weights (use zero_stage >= 1 to keep them)", self.recipe.training.precision,
                          self.recipe.training.precision)

    def coords(self) -> dict[str, int]:
        if self.pipeline:
            grid = self.engine.grid
            return {"pp_rank": grid.get_stage_id(), "dp_rank": grid.get_data_parallel_id()}
        return {"pp_rank": 0, "dp_rank": self.ctx.rank}

    # -- the loop -------------------------------------------------------------------------------------------------------
    def train(self) -> None:
        self.build_engine()
        samples = build_samples(self.recipe)
        start = self.resume() + 1
        coords = self.coords()
        collector = StepCollector.for_rank(self.ctx, **coords)
        end = self.recipe.training.train_iters
        self.ctx.info("deepspeed: %s, ZeRO-%d, %s, %s; steps %d..%d", self.layout.describe(),
                      self.recipe.backend.deepspeed.zero_stage, self.recipe.training.precision, samples, start, end)
        last_saved = start - 1
        try:
            for step in range(start, end + 1):
                collector.start_step(step)
                t0 = time.perf_counter()
                batches = microbatches_for_step(samples, step, coords["dp_rank"], self.layout)
                collector.add_data_time(time.perf_counter() - t0)
                lr = self.engine.get_lr()[0]
                loss, grad_norm = self.pipeline_step(batches) if self.pipeline else self.step(batches)
                if grad_norm is None:
                    grad_norm = _float(self.engine.get_global_grad_norm())
                skipped = None if self.recipe.training.precision != "fp16" else not self.engine.was_step_applied()
                collector.end_step(step, loss=loss, lr=lr, grad_norm=grad_norm, skipped=skipped)
                self.ctx.heartbeat(step)
                interval = self.recipe.checkpoint.interval_iters
                if (interval and step % interval == 0) or step == end:
                    self.save(step)
                    last_saved = step
                if self.ctx.agree_stop(self.engine.device):
                    if last_saved != step:
                        self.save(step)
                    self.ctx.finish_preempted(step)
                    return
            if start > end:
                self.ctx.info("nothing to do: the checkpoint is at step %d >= training.train_iters=%d", start - 1, end)
        finally:
            collector.close()
            self.close()

    def close(self) -> None:
        """Release the engine and DeepSpeed's cached process groups (a later engine in this process builds its own)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None
        self._keepalive = None
        try:
            from deepspeed.utils import groups

            # Private, but the only reset there is: without it a pipeline engine's topology leaks into the next
            # engine built in the same process (the matrix runs many).
            groups._release_process_group_references()
        except (ImportError, AttributeError):
            pass

    def step(self, batches: list[dict[str, Any]]) -> tuple[float, float | None]:
        """Forward/backward every microbatch, one optimizer step: (mean loss over all DP ranks, grad norm or None)."""
        import torch
        import torch.distributed as dist

        from hpc_tools.train.deepspeed.pipeline import causal_lm_loss

        device = self.engine.device
        total = torch.zeros(1, dtype=torch.float64, device=device)
        grad_norm = None
        for i, mb in enumerate(batches):
            logits = self.engine(input_ids=mb["tokens"].to(device)).logits
            loss = causal_lm_loss(logits, mb["labels"].to(device))
            self.engine.backward(loss)
            if i == len(batches) - 1 and self.engine.zero_optimization_stage() == 0 and \
                    self.recipe.training.precision == "fp32":
                grad_norm = self.averaged_grad_norm()
            self.engine.step()
            total += loss.detach().double()
        total /= len(batches)
        dist.all_reduce(total)  # every rank saw its own share of the global batch
        return total.item() / self.layout.data_size, grad_norm

    def averaged_grad_norm(self) -> float:
        """Global gradient norm before clipping, for ZeRO-0 in fp32 where the engine keeps none.

        At the accumulation boundary the engine has already averaged the gradients over DP, so every rank holds all
        of them and the norm needs no communication.
        """
        import torch

        grads = [p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0

    def pipeline_step(self, batches: list[dict[str, Any]]) -> tuple[float, None]:
        """One pipelined step through DeepSpeed's schedule; its loss is already averaged over microbatches and DP."""
        data = iter([(mb["tokens"], mb["labels"]) for mb in batches])
        return float(self.engine.train_batch(data_iter=data)), None

    # -- checkpoints ----------------------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Save through the engine into a partial folder; it becomes ``iter_N`` only once every rank is done."""
        import torch
        import torch.distributed as dist

        if self.ctx.is_rank0:
            partial = self.dirs.begin(step)
        else:
            partial = self.dirs.partial_path(step)
        dist.barrier()
        state = {"step": step, "data_step": step, "seed": self.recipe.training.seed}
        self.engine.save_checkpoint(str(self.dirs.root), tag=partial.name, client_state=state, save_latest=False)
        torch.save(_rng_state(), partial / RNG_FILE.format(rank=self.ctx.rank))
        dist.barrier()
        final = self.dirs.final_path(step)
        if self.ctx.is_rank0:
            final = self.dirs.commit(step, meta=self.meta())
        dist.barrier()
        self.ctx.info("checkpoint saved: %s", final)
        return final

    def meta(self) -> dict[str, Any]:
        r, ds = self.recipe, self.recipe.backend.deepspeed
        return {"backend": "deepspeed", "zero_stage": ds.zero_stage, "pipeline_size": self.layout.pipeline_size,
                "data_size": self.layout.data_size, "world_size": self.layout.world_size,
                "precision": r.training.precision, "family": r.model.family, "pretrained_path": ds.pretrained_path,
                "layout": self.layout.describe()}

    def resume(self) -> int:
        """Load the newest complete checkpoint (or checkpoint.load_path); the step it holds, else 0."""
        path = self.dirs.newest() if self.recipe.checkpoint.resume else None
        if path is None and self.recipe.checkpoint.load_path:
            path = load_path_folder(self.recipe.checkpoint.load_path)
        if path is None:
            return 0
        loaded, client = self.engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
        if loaded is None:
            raise UserError(f"checkpoint {path} could not be loaded by DeepSpeed (is it a DeepSpeed checkpoint of this "
                            "model? set checkpoint.resume: false or another checkpoint.load_path)")
        step = int(client["step"])
        rng = path / RNG_FILE.format(rank=self.ctx.rank)
        if rng.is_file():
            _set_rng_state(rng)
        self.ctx.info("resumed from %s at step %d", path, step)
        return step


def load_path_folder(value: str) -> Path:
    """``checkpoint.load_path``: a complete ``iter_N`` folder, or a checkpoint root (its newest complete folder)."""
    path = Path(value).expanduser()
    if CheckpointDirs(path.parent).is_complete(path):
        return path
    newest = CheckpointDirs(path).newest()
    if newest is None:
        raise UserError(f"checkpoint.load_path={value} holds no complete checkpoint (give an iter_N folder written "
                        "by hpc_tools, or its parent folder)")
    return newest


def _float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def _rng_state() -> dict[str, Any]:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(path: Path) -> None:
    import torch

    state = torch.load(path, weights_only=False)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
