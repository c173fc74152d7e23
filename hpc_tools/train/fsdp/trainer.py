"""backend.kind: fsdp — ``run(ctx)`` on every rank: a Hugging Face causal LM under FSDP2 or DDP on the shared loop.

One step = ``layout.num_microbatches`` forward/backward passes, the global gradient norm (clipped to
``training.clip_grad``), one torch AdamW step at ``lr_at(step)`` (weight decay on matrices only, as Megatron-core).
``FSDPJob`` is the engine of ``hpc_tools.train.loop`` (which owns records, evaluation and the stop agreement; resume
and saves are ``hpc_tools.train.checkpointing``'s). Data comes from ``hpc_tools.train.data`` (the step is the data
position; the ranks of one tensor-parallel group, consecutive, read the same microbatches: data-parallel rank = rank //
tensor_size); checkpoints are torch Distributed Checkpoint folders (``checkpoint.py``) committed and verified like
every backend's (``hpc_tools.train.checkpointing``).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.runtime.context import RankContext
from hpc_tools.train import loop
from hpc_tools.train.data import build_samples, microbatches_for_step
from hpc_tools.train.engine import StepResult
from hpc_tools.train.fsdp import checkpoint, parallel
from hpc_tools.train.fsdp.model import build_empty, full_values
from hpc_tools.train.hf_causal_lm import apply_liger, forward_loss
from hpc_tools.train.prefetch import BatchPrefetcher, to_device
from hpc_tools.train.schedule import lr_at


def run(ctx: RankContext) -> None:
    """Train the recipe on this rank (joins torch.distributed unless the caller already did)."""
    loop.run(ctx, FSDPJob)


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups as Megatron-core makes them: no weight decay on biases and 1-D parameters (norm weights), so a
    recipe trains alike under either backend."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (plain if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


class FSDPJob:
    """``engine.Engine`` for FSDP2 / DDP: the model, optimizer, data and checkpoints of one run on one rank."""

    checkpoints = True

    def __init__(self, ctx: RankContext):
        import torch

        self.ctx, self.recipe, self.layout = ctx, ctx.recipe, ctx.layout
        self.device = ctx.device
        self.world = ctx.dist.world_size
        self.dp_rank = ctx.rank // self.layout.tensor_size  # TP innermost, as ParallelLayout orders ranks
        self.mesh = parallel.mesh_shape(self.recipe, self.world)
        t0 = time.perf_counter()
        model = build_empty(self.recipe)
        # before compile and sharding: Liger rebinds the blocks' forwards, which the compiled graphs then trace
        self.fused_loss = apply_liger(model, self.recipe, self.device, ctx.info)
        t_model = time.perf_counter() - t0
        self.model = parallel.parallelize(model, self.recipe, self.device, self.world,
                                          fill=full_values(self.recipe, model))
        t = self.recipe.training
        self.optimizer = torch.optim.AdamW(param_groups(self.model, t.weight_decay), lr=t.lr,
                                           betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
        ctx.info("model ready in %.1f s (modules %.1f s, then sharded and filled shard by shard; %s)",
                 time.perf_counter() - t0, t_model, self.mesh.describe())
        self.samples = build_samples(self.recipe)
        on_gpu = self.device.type == "cuda"
        self.prefetch = BatchPrefetcher(self._build_batch, t.train_iters, background=on_gpu, pin=on_gpu)
        self._async = None  # (process group, stager) of the background writes: start_background_writer

    def describe(self) -> str:
        fs = self.recipe.backend.fsdp
        reshard = "" if fs.strategy == "ddp" else f", reshard_after_forward={str(fs.reshard_after_forward).lower()}"
        compiled = ", compiled blocks" if fs.compile else ""
        liger = ", Liger kernels" if self.fused_loss else ""
        return (f"fsdp: {self.layout.describe()}, {self.mesh.describe()}{reshard}, {self.recipe.training.precision}, "
                f"recompute={self.recipe.training.recompute_granularity}{compiled}{liger}, {self.samples}")

    def coords(self) -> dict[str, int]:
        return {"pp_rank": 0, "dp_rank": self.dp_rank}

    # -- one step ------------------------------------------------------------------------------------------------------
    def batch(self, step: int) -> list[dict[str, Any]]:
        return self.prefetch.get(step)

    def _build_batch(self, step: int) -> list[dict[str, Any]]:
        return microbatches_for_step(self.samples, step, self.dp_rank, self.layout)

    def _forward_loss(self, mb: dict[str, Any]):
        with parallel.compute_context(self.model, self.recipe, self.device):
            return forward_loss(self.model, to_device(mb["tokens"], self.device),
                                to_device(mb["labels"], self.device), self.fused_loss)

    def step(self, step: int, batches: list[dict[str, Any]]) -> StepResult:
        """Forward/backward every microbatch, clip, one AdamW step; a step whose loss or gradient norm is not finite
        (the same verdict on every rank: both are global) updates nothing."""
        import torch
        import torch.distributed as dist

        lr = lr_at(self.recipe.training, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        poison = loop.nonfinite_injected(step, self.ctx.rank)
        self.model.train()
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        n = len(batches)
        for i, mb in enumerate(batches):
            with self._microbatch_sync(i == n - 1):
                loss = self._forward_loss(mb)
                if poison:  # loop.INJECT_NONFINITE_ENV (tests only)
                    loss = loss * float("nan")
                (loss / n).backward()
            total += loss.detach().double()
        dist.all_reduce(total)  # every rank saw its own share of the global batch
        mean = total.item() / n / self.world
        self._gradients_reduced()
        norm = parallel.grad_norm(self.model, self.recipe.training.clip_grad)
        nonfinite = not (math.isfinite(mean) and math.isfinite(norm))
        if not nonfinite:
            self._optimizer_step()
        self._zero_grad()
        return StepResult(loss=mean, lr=lr, grad_norm=norm, skipped=True if nonfinite else False,
                               nonfinite=nonfinite)

    # The step's hooks: how gradients are reduced and applied (HorovodJob reduces them through Horovod's optimizer).
    def _microbatch_sync(self, last: bool):
        """Around one microbatch's forward and backward: gradients reduced only after the step's last."""
        return parallel.gradient_sync(self.model, last)

    def _gradients_reduced(self) -> None:
        """After every backward, before the gradient norm: FSDP and DDP have reduced them already."""

    def _optimizer_step(self) -> None:
        self.optimizer.step()

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def evaluate(self, batches: list[list[dict[str, Any]]]) -> float:
        """Validation loss: forward only over each of this rank's microbatches, the mean over microbatches and ranks
        (the same on every rank)."""
        import torch
        import torch.distributed as dist

        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        count = 0
        self.model.eval()
        try:
            with torch.no_grad():
                for mbs in batches:
                    for mb in mbs:
                        total += self._forward_loss(mb).double()
                        count += 1
        finally:
            self.model.train()
        dist.all_reduce(total)
        return total.item() / count / self.world

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def write_checkpoint(self, folder: Path, step: int, background: bool):
        """The saver's write (``engine.Checkpointable``): DCP save of the model and optimizer shards and this rank's
        RNG into ``folder``; ``background``: staged now, written in a background thread over a gloo group of its own
        (``start_background_writer``), returns its ``FutureWrite``."""
        if background:
            self.start_background_writer()
            future = checkpoint.start_async_save(folder, self.model, self.optimizer, self.ctx.rank, *self._async)
            return checkpoint.FutureWrite(future)
        checkpoint.save(folder, self.model, self.optimizer, self.ctx.rank)
        return None

    def start_background_writer(self) -> None:
        """Collective, once: the background writes' own gloo group (their collectives never meet training's) and
        their stager (page-locked buffers on a GPU)."""
        if self._async is None:
            import torch.distributed as dist

            self._async = (dist.new_group(backend="gloo"),
                           checkpoint.async_stager(pin_memory=self.device.type == "cuda"))

    def checkpoint_meta(self, step: int) -> dict[str, Any]:
        return self.meta()

    def meta(self) -> dict[str, Any]:
        r = self.recipe
        return {"backend": "fsdp", "format": "torch_dcp", "strategy": r.backend.fsdp.strategy,
                "mesh": [self.mesh.replicate, self.mesh.shard], "world_size": self.world, "data_step_is_step": True,
                "precision": r.training.precision, "family": r.model.family, "layout": self.layout.describe()}

    def resume(self, source: Path) -> int:
        """Load ``source`` (model, optimizer, this rank's RNG), resharded to this run's ranks; the step it holds."""
        meta = CheckpointDirs.read_meta(source)
        if meta.get("format") != "torch_dcp":
            from hpc_tools.errors import UserError

            raise UserError(f"checkpoint {source} was written by backend {meta.get('backend', '?')}, not as a torch "
                            "Distributed Checkpoint (checkpoint.load_path: give an FSDP checkpoint; to start from "
                            "another backend's weights, `export` it and set checkpoint.init_from_hf)")
        checkpoint.load(source, self.model, self.optimizer, self.ctx.rank)
        return int(meta["step"])

    def close(self) -> None:
        """Release the engine (the loop's ``Saver`` has already waited for or stopped a background write)."""
        if getattr(self, "_async", None) is not None:
            self._async[1].close()
            self._async = None
        if getattr(self, "prefetch", None) is not None:
            self.prefetch.close()
        self.model = self.optimizer = None

