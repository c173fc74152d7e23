"""Megatron-core's distributed optimizer: fp32 main grads reduced (or reduce-scattered) over DP x CP, the optimizer
states sharded when the distributed optimizer is on."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar, Iterator

from hpc_tools.checkpoints.reshard import layout_sizes, why_not
from hpc_tools.planner.arch import (
    Arch,
    pieces,
    stage_split,
)
from hpc_tools.planner.collectives import allreduce_s, gather_s
from hpc_tools.planner.sharding.base import Change, Knobs, Scheme, SchemeKnobs, busiest_split, change, dp_bw

if TYPE_CHECKING:
    from hpc_tools.planner.hardware import Hardware


def megatron_state_bytes(n_params: float, data: int, precision: str,
                         distributed_optimizer: bool) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes on one GPU holding ``n_params`` parameters.

    16-bit training: 2 (16-bit params) + 4 (fp32 main grads) + 12 (fp32 master params, Adam m and v) = 18 bytes/param;
    the distributed optimizer shards the 12 across the data-parallel group: 6 + 12/d. fp32 training: 4 + 4 + 8
    (no master copy) = 16, distributed 8 + 8/d.
    """
    p, g, o = (4, 4, 8) if precision == "fp32" else (2, 4, 12)
    return p * n_params, g * n_params, o * n_params / (data if distributed_optimizer else 1)


@dataclass(frozen=True, slots=True)
class MegatronKnobs(SchemeKnobs):
    """``backend.megatron``'s options that shape the states and the data-parallel traffic; the search turns the
    distributed optimizer and keeps the overlaps as the recipe gives them."""
    distributed_optimizer: bool
    overlap_grad_reduce: bool = field(metadata={"kept": "not turned by the search"})
    overlap_param_gather: bool = field(metadata={"kept": "not turned by the search"})
    elsewhere: ClassVar[dict[str, str]] = {
        "transformer_impl": "the layer code and attention path (Knobs.attention, backends.attention_path)",
        "use_flash_attention": "the attention path (Knobs.flash, Knobs.attention)"}


def _megatron_dp(n: int, k: Knobs, d: int, bw: float, fwd_per_mb: float, bwd_per_mb: float) -> float:
    """Gradient sync in fp32 (main grads); with the distributed optimizer a reduce-scatter of grads and an all-gather
    of 16-bit params. Overlap hides the reduce behind the last microbatch's backward, the gather behind the first
    microbatch's forward (that is where Megatron issues them)."""
    param_bytes, o = (4 if k.precision == "fp32" else 2), k.sharding
    if o.distributed_optimizer:
        reduce, gather = gather_s(4 * n, d, bw), gather_s(param_bytes * n, d, bw)
    else:
        reduce, gather = allreduce_s(4 * n, d, bw), 0.0
    if o.overlap_grad_reduce:
        reduce = max(reduce - bwd_per_mb, 0.0)
    if o.overlap_param_gather:
        gather = max(gather - fwd_per_mb, 0.0)
    return reduce + gather


class DistributedOptimizer(Scheme):
    """Megatron-core's DDP with its distributed optimizer on or off: dense states reduced (and, on, the optimizer
    states sharded) over DP x CP; routed experts' over the expert-data-parallel group."""

    name = "distributed_optimizer"
    knobs = MegatronKnobs
    dimension = ("distributed optimizer", ("distributed_optimizer",))

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        # dense parameters: reduced and (distributed optimizer) sharded over DP x CP; routed experts, split over
        # EP x ETP, over the expert-data-parallel group EDP = world / (PP x ETP x EP)
        lay = k.layout
        dense, expert = stage_split(arch, lay.tensor_size, lay.pipeline_size, stage,
                                    lay.expert_size * lay.expert_tensor_size, k.virtual, lay.first_stage_layers,
                                    lay.last_stage_layers)
        distributed = k.sharding.distributed_optimizer
        params, grads, optim = megatron_state_bytes(dense, lay.dense_grad_size, k.precision, distributed)
        if expert:
            ep, eg, eo = megatron_state_bytes(expert, max(lay.expert_data_size, 1), k.precision, distributed)
            params, grads, optim = params + ep, grads + eg, optim + eo
        return dense + expert, params, grads, optim

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        lay = k.layout
        d = lay.dense_grad_size
        shard = (f" / d (distributed optimizer, d = {'DP x CP = ' if lay.context_size > 1 else ''}{d})"
                 if k.sharding.distributed_optimizer else "")
        if k.precision == "fp32":
            params, grads = "4 bytes/param (fp32)", "4 bytes/param (fp32 main grads)"
            optim = f"8 bytes/param{shard}: Adam m and v; model states {'8 + 8/d' if shard else '16'} bytes/param"
        else:
            params = "2 bytes/param (16-bit)"
            grads = "4 bytes/param: fp32 main grads (Megatron accumulates and reduces in fp32)"
            optim = (f"12 bytes/param{shard}: fp32 master params, Adam m and v; model states "
                     f"{'6 + 12/d' if shard else '18'} bytes/param")
        if arch.moe:
            how = "sharded" if k.sharding.distributed_optimizer else "reduced"
            optim += (f"; routed experts split over EP{lay.expert_size} x ETP{lay.expert_tensor_size} GPUs, their "
                      f"states {how} over EDP = world / (PP x ETP x EP) = {lay.expert_data_size} ranks")
        return params, grads, optim

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        # dense gradients over DP x CP; the routed experts' over the expert-data-parallel group
        lay = k.layout
        m, p = max(lay.num_microbatches, 1), lay.pipeline_size
        dense, expert = busiest_split(arch, k)
        fwd_per_mb, bwd_per_mb = compute / m / 3, 2 * compute / m / 3
        comm = _megatron_dp(dense, k, lay.dense_grad_size, dp_bw(k, hw), fwd_per_mb, bwd_per_mb)
        if expert:
            edp_bw = hw.link_bw(spans_nodes=lay.world_size // p > hw.gpus_per_node)
            comm += _megatron_dp(expert, k, max(lay.expert_data_size, 1), edp_bw, fwd_per_mb, bwd_per_mb)
        if arch.tied and p > 1:  # the two copies of the word embedding all-reduce their gradients (fp32)
            comm += allreduce_s(4 * pieces(arch, lay.tensor_size).word_embedding, 2, hw.link_bw(lay.nodes > 1))
        return comm, 0.0

    def dp_note(self, k: Knobs) -> str:
        return (("dense " if k.moe or k.layout.context_size > 1 else "") + "fp32 grads "
                f"{'reduce-scatter + 16-bit param all-gather' if k.sharding.distributed_optimizer else 'all-reduce'}"
                f"{' (overlapped with the last backward)' if k.sharding.overlap_grad_reduce else ''} at ")

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[MegatronKnobs]:
        yield replace(base.sharding, distributed_optimizer=True)
        if d > 1:
            yield replace(base.sharding, distributed_optimizer=False)

    def describe(self, k: Knobs) -> list[str]:
        return ["distopt" if k.sharding.distributed_optimizer else "no-distopt"]

    def cheap_changes(self, k: Knobs, options: str) -> Iterator[Change]:
        if not k.sharding.distributed_optimizer and k.layout.data_size > 1:
            yield change(k, options, distributed_optimizer=True)

    def carries(self, base: Knobs, cand: Knobs) -> bool:
        """What ``hpc_tools.checkpoints.reshard`` lets Megatron's loader carry (the loader's own rule)."""
        return why_not(*(layout_sizes(k.layout, k.sharding.distributed_optimizer, k.precision)
                         for k in (base, cand))) is None

    def carry_fix(self, k: Knobs) -> str:
        if not k.sharding.distributed_optimizer:
            return ""
        return ", or backend.megatron.distributed_optimizer: false (its checkpoint reshards across data-parallel " \
            "sizes only)"
