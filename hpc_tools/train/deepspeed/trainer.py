"""backend.kind: deepspeed — ``run(ctx)`` on every rank: a Hugging Face causal LM under a DeepSpeed engine.

One step = ``layout.num_microbatches`` forward/backward passes (gradient accumulation inside the engine) and one
optimizer step; the pipeline engine (``parallel.pipeline_size > 1``) does the same through ``train_batch``.
``DeepSpeedJob`` is the engine of ``hpc_tools.train.loop`` (which owns records, the stop agreement and evaluations;
resume and saves are ``hpc_tools.train.checkpointing``'s: a save is visible only once complete). Data comes from
``hpc_tools.train.data`` (the step is the data position).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from hpc_tools.runtime.context import RankContext
from hpc_tools.train import loop, rng
from hpc_tools.train.data import build_samples, microbatches_for_step
from hpc_tools.train.deepspeed.device import check_accelerator, environment_for
from hpc_tools.train.deepspeed.ds_config import build_ds_config, write_ds_config
from hpc_tools.train.deepspeed.model import build_model
from hpc_tools.train.engine import StepResult
from hpc_tools.train.hf_causal_lm.loss import apply_liger, forward_loss
from hpc_tools.train.prefetch import BatchPrefetcher, to_device
from hpc_tools.train.schedule import lr_at

RNG_FILE = "rng_rank{rank:05d}.pt"
log = logging.getLogger("hpc_tools")


def run(ctx: RankContext) -> None:
    """Train the recipe on this rank (joins torch.distributed unless the caller already did)."""
    environment_for(ctx.device)  # before DeepSpeed is imported: its accelerator and CUDA index are the rank's
    import_deepspeed()
    if ctx.device.type == "cpu":
        _plain_cpu_collectives()
    loop.run(ctx, DeepSpeedJob)


def import_deepspeed() -> None:
    """Import DeepSpeed without mlflow: its autotuner (``deepspeed.autotuning``, imported by ``deepspeed.runtime``,
    used only by the ``deepspeed --autotuning`` launcher, never here) imports mlflow when installed: most of
    ``import deepspeed``'s time in every rank (3.45 s with mlflow, 0.75 s without, on this project's 2-core test
    machine; ``benchmarks/bench_rank_import.py`` times both). A no-op once DeepSpeed is imported."""
    import sys

    from hpc_tools.train.imports import absent

    if "deepspeed" in sys.modules:
        return
    with absent("mlflow"):
        import deepspeed  # noqa: F401


def import_on_cpu() -> None:
    """What a CPU rank imports before training (the row's ``preload``, run once by the local fork server for all its
    ranks): DeepSpeed on its CPU accelerator, without mlflow, and transformers' model code."""
    import torch

    from hpc_tools.train.imports import import_transformers

    environment_for(torch.device("cpu"))
    import_deepspeed()
    import_transformers()


def _plain_cpu_collectives() -> None:
    """Keep DeepSpeed on plain torch.distributed collectives on CPU.

    DeepSpeed would compile a shared-memory all-reduce op on CPU (~47 s here) that training never uses; marking it
    incompatible skips the build.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class DeepSpeedJob:
    """``engine.RankJob`` for DeepSpeed: the engine, the data and the checkpoints of one run on one rank."""

    checkpoints = True

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.recipe = ctx.recipe
        self.layout = ctx.layout
        self.pipeline = ctx.layout.pipeline_size > 1
        self.config = build_ds_config(self.recipe, self.layout)
        self.engine = None
        self._keepalive = None
        self.build_engine()
        self._coords = self._grid_coords()
        self.samples = build_samples(self.recipe)
        on_gpu = self.engine.device.type == "cuda"
        self.prefetch = BatchPrefetcher(self._build_batch, self.recipe.training.train_iters, background=on_gpu,
                                        pin=on_gpu)

    # -- set-up --------------------------------------------------------------------------------------------------------
    def build_engine(self) -> None:
        import deepspeed
        from torch.optim.lr_scheduler import LambdaLR

        check_accelerator(self.ctx.device)
        t0 = time.perf_counter()
        if self.ctx.is_rank0:
            write_ds_config(self.config, self.ctx.run_dir)
        model, self._keepalive = build_model(self.recipe, self.config)
        # ZeRO-3 partitions the output weight outside lm_head's own forward, which the fused loss reads directly
        self.fused_loss = apply_liger(model, self.recipe, self.ctx.device, self.ctx.info,
                                      fused_loss=not self.pipeline and self.recipe.backend.deepspeed.zero_stage < 3)
        t_model = time.perf_counter() - t0
        if self.pipeline:
            import deepspeed.comm

            from hpc_tools.train.deepspeed.pipeline import build_pipeline

            # PipelineModule asks deepspeed.comm for ranks and groups before deepspeed.initialize would set its
            # backend up: attach it to the process group the loop already joined.
            deepspeed.comm.init_distributed(self.ctx.dist_backend, dist_init_required=False, verbose=False)
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

    def describe(self) -> str:
        return (f"deepspeed: {self.layout.describe()}, ZeRO-{self.recipe.backend.deepspeed.zero_stage}, "
                f"{self.recipe.training.precision}, {self.samples}")

    def coords(self) -> dict[str, int]:
        return dict(self._coords)

    def _grid_coords(self) -> dict[str, int]:
        if self.pipeline:
            grid = self.engine.grid
            return {"pp_rank": grid.get_stage_id(), "dp_rank": grid.get_data_parallel_id()}
        return {"pp_rank": 0, "dp_rank": self.ctx.rank}

    # -- one step ------------------------------------------------------------------------------------------------------
    def batch(self, step: int) -> list[dict[str, Any]]:
        """This rank's microbatches of ``step``; on a GPU built (and pinned) in the background during the step
        before (``hpc_tools.train.prefetch``)."""
        return self.prefetch.get(step)

    def _build_batch(self, step: int) -> list[dict[str, Any]]:
        return microbatches_for_step(self.samples, step, self._coords["dp_rank"], self.layout)

    def step(self, step: int, batch: list[dict[str, Any]]) -> StepResult:
        """One optimizer step (pipelined or not) at the scheduler's lr, with the engine's grad norm and skip flag."""
        lr = self.engine.get_lr()[0]
        poison = loop.nonfinite_injected(step, self.ctx.rank)
        loss, grad_norm = self.pipeline_step(batch) if self.pipeline else self.accumulated_step(batch, poison)
        if grad_norm is None:
            grad_norm = _float(self.engine.get_global_grad_norm())
        fp16 = self.recipe.training.precision == "fp16"
        applied = self.engine.was_step_applied()
        # The loss is all-reduced (the same on every rank); a skip that DeepSpeed's own check made outside fp16 (an
        # inf/nan gradient norm in ZeRO 1-3 or the bf16 optimizer) is non-finite too. fp16 overflow skips are the
        # loss scaler's normal work and not counted.
        nonfinite = not math.isfinite(loss) or (not fp16 and not applied) or \
            (grad_norm is not None and not math.isfinite(grad_norm) and not fp16)
        skipped = (not applied) if (fp16 or nonfinite) else None
        if nonfinite and applied and self._own_check:
            log.error("step %d was not finite but DeepSpeed applied its update (no check of its own here)", step)
        return StepResult(loss=loss, lr=lr, grad_norm=grad_norm, skipped=skipped, nonfinite=nonfinite)

    @property
    def _own_check(self) -> bool:
        """Whether DeepSpeed's optimizer checks gradients itself (ZeRO 1-3, fp16/bf16 optimizers: they have an
        ``overflow`` flag and skip an inf/nan step); a plain torch optimizer (ZeRO-0) does not."""
        return hasattr(self.engine.optimizer, "overflow")

    def close(self) -> None:
        """Release the engine and DeepSpeed's cached process groups (a later engine in this process builds its own)."""
        import torch.distributed as dist

        if getattr(self, "prefetch", None) is not None:
            self.prefetch.close()
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

    def accumulated_step(self, batches: list[dict[str, Any]], poison: bool = False) -> tuple[float, float | None]:
        """Forward/backward every microbatch, one optimizer step: (mean loss over all DP ranks, grad norm or None).

        Before the boundary ``engine.step()`` the ranks all-reduce the loss sum with a count of ranks whose gradients
        are not finite (ZeRO-0 without an optimizer check of its own): a non-finite step then drops the gradients so
        the optimizer updates nothing. ZeRO 1-3 skip such a step themselves (their inf/nan grad-norm check)."""
        import torch
        import torch.distributed as dist

        device = self.engine.device
        total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, ranks with non-finite grads]
        grad_norm = None
        for i, mb in enumerate(batches):
            loss = forward_loss(self.engine, to_device(mb["tokens"], device), to_device(mb["labels"], device),
                                self.fused_loss)
            if poison:  # loop.INJECT_NONFINITE_ENV (tests only)
                loss = loss * float("nan")
            self.engine.backward(loss)
            total[0] += loss.detach().double()
            if i == len(batches) - 1:
                if self.engine.zero_optimization_stage() == 0 and self.recipe.training.precision == "fp32":
                    grad_norm = self.averaged_grad_norm()
                if not self._own_check:
                    total[1] = 0.0 if self._grads_finite() else 1.0
                dist.all_reduce(total)  # every rank saw its own share of the global batch
                if not self._own_check and (total[1] > 0 or not torch.isfinite(total[0])):
                    for p in self.engine.module.parameters():
                        p.grad = None  # torch optimizers leave parameters without a gradient untouched
            self.engine.step()
        return total[0].item() / len(batches) / self.layout.data_size, grad_norm

    def _grads_finite(self) -> bool:
        import torch

        sums = [p.grad.sum(dtype=torch.float32) for p in self.engine.module.parameters() if p.grad is not None]
        return not sums or bool(torch.isfinite(torch.stack(sums)).all())

    def averaged_grad_norm(self) -> float:
        """Global gradient norm before clipping, for ZeRO-0 in fp32 where the engine keeps none.

        At the accumulation boundary the engine has already averaged the gradients over DP, so every rank holds all
        of them and the norm needs no communication.
        """
        import torch

        grads = [p.grad.detach().float() for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))

    def pipeline_step(self, batches: list[dict[str, Any]]) -> tuple[float, None]:
        """One pipelined step through DeepSpeed's schedule; its loss is already averaged over microbatches and DP.

        The update of a non-finite step is skipped by DeepSpeed's own check (ZeRO-1's inf/nan grad norm); with
        ZeRO-0 the pipeline gives no point to intervene between backward and step, so it is counted only."""
        data = iter([(mb["tokens"], mb["labels"]) for mb in batches])
        return float(self.engine.train_batch(data_iter=data)), None

    def evaluate(self, batches: list[list[dict[str, Any]]]) -> float:
        """Validation loss: forward only (eval mode, no grad) over each entry of ``batches`` (this rank's
        microbatches of one global batch), the mean over microbatches and data-parallel ranks (the pipeline engine's
        ``eval_batch`` reduces and broadcasts it itself): the same on every rank."""
        import torch
        import torch.distributed as dist

        if self.pipeline:
            losses = [float(self.engine.eval_batch(data_iter=iter([(mb["tokens"], mb["labels"]) for mb in mbs])))
                      for mbs in batches]
            return sum(losses) / len(losses)
        device = self.engine.device
        total = torch.zeros(1, dtype=torch.float64, device=device)
        count = 0
        self.engine.eval()
        try:
            with torch.no_grad():
                for mbs in batches:
                    for mb in mbs:
                        total += forward_loss(self.engine, to_device(mb["tokens"], device),
                                              to_device(mb["labels"], device), self.fused_loss).double()
                        count += 1
        finally:
            self.engine.train()
        dist.all_reduce(total)
        return total.item() / count / self.layout.data_size

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def write_checkpoint(self, folder: Path, step: int, background: bool):
        """The saver's write (``engine.Checkpointable``): the engine's files and this rank's RNG into ``folder``
        (synchronous: checkpoint.async_save is refused for deepspeed, see the backend table)."""
        import torch

        state = {"step": step, "data_step": step, "seed": self.recipe.training.seed}
        self.engine.save_checkpoint(str(folder.parent), tag=folder.name, client_state=state, save_latest=False)
        torch.save(rng.capture(), folder / RNG_FILE.format(rank=self.ctx.rank))
        return None

    def start_background_writer(self) -> None:
        """Nothing to start: DeepSpeed saves synchronously."""

    def checkpoint_meta(self, step: int) -> dict[str, Any]:
        return self.meta()

    def meta(self) -> dict[str, Any]:
        r, ds = self.recipe, self.recipe.backend.deepspeed
        return {"backend": "deepspeed", "zero_stage": ds.zero_stage, "pipeline_size": self.layout.pipeline_size,
                "data_size": self.layout.data_size, "world_size": self.layout.world_size,
                "precision": r.training.precision, "family": r.model.family, "pretrained_path": ds.pretrained_path,
                "layout": self.layout.describe()}

    def resume(self, source: Path) -> int:
        """Load the checkpoint at ``source`` (model, optimizer, scheduler, this rank's RNG); the step it holds."""
        import torch

        loaded, client = self.engine.load_checkpoint(str(source.parent), tag=source.name, load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
        if loaded is None:  # not the recipe's problem: the loop skips it and falls back to the previous one
            raise RuntimeError(f"checkpoint {source} could not be loaded by DeepSpeed (is it a DeepSpeed checkpoint "
                               "of this model?)")
        rng_file = source / RNG_FILE.format(rank=self.ctx.rank)
        if rng_file.is_file():
            rng.restore(torch.load(rng_file, weights_only=False))
        return int(client["step"])


def _float(value) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)
