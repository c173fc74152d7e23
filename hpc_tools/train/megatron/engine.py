"""One rank's share of a Megatron-core job: parallel state, model chunks, optimizer, and one training step.

Independent of the run folder and the launcher, so that a test can build engines for many layouts in one process
group (``MegatronCore(...)`` ... ``engine.close()`` re-initialises Megatron's parallel state each time).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpc_tools.train import groups
from hpc_tools.train.loop import StepResult, nonfinite_injected
from hpc_tools.train.megatron.schedule import apply_lr
from hpc_tools.train.prefetch import to_device
from hpc_tools.train.schedule import lr_at

# What megatron-core's DistributedDataParallel.no_sync reads when it exits (megatron/core/distributed/
# distributed_data_parallel.py, 0.16): kept as empty lists by ``_release_model``.
_NO_SYNC_ATTRS = ("bucket_groups", "expert_parallel_bucket_groups")

if TYPE_CHECKING:
    from datetime import timedelta

    import torch

    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.schema import Recipe


@dataclass(frozen=True, slots=True)
class Coords:
    tp_rank: int
    pp_rank: int
    dp_rank: int
    is_last_stage: bool
    ep_rank: int = 0
    cp_rank: int = 0


def init_parallel(layout: "ParallelLayout", seed: int, timeout: "timedelta | None" = None) -> Coords:
    """Megatron's process groups for this layout (torch.distributed must be up) and its seeded RNG streams.

    ``timeout`` (``RankContext.collective_timeout``) goes to every group Megatron creates, as to the world's: left at
    megatron-core's 30 minutes (``parallel_state.initialize_model_parallel``), a hang during load or the first step
    would abort inside NCCL before the hang watchdog names the culprit (cluster.hang_timeout_min)."""
    from megatron.core import parallel_state as ps

    sizes = layout.megatron_sizes()
    if timeout is not None:
        sizes["distributed_timeout_minutes"] = timeout.total_seconds() / 60
    ps.initialize_model_parallel(**sizes)
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    ep_rank, etp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    seed_streams(seed, pp_rank, tp_rank, ep_rank=ep_rank, etp_rank=etp_rank)
    return Coords(tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=ps.get_data_parallel_rank(),
                  is_last_stage=ps.is_pipeline_last_stage(ignore_virtual=True), ep_rank=ep_rank,
                  cp_rank=ps.get_context_parallel_rank())


def stage_seed(seed: int, pp_rank: int) -> int:
    """Megatron-LM's convention (``_set_random_seed``): every pipeline stage its own seed, ``seed + 100 * pp_rank``."""
    return seed + 100 * pp_rank


def seed_streams(seed: int, pp_rank: int, tp_rank: int | None = None, *, ep_rank: int | None = None,
                 etp_rank: int | None = None) -> None:
    """Seed this rank's CPU generator and megatron-core's CUDA streams (the default CUDA generator and the tracker's
    data-parallel, tensor-parallel and expert streams; the tracker adds the TP-rank offset to the tensor-parallel
    one and ``100 x ep_rank + etp_rank`` to the expert one) from the stage's seed.

    The ranks given are passed on; one left out is read from megatron's parallel state. ``init_parallel`` passes the
    real expert-parallel rank, so each EP rank draws its own experts' weights (and expert dropout) from its own
    stream, the same along the expert-data-parallel group.

    Both get the stage seed: on a GPU (``use_cpu_initialization=False``) the weights are drawn from the CUDA streams,
    so a seed without the stage offset would give every pipeline stage the same initial weights. On CPU the weights
    come from the CPU generator, seeded as before."""
    import torch
    from megatron.core import tensor_parallel

    torch.manual_seed(stage_seed(seed, pp_rank))
    given = {"tp_rank": tp_rank, "ep_rank": ep_rank, "etp_rank": etp_rank}
    ranks = {k: v for k, v in given.items() if v is not None}
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed(seed, pp_rank), **ranks)


class MegatronCore:
    """This rank's megatron-core objects for one layout: model chunks + optimizer + forward/backward schedule
    (``MegatronJob`` wraps it for the loop).

    ``device`` is the rank's torch device (``RankContext.device``; a string such as ``"cpu"`` is accepted);
    ``timeout`` the process groups' (``RankContext.collective_timeout``; None: megatron-core's default).
    """

    def __init__(self, recipe: "Recipe", layout: "ParallelLayout", device: "torch.device | str" = "cpu", *,
                 timeout: "timedelta | None" = None):
        import torch

        if torch.device(device).type == "cpu":
            from hpc_tools.train.megatron import cpu_compat

            cpu_compat.import_megatron()  # first: without the GPU-only imports it would pull in
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from hpc_tools.train.megatron.config import fusion_notes, optimizer_config, transformer_config
        from hpc_tools.train.megatron.layers import attention_environment_check, layer_plan
        from hpc_tools.train.megatron.model import build_chunks

        self.device = torch.device(device)
        device_type = self.device.type
        if device_type == "cpu":
            from hpc_tools.train.megatron import cpu_compat

            if torch.cuda.is_available():  # Megatron would put its buffers on the GPU beside CPU params
                from hpc_tools.errors import UserError

                raise UserError("cluster.gpu_type=cpu but this node has CUDA GPUs: Megatron-core ranks use the GPU "
                                "when torch sees one (set cluster.gpu_type to the GPU model, e.g. H100-SXM)")
            cpu_compat.install()
        self.recipe, self.layout, self.device_type = recipe, layout, device_type
        self.plan = layer_plan(recipe, device_type)  # fails here, before any model is built, when a GPU lacks TE
        attention_environment_check(self.plan, os.environ)  # an NVTE_*_ATTN megatron-core would assert on
        self.notes = fusion_notes(recipe, device_type)  # what this node's missing fusions cost; told at start
        self._groups_before = groups.snapshot()  # ended in close(): a harness runs many engines in one world
        self.coords = init_parallel(layout, recipe.training.seed, timeout)
        self.config = transformer_config(recipe, layout, device_type, self.plan)
        self.chunks = build_chunks(recipe, layout, self.config, device_type)
        self.optimizer = get_megatron_optimizer(optimizer_config(recipe), self.chunks)
        self._wire_config(finalize_model_grads)
        self.forward_backward = get_forward_backward_func()
        self.skipped_steps = 0
        self.router = None
        if self.config.num_moe_experts:
            from hpc_tools.train.megatron.router_load import RouterLoad

            self.router = RouterLoad(self.chunks, self.config, layout.data_size, self.device)
        self._router_figures: dict[str, Any] | None = None

    def router_load(self) -> dict[str, Any] | None:
        """The router figures of the latest training step (``router_load.RouterLoad``), None without experts."""
        return self._router_figures

    def _wire_config(self, finalize_model_grads) -> None:
        # The hooks the schedules call: grad sync across DP, loss scaling, and (with overlap) bucket syncs.
        c, chunks, mg = self.config, self.chunks, self.recipe.backend.megatron
        c.no_sync_func = [m.no_sync for m in chunks] if len(chunks) > 1 else chunks[0].no_sync
        c.finalize_model_grads_func = finalize_model_grads
        c.grad_scale_func = self.optimizer.scale_loss
        if mg.overlap_grad_reduce:
            c.grad_sync_func = [m.start_grad_sync for m in chunks] if len(chunks) > 1 else chunks[0].start_grad_sync
        if mg.overlap_param_gather:
            c.param_sync_func = [m.start_param_sync for m in chunks] if len(chunks) > 1 else chunks[0].start_param_sync

    # -- one step ---------------------------------------------------------------------------------------------------
    def train_step(self, step: int, microbatches: list[dict[str, Any]]) -> StepResult:
        """Forward/backward over this rank's microbatches, then the optimizer step with lr_at(step).

        The loss is the mean over the global batch, the same on every rank (see ``_global_loss``)."""
        import torch

        t = self.recipe.training
        lr = lr_at(t, step)
        apply_lr(self.optimizer, lr, t.weight_decay)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = [self._on_this_cp_rank(self._prepare(b, self.device)) for b in microbatches]
        if nonfinite_injected(step, torch.distributed.get_rank()):
            batches = [{**b, "poison": True} for b in batches]
        iterators = [iter(batches) for _ in self.chunks]  # every virtual stage walks the same microbatches
        losses = self.forward_backward(
            forward_step_func=self._forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.chunks if len(self.chunks) > 1 else self.chunks[0], num_microbatches=len(batches),
            seq_length=self.recipe.model.seq_length, micro_batch_size=self.layout.micro_batch_size,
            forward_only=False)
        router = self.router.step_tensor(len(batches)) if self.router is not None else None
        # One host read for all: the loss, the all-reduced non-finite flag and the router figures come back together
        # (float64: the token counts stay exact; a float32 loss widens exactly).
        parts = [self._global_loss_tensor(losses), self._nonfinite_flag(losses)]
        if router is not None:
            parts.append(router)
        loss, bad, *figures = torch.cat([t.double() for t in parts]).tolist()
        if router is not None:
            self._router_figures = self.router.figures(figures)
        if bad > 0:
            # Skipped before the optimizer sees the gradients: no update, no Adam step, the weights stay finite.
            self.skipped_steps += 1
            return StepResult(loss=loss, grad_norm=None, lr=lr, skipped=True, nonfinite=True,
                              figures=self._record_figures())
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            self.skipped_steps += 1
        grad_norm = None if grad_norm is None else float(grad_norm)
        return StepResult(loss=loss, grad_norm=grad_norm, lr=lr, skipped=not ok,
                          nonfinite=grad_norm is not None and not math.isfinite(grad_norm),
                          figures=self._record_figures())

    def _record_figures(self) -> dict[str, Any] | None:
        """The router figures of this step as step-record fields (``profiling.schema``), None without experts."""
        r = self._router_figures
        if r is None:
            return None
        import json

        return {"moe_aux_loss": r["moe_aux_loss"], "moe_load_imbalance": r["moe_load_imbalance"],
                "moe_tokens_per_expert": json.dumps(r["moe_tokens_per_expert"], separators=(",", ":"))}

    def _nonfinite_flag(self, losses: list[dict]):
        """1.0 when any rank saw a non-finite loss or gradient this step, else 0.0: a one-element tensor on the
        device, all-reduced (the same everywhere), read by the caller together with the loss.

        The gradients are checked in this rank's grad buffers after the data-parallel reduction. With fp16,
        Megatron's own check (the loss scaler's found_inf, all-reduced by the optimizer) handles gradient overflow:
        it skips the update and lowers the scale, which is normal fp16 training and not counted here; megatron DDP's
        check_for_nan_in_grad would raise instead of skipping, so it stays off (``config.ddp_config``)."""
        import torch

        bad = torch.zeros(1, dtype=torch.float32, device=self.device)
        own = [d["lm loss"].float().reshape(1) for d in losses]  # this rank's microbatch losses (last stage)
        if own:
            bad += (~torch.isfinite(torch.cat(own)).all()).float()
        if self.recipe.training.precision != "fp16":
            sums = [t.sum(dtype=torch.float32) for t in self._grad_tensors()]
            if sums:  # a sum is inf/nan when an element is (no buffer-sized temporary, no host sync)
                bad += (~torch.isfinite(torch.stack(sums)).all()).float()
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return bad

    def _grad_tensors(self) -> list:
        """This rank's gradients: megatron DDP's contiguous grad buffers, else each parameter's gradient."""
        out = []
        for chunk in self.chunks:
            buffers = getattr(chunk, "buffers", None)  # DDP's attribute (a list), not nn.Module.buffers()
            if isinstance(buffers, list):
                out += [b.grad_data for b in buffers + list(getattr(chunk, "expert_parallel_buffers", []))]
            else:
                out += [g for p in chunk.parameters() if (g := getattr(p, "main_grad", p.grad)) is not None]
        return out

    @staticmethod
    def _prepare(batch: dict[str, Any], device) -> dict[str, Any]:
        import torch

        tokens = batch["tokens"]
        # Batches are built on the host: a GPU rank copies them from page-locked memory (prefetch.to_device)
        out = {"tokens": to_device(tokens, device), "labels": to_device(batch["labels"], device)}
        # Positions are made on the device that uses them: one row viewed once per sample (stride 0), which
        # pin_memory refuses ("more than one element of the written-to tensor refers to a single memory location",
        # the first step of every GPU run when they were made on the host) and which needs no copy at all.
        out["position_ids"] = torch.arange(tokens.shape[1], dtype=torch.long, device=device).unsqueeze(0).expand(
            tokens.shape)
        return out

    def _on_this_cp_rank(self, batch: dict[str, Any]) -> dict[str, Any]:
        """This context-parallel rank's share of a microbatch (every rank of the CP group gets the whole sequence):
        megatron-core's load-balanced split (``megatron.core.utils.get_batch_on_this_cp_rank``, as Megatron-LM's
        ``get_batch``): the sequence in 2 x CP chunks, rank r keeping chunks r and 2 CP - 1 - r, so that under the
        causal mask every rank attends over the same number of key/value pairs. Position ids are split with the
        tokens (the learned position embedding reads them; RoPE splits its own table the same way). Unchanged
        without CP."""
        if self.layout.context_size == 1:
            return batch
        from megatron.core.utils import get_batch_on_this_cp_rank

        return get_batch_on_this_cp_rank(dict(batch))

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        cp = self.layout.context_size

        def loss_func(per_token_loss):
            # Under CP each rank holds 1/CP of the sequence: its mean / CP is its share of the sequence mean. The
            # schedule multiplies the loss by CP before backward and the gradient reduction divides by DP x CP,
            # so the gradient is the sequence mean's; the reported shares add up over the CP group
            # (``_global_loss_tensor``).
            loss = per_token_loss.float().mean() / cp
            if batch.get("poison"):  # loop.INJECT_NONFINITE_ENV (tests only)
                loss = loss * float("nan")
            # Megatron's schedule divides the returned loss tensor in place (by the number of microbatches) before
            # backward; the reported value is a detached copy taken before that, so it stays the microbatch mean.
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def _global_loss(self, losses: list[dict]) -> float:
        """``_global_loss_tensor`` read to the host."""
        return float(self._global_loss_tensor(losses))

    def _global_loss_tensor(self, losses: list[dict]):
        """Mean over microbatches, context-parallel shares and data-parallel ranks, computed on the last stage (the
        same on every layout) and broadcast along the pipeline, so every rank's record and rank 0's progress line
        carry the loss: a one-element tensor on the device."""
        import torch
        from megatron.core import parallel_state as ps

        loss = torch.zeros(1, dtype=torch.float32, device=self.device)
        if self.coords.is_last_stage and losses:
            loss = torch.stack([d["lm loss"].float() for d in losses]).mean().reshape(1).to(self.device)
            if self.layout.data_size * self.layout.context_size > 1:
                # summed over the CP shares of each sequence (loss_func), averaged over the data-parallel replicas
                torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group(with_context_parallel=True))
                loss /= self.layout.data_size
        if self.layout.pipeline_size > 1:
            torch.distributed.broadcast(loss, src=ps.get_pipeline_model_parallel_last_rank(),
                                        group=ps.get_pipeline_model_parallel_group())
        return loss

    def evaluate(self, batches: list[list[dict[str, Any]]]) -> float:
        """Validation loss: forward only (eval mode, no grad) over each entry of ``batches`` (one global batch's
        microbatches of this rank), through the same schedule as training (``forward_only=True``: pipeline stages
        pass activations, no backward); the mean over them of each one's global-batch loss, broadcast from the last
        stage like the training loss: the same on every rank."""
        import torch

        for chunk in self.chunks:
            chunk.eval()
        losses = []
        try:
            with torch.no_grad():
                for microbatches in batches:
                    prepared = [self._on_this_cp_rank(self._prepare(b, self.device)) for b in microbatches]
                    iterators = [iter(prepared) for _ in self.chunks]
                    out = self.forward_backward(
                        forward_step_func=self._forward_step,
                        data_iterator=iterators if len(iterators) > 1 else iterators[0],
                        model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                        num_microbatches=len(prepared), seq_length=self.recipe.model.seq_length,
                        micro_batch_size=self.layout.micro_batch_size, forward_only=True)
                    losses.append(self._global_loss(out))
        finally:
            for chunk in self.chunks:
                chunk.train()
        return sum(losses) / len(losses)

    def close(self) -> None:
        """Tear down Megatron's parallel state (the torch.distributed world stays up)."""
        from megatron.core import parallel_state as ps

        if self.router is not None:
            self.router.close()
        self._release_model()
        ps.destroy_model_parallel()
        groups.destroy_since(self._groups_before)

    def _release_model(self) -> None:
        """Let go of the model, its optimizer and their process groups.

        Megatron's DDP registers a gradient hook on each parameter's autograd accumulator node, and the hook's closure
        holds the DDP wrapper; those nodes live in C++, where Python's cycle collector cannot see them, so a closed
        model (and every process group its modules refer to, each with its own gloo threads) would otherwise live
        until the process ends. Emptying each module's attributes cuts every edge from the wrapper to the model, the
        buffers and the groups; the empty wrapper is all that stays behind. The engine is not used after close.

        A step that raised (a peer died in a collective) leaves Megatron's schedule inside the wrapper's ``no_sync``:
        the schedule enters that context by hand and exits it only when the step ends, so its generator is finalized
        later, when the traceback is freed, and its ``finally`` walks the wrapper's bucket groups. Empty lists in
        their place let it end quietly, instead of an AttributeError printed as the peer's last words."""
        for chunk in self.chunks:
            modules = list(chunk.modules())
            for module in modules:
                kept = {k: [] for k in _NO_SYNC_ATTRS if k in module.__dict__}
                module.__dict__.clear()
                module.__dict__.update(kept)
        self.chunks, self.optimizer = [], None
        self.config.no_sync_func = self.config.grad_scale_func = None  # bound methods of the model and optimizer
