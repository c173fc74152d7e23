"""backend.kind: horovod — ``run(ctx)`` on every rank: the fsdp backend's Hugging Face causal LM under Horovod.

The model is the fsdp backend's (``fsdp/model.py``: the recipe's config and seeded initial values, or
``checkpoint.init_from_hf``), a full copy on every rank (as DDP), filled by ``fsdp/parallel.materialize`` and then
broadcast from rank 0 (Horovod's ``broadcast_parameters``). AdamW is wrapped in Horovod's ``DistributedOptimizer``:
each gradient is all-reduced (averaged; gloo on CPU, NCCL on a GPU build) by Horovod's background thread once its
last microbatch's backward produced it (``backward_passes_per_step`` = the microbatches of a step, accumulated
locally before), fused up to ``backend.horovod.fusion_threshold_mb`` and optionally fp16-compressed. A step is then
the fsdp backend's: ``synchronize()``, the global gradient norm clipped to ``training.clip_grad``, one AdamW step at
``lr_at(step)``, a non-finite step skipped. bf16 autocasts the fp32 model, as DDP does.

Horovod joins after torch.distributed (``rendezvous.join``): the loop, its stop agreement, the saver's commit and the
loss mean stay on torch.distributed's group, the gradients go through Horovod. Checkpoints are the fsdp backend's
torch Distributed Checkpoint folders written through the project's saver (``FSDPJob.write_checkpoint``, synchronous):
the same parameter names, so a Horovod checkpoint resumes under fsdp (any strategy or rank count) and back.
"""

from __future__ import annotations

import time
from typing import Any

from hpc_tools.runtime.context import RankContext
from hpc_tools.train import loop
from hpc_tools.train.data import build_samples
from hpc_tools.train.fsdp import parallel
from hpc_tools.train.fsdp.model import build_empty, full_values
from hpc_tools.train.fsdp.trainer import FSDPJob, param_groups
from hpc_tools.train.hf_causal_lm import apply_liger, forward_loss
from hpc_tools.train.horovod import rendezvous
from hpc_tools.train.prefetch import BatchPrefetcher, to_device


def run(ctx: RankContext) -> None:
    """Train the recipe on this rank (joins torch.distributed, then Horovod)."""
    loop.run(ctx, HorovodJob)


class HorovodJob(FSDPJob):
    """``engine.Engine`` for Horovod: the fsdp engine's model, data, evaluation and checkpoints; Horovod's optimizer."""

    checkpoints = True

    def __init__(self, ctx: RankContext):
        import torch

        self.ctx, self.recipe, self.layout = ctx, ctx.recipe, ctx.layout
        self.device = ctx.device
        self.world = ctx.dist.world_size
        self.dp_rank = ctx.rank
        self._async = self.prefetch = None
        t0 = time.perf_counter()
        self.horovod = rendezvous.join(ctx)
        hvd = self.horovod.hvd
        check_nccl(hvd, self.device)
        t_join = time.perf_counter() - t0
        model = build_empty(self.recipe)
        self.fused_loss = apply_liger(model, self.recipe, self.device, ctx.info)
        parallel.materialize(model, self.device, full_values(self.recipe, model))
        model.to(self.device)  # a tied model's buffers stayed on the host
        if self.recipe.training.recompute_granularity == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.model = model
        t, opts = self.recipe.training, self.recipe.backend.horovod
        adamw = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                                  eps=t.adam_eps)
        self.optimizer = hvd.DistributedOptimizer(
            adamw, named_parameters=model.named_parameters(), op=hvd.Average,
            compression=hvd.Compression.fp16 if opts.compression == "fp16" else hvd.Compression.none,
            backward_passes_per_step=max(self.layout.num_microbatches, 1))
        ctx.info("model ready in %.1f s (Horovod %s joined in %.1f s: %d ranks over gloo)",
                 time.perf_counter() - t0, _version(), t_join, hvd.size())
        self.samples = build_samples(self.recipe)
        on_gpu = self.device.type == "cuda"
        self.prefetch = BatchPrefetcher(self._build_batch, t.train_iters, background=on_gpu, pin=on_gpu)

    def describe(self) -> str:
        opts = self.recipe.backend.horovod
        return (f"horovod: {self.layout.describe()}, DistributedOptimizer over {self.world} ranks "
                f"(compression {opts.compression}, fusion {opts.fusion_threshold_mb} MiB), "
                f"{self.recipe.training.precision}, recompute={self.recipe.training.recompute_granularity}"
                f"{', Liger kernels' if self.fused_loss else ''}, {self.samples}")

    def _forward_loss(self, mb: dict[str, Any]):
        import contextlib

        import torch

        bf16 = self.recipe.training.precision == "bf16"
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            return forward_loss(self.model, to_device(mb["tokens"], self.device),
                                to_device(mb["labels"], self.device), self.fused_loss)

    # -- the fsdp engine's step, its gradients through Horovod's optimizer -------------------------------------------
    def _microbatch_sync(self, last: bool):
        """Horovod all-reduces each gradient after the step's last backward (``backward_passes_per_step``)."""
        import contextlib

        return contextlib.nullcontext()

    def _gradients_reduced(self) -> None:
        self.optimizer.synchronize()  # wait for the averaged gradients, the same on every rank

    def _optimizer_step(self) -> None:
        with self.optimizer.skip_synchronize():
            self.optimizer.step()

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad()  # Horovod's takes no set_to_none (torch's default: True)

    # -- checkpoints: the fsdp engine's Distributed Checkpoint, written synchronously --------------------------------
    def write_checkpoint(self, folder, step: int, background: bool):
        return super().write_checkpoint(folder, step, background=False)

    def meta(self) -> dict[str, Any]:
        r = self.recipe
        return {"backend": "horovod", "format": "torch_dcp", "strategy": "horovod", "mesh": [self.world, 1],
                "world_size": self.world, "data_step_is_step": True, "precision": r.training.precision,
                "family": r.model.family, "layout": self.layout.describe(),
                "compression": r.backend.horovod.compression}

    def resume(self, source) -> int:
        """The fsdp engine's load, after the optimizer's states exist: torch's own initialisation of them
        (``_init_optim_state``) calls ``zero_grad(set_to_none=True)``, which Horovod's optimizer does not take."""
        self._init_optimizer_state()
        return super().resume(source)

    def _init_optimizer_state(self) -> None:
        """AdamW's states made by one step on zero gradients at lr 0 (nothing moves), on this rank alone."""
        import torch

        if self.optimizer.state:
            return
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        with self.optimizer.skip_synchronize():
            self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.optimizer.zero_grad()

    def close(self) -> None:
        """Release the engine, then leave Horovod (rank 0: and stop the rendezvous server)."""
        super().close()
        if getattr(self, "horovod", None) is not None:
            self.horovod.close()
            self.horovod = None


def check_nccl(hvd, device) -> None:
    """GPU ranks need a Horovod built with NCCL: a gloo-only build reduces GPU tensors through host memory."""
    if device.type == "cuda" and not hvd.nccl_built():
        from hpc_tools.errors import UserError

        raise UserError(f"backend.kind=horovod on GPUs: horovod {_version()} here was built without NCCL "
                        "(nccl_built() is false), so GPU gradients would reduce through host memory over gloo "
                        "(rebuild it on this CUDA torch with nvcc on PATH: bash environment/install-horovod.sh)")


def _version() -> str:
    import horovod

    return horovod.__version__
