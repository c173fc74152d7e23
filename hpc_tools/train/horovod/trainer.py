"""backend.kind: horovod — ``run(ctx)`` on every rank: a Hugging Face causal LM under Horovod.

``HorovodJob`` is ``hpc_tools.train.hf_causal_lm.job.CausalLMJob`` (data, the step, evaluation, Distributed
Checkpoint saves and resume) with a full copy of the model on every rank (as DDP): built empty, filled
(``values.materialize``: the recipe's seeded initial values or ``checkpoint.init_from_hf``) and then broadcast from
rank 0 (Horovod's ``broadcast_parameters``). AdamW is wrapped in Horovod's ``DistributedOptimizer``: each gradient is
all-reduced (averaged; gloo on CPU, NCCL on a GPU build) by Horovod's background thread once its last microbatch's
backward produced it (``backward_passes_per_step`` = the microbatches of a step, accumulated locally before), fused
up to ``backend.horovod.fusion_threshold_mb`` and optionally fp16-compressed. Its hooks: ``synchronize()`` before the
gradient norm, the update without a second synchronize, Horovod's ``zero_grad``, bf16 autocast of the fp32 model.

Horovod joins after torch.distributed (``rendezvous.join``): the loop, its stop agreement, the saver's commit and the
loss mean stay on torch.distributed's group, the gradients go through Horovod. Checkpoints are written synchronously:
the same parameter names as FSDP's, so a Horovod checkpoint resumes under fsdp (any strategy or rank count) and back.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from hpc_tools.runtime.context import RankContext
from hpc_tools.train import loop
from hpc_tools.train.hf_causal_lm.job import CausalLMJob
from hpc_tools.train.hf_causal_lm.loss import apply_liger
from hpc_tools.train.hf_causal_lm.model import adamw, build_empty
from hpc_tools.train.hf_causal_lm.values import full_values, materialize
from hpc_tools.train.horovod import rendezvous


def run(ctx: RankContext) -> None:
    """Train the recipe on this rank (joins torch.distributed, then Horovod)."""
    loop.run(ctx, HorovodJob)


class HorovodJob(CausalLMJob):
    """``engine.RankJob`` for Horovod: the Hugging Face causal-LM job, a full copy per rank, Horovod's optimizer."""

    kind = "horovod"
    background_writes = False

    def __init__(self, ctx: RankContext):
        super().__init__(ctx, dp_rank=ctx.rank)
        t0 = time.perf_counter()
        self.horovod = rendezvous.join(ctx)
        hvd = self.horovod.hvd
        check_nccl(hvd, self.device)
        t_join = time.perf_counter() - t0
        model = build_empty(self.recipe)
        self.fused_loss = apply_liger(model, self.recipe, self.device, ctx.info)
        materialize(model, self.device, full_values(self.recipe, model))
        model.to(self.device)  # a tied model's buffers stayed on the host
        if self.recipe.training.recompute_granularity == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.model = model
        opts = self.recipe.backend.horovod
        self.optimizer = hvd.DistributedOptimizer(
            adamw(model, self.recipe.training), named_parameters=model.named_parameters(), op=hvd.Average,
            compression=hvd.Compression.fp16 if opts.compression == "fp16" else hvd.Compression.none,
            backward_passes_per_step=max(self.layout.num_microbatches, 1))
        ctx.info("model ready in %.1f s (Horovod %s joined in %.1f s: %d ranks over gloo)",
                 time.perf_counter() - t0, _version(), t_join, hvd.size())
        self.start_data()

    def describe(self) -> str:
        opts = self.recipe.backend.horovod
        return (f"horovod: {self.layout.describe()}, DistributedOptimizer over {self.world} ranks "
                f"(compression {opts.compression}, fusion {opts.fusion_threshold_mb} MiB), "
                f"{self.recipe.training.precision}, recompute={self.recipe.training.recompute_granularity}"
                f"{', Liger kernels' if self.fused_loss else ''}, {self.samples}")

    # -- the hooks: the gradients through Horovod's optimizer ---------------------------------------------------------
    def compute_context(self):
        import torch

        if self.recipe.training.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def gradients_reduced(self) -> None:
        """Horovod all-reduced each gradient after the step's last backward (``backward_passes_per_step``): wait
        for the averages, the same on every rank."""
        from profiling.trace import horovod_wait

        with horovod_wait():  # a traced step's mark: this wait is Horovod's all-reduce (comm.dp), not host time
            self.optimizer.synchronize()

    def optimizer_step(self) -> None:
        with self.optimizer.skip_synchronize():
            self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()  # Horovod's takes no set_to_none (torch's default: True)

    def meta_extra(self) -> dict[str, Any]:
        return {"strategy": "horovod", "mesh": [self.world, 1], "compression": self.recipe.backend.horovod.compression}

    def before_load(self) -> None:
        """AdamW's states made by one step on zero gradients at lr 0 (nothing moves), on this rank alone: torch's own
        initialisation of them (``_init_optim_state``) calls ``zero_grad(set_to_none=True)``, which Horovod's
        optimizer does not take."""
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
        """Release the job, then leave Horovod (rank 0: and stop the rendezvous server)."""
        super().close()
        if self.horovod is not None:
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
