"""``CausalLMJob``: what a backend that trains a Hugging Face causal LM with torch's AdamW on the shared loop does the
same whatever spreads the model (FSDP2 / DDP, Horovod): data, one step, evaluation, checkpoints, resume, close.

A backend's job subclasses it, builds ``model`` and ``optimizer`` its way in its ``__init__`` (after
``CausalLMJob.__init__``; then ``start_data``), and overrides only the hooks below; nothing else of a backend's is
reached from here, and no backend's job subclasses another's.

One step = ``layout.num_microbatches`` forward/backward passes, the global gradient norm (clipped to
``training.clip_grad``), one optimizer step at ``lr_at(step)``; a step whose loss or gradient norm is not finite
(the same verdict on every rank: both are global) updates nothing. The loss mean goes over torch.distributed's
group. Data comes from ``hpc_tools.train.data`` (the step is the data position; the ranks of one tensor-parallel
group, consecutive, read the same microbatches: ``dp_rank``); checkpoints are torch Distributed Checkpoint folders
(``checkpoint``) committed and verified by ``hpc_tools.train.checkpointing`` like every backend's.

The hooks (each a no-op or torch's plain call here):

    kind                 the meta file's ``backend``
    background_writes    whether ``checkpoint.async_save`` writes in a background thread (else synchronously)
    compute_context()    around one microbatch's forward (bf16 autocast where the model is fp32)
    microbatch_sync(l)   around one microbatch's forward and backward (``l``: the step's last)
    gradients_reduced()  after every backward, before the gradient norm
    optimizer_step()     the update; ``zero_grad()`` after it
    before_load()        before a checkpoint is read into the model and optimizer
    meta_extra()         the meta file's fields of the backend's own
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, ClassVar

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.runtime.context import RankContext
from hpc_tools.train import loop
from hpc_tools.train.data import build_samples, microbatches_for_step
from hpc_tools.train.engine import StepResult
from hpc_tools.train.hf_causal_lm import checkpoint
from hpc_tools.train.hf_causal_lm.loss import forward_loss
from hpc_tools.train.prefetch import BatchPrefetcher, to_device
from hpc_tools.train.schedule import lr_at


class CausalLMJob:
    """``engine.RankJob`` for a Hugging Face causal LM: everything but how the model is spread and its gradients
    reduced (the subclass's ``__init__`` and hooks)."""

    checkpoints = True
    kind: ClassVar[str]
    background_writes: ClassVar[bool] = True

    def __init__(self, ctx: RankContext, dp_rank: int):
        self.ctx, self.recipe, self.layout = ctx, ctx.recipe, ctx.layout
        self.device = ctx.device
        self.world = ctx.dist.world_size
        self.dp_rank = dp_rank
        self.model = self.optimizer = self.prefetch = None
        self.fused_loss = False
        self._async = None  # (process group, stager) of the background writes: start_background_writer

    def start_data(self) -> None:
        """The run's samples and the batch prefetcher (a background thread with pinned batches on a GPU)."""
        self.samples = build_samples(self.recipe)
        on_gpu = self.device.type == "cuda"
        self.prefetch = BatchPrefetcher(self._build_batch, self.recipe.training.train_iters, background=on_gpu,
                                        pin=on_gpu)

    # -- the hooks -----------------------------------------------------------------------------------------------------
    def compute_context(self):
        return contextlib.nullcontext()

    def microbatch_sync(self, last: bool):
        return contextlib.nullcontext()

    def gradients_reduced(self) -> None:
        """Nothing to wait for where the backward has reduced the gradients already."""

    def optimizer_step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def before_load(self) -> None:
        """Nothing: torch's optimizer makes its states itself when a checkpoint is loaded."""

    def meta_extra(self) -> dict[str, Any]:
        return {}

    # -- one step ------------------------------------------------------------------------------------------------------
    def coords(self) -> dict[str, int]:
        return {"pp_rank": 0, "dp_rank": self.dp_rank}

    def batch(self, step: int) -> list[dict[str, Any]]:
        return self.prefetch.get(step)

    def _build_batch(self, step: int) -> list[dict[str, Any]]:
        return microbatches_for_step(self.samples, step, self.dp_rank, self.layout)

    def forward_loss(self, mb: dict[str, Any]):
        with self.compute_context():
            return forward_loss(self.model, to_device(mb["tokens"], self.device),
                                to_device(mb["labels"], self.device), self.fused_loss)

    def step(self, step: int, batches: list[dict[str, Any]]) -> StepResult:
        """Forward/backward every microbatch, clip, one optimizer step; a non-finite step updates nothing."""
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
            with self.microbatch_sync(i == n - 1):
                loss = self.forward_loss(mb)
                if poison:  # loop.INJECT_NONFINITE_ENV (tests only)
                    loss = loss * float("nan")
                (loss / n).backward()
            total += loss.detach().double()
        dist.all_reduce(total)  # every rank saw its own share of the global batch
        mean = total.item() / n / self.world
        self.gradients_reduced()
        norm = grad_norm(self.model, self.recipe.training.clip_grad)
        nonfinite = not (math.isfinite(mean) and math.isfinite(norm))
        if not nonfinite:
            self.optimizer_step()
        self.zero_grad()
        return StepResult(loss=mean, lr=lr, grad_norm=norm, skipped=nonfinite, nonfinite=nonfinite)

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
                        total += self.forward_loss(mb).double()
                        count += 1
        finally:
            self.model.train()
        dist.all_reduce(total)
        return total.item() / count / self.world

    # -- checkpoints ---------------------------------------------------------------------------------------------------
    def write_checkpoint(self, folder: Path, step: int, background: bool):
        """The saver's write (``engine.Checkpointable``): DCP save of the model and optimizer shards and this rank's
        RNG into ``folder``; ``background`` (and ``background_writes``): staged now, written in a background thread
        over a gloo group of its own (``start_background_writer``), returns its ``FutureWrite``."""
        if background and self.background_writes:
            self.start_background_writer()
            future = checkpoint.start_async_save(folder, self.model, self.optimizer, self.ctx.rank, *self._async)
            return checkpoint.FutureWrite(future)
        checkpoint.save(folder, self.model, self.optimizer, self.ctx.rank)
        return None

    def start_background_writer(self) -> None:
        """Collective, once: the background writes' own gloo group (their collectives never meet training's) and
        their stager (page-locked buffers on a GPU); nothing where the job writes synchronously."""
        if self._async is None and self.background_writes:
            import torch.distributed as dist

            self._async = (dist.new_group(backend="gloo"),
                           checkpoint.async_stager(pin_memory=self.device.type == "cuda"))

    def checkpoint_meta(self, step: int) -> dict[str, Any]:
        return self.meta()

    def meta(self) -> dict[str, Any]:
        r = self.recipe
        return {"backend": self.kind, "format": "torch_dcp", **self.meta_extra(), "world_size": self.world,
                "data_step_is_step": True, "precision": r.training.precision, "family": r.model.family,
                "layout": self.layout.describe()}

    def resume(self, source: Path) -> int:
        """Load ``source`` (model, optimizer, this rank's RNG), resharded to this run's ranks; the step it holds."""
        meta = CheckpointDirs.read_meta(source)
        if meta.get("format") != "torch_dcp":
            from hpc_tools.errors import UserError

            raise UserError(f"checkpoint {source} was written by backend {meta.get('backend', '?')}, not as a torch "
                            f"Distributed Checkpoint (checkpoint.load_path: give a Distributed Checkpoint, as this "
                            f"{self.kind} run writes; to start from another backend's weights, `export` it and set "
                            "checkpoint.init_from_hf)")
        self.before_load()
        checkpoint.load(source, self.model, self.optimizer, self.ctx.rank)
        return int(meta["step"])

    def close(self) -> None:
        """Release the job (the loop's ``Saver`` has already waited for or stopped a background write)."""
        if self._async is not None:
            self._async[1].close()
            self._async = None
        if self.prefetch is not None:
            self.prefetch.close()
        self.model = self.optimizer = None


def grad_norm(model, max_norm: float) -> float:
    """Clip the global gradient norm to ``max_norm`` (0: no clipping) and return it before clipping: a collective
    over the shards for FSDP2 (DTensor gradients), local where every rank holds the whole (all-reduced) gradients.
    Under FSDP x TP the blocks' gradients live on the 2-D mesh and the root's on its ``shard`` dimension: one norm
    per mesh, combined."""
    import torch

    params = [p for p in model.parameters() if p.grad is not None]
    by_mesh: dict[Any, list] = {}
    for p in params:
        by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    for group in by_mesh.values():  # one foreach multiply per mesh: DTensor ops take one mesh
        torch.nn.utils.clip_grads_with_norm_(group, max_norm if max_norm > 0 else float("inf"), total)
    return float(total)
