"""backend.kind: fsdp — ``run(ctx)`` on every rank: a Hugging Face causal LM under FSDP2 or DDP on the shared loop.

``FSDPJob`` is ``hpc_tools.train.hf_causal_lm.job.CausalLMJob`` (data, the step, evaluation, Distributed Checkpoint
saves in the background and resume) with the model spread by ``parallel``: built empty, sharded (or wrapped in DDP)
and filled shard by shard; torch's AdamW. Its hooks: DDP reduces the gradients only after a step's last microbatch
(``parallel.gradient_sync``) and autocasts its fp32 model to bf16 (``parallel.compute_context``; FSDP2 casts through
its policy). The loop (``hpc_tools.train.loop``) owns records, evaluation and the stop agreement; resume and saves
are ``hpc_tools.train.checkpointing``'s. Data-parallel rank = rank // tensor_size (TP innermost, as
``ParallelLayout`` orders ranks).
"""

from __future__ import annotations

import time
from typing import Any

from hpc_tools.runtime.context import RankContext
from hpc_tools.train import loop
from hpc_tools.train.fsdp import parallel
from hpc_tools.train.hf_causal_lm.job import CausalLMJob
from hpc_tools.train.hf_causal_lm.loss import apply_liger
from hpc_tools.train.hf_causal_lm.model import adamw, build_empty
from hpc_tools.train.hf_causal_lm.values import full_values


def run(ctx: RankContext) -> None:
    """Train the recipe on this rank (joins torch.distributed unless the caller already did)."""
    loop.run(ctx, FSDPJob)


class FSDPJob(CausalLMJob):
    """``engine.RankJob`` for FSDP2 / DDP: the Hugging Face causal-LM job with its model sharded or replicated."""

    kind = "fsdp"

    def __init__(self, ctx: RankContext):
        super().__init__(ctx, dp_rank=ctx.rank // ctx.layout.tensor_size)
        self.mesh = parallel.mesh_shape(self.recipe, self.world)
        t0 = time.perf_counter()
        model = build_empty(self.recipe)
        # before compile and sharding: Liger rebinds the blocks' forwards, which the compiled graphs then trace
        self.fused_loss = apply_liger(model, self.recipe, self.device, ctx.info)
        t_model = time.perf_counter() - t0
        self.model = parallel.parallelize(model, self.recipe, self.device, self.world,
                                          fill=full_values(self.recipe, model))
        self.optimizer = adamw(self.model, self.recipe.training)
        ctx.info("model ready in %.1f s (modules %.1f s, then sharded and filled shard by shard; %s)",
                 time.perf_counter() - t0, t_model, self.mesh.describe())
        self.start_data()

    def describe(self) -> str:
        fs = self.recipe.backend.fsdp
        reshard = "" if fs.strategy == "ddp" else f", reshard_after_forward={str(fs.reshard_after_forward).lower()}"
        compiled = ", compiled blocks" if fs.compile else ""
        liger = ", Liger kernels" if self.fused_loss else ""
        return (f"fsdp: {self.layout.describe()}, {self.mesh.describe()}{reshard}, {self.recipe.training.precision}, "
                f"recompute={self.recipe.training.recompute_granularity}{compiled}{liger}, {self.samples}")

    def compute_context(self):
        return parallel.compute_context(self.model, self.recipe, self.device)

    def microbatch_sync(self, last: bool):
        """Gradients reduced only after the step's last microbatch (DDP's ``no_sync`` before it)."""
        return parallel.gradient_sync(self.model, last)

    def meta_extra(self) -> dict[str, Any]:
        return {"strategy": self.recipe.backend.fsdp.strategy, "mesh": [self.mesh.replicate, self.mesh.shard]}
