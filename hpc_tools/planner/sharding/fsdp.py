"""PyTorch FSDP2: full_shard, HSDP (hybrid_shard) or DDP."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator

from hpc_tools.planner.arch import (
    Arch,
    fsdp_parameters,
    pieces,
)
from hpc_tools.planner.collectives import allreduce_s, gather_s
from hpc_tools.planner.sharding.base import Change, Knobs, Scheme

if TYPE_CHECKING:
    from hpc_tools.planner.hardware import Hardware


UNSHARDED = "FSDP unsharded parameters and gradients"  # a memory term of its own


def fsdp_state_bytes(n_params: float, shard: int) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per GPU under PyTorch FSDP2 / HSDP / DDP with AdamW.

    FSDP2 keeps the fp32 parameters (the master copy: ``MixedPrecisionPolicy`` casts only the gathered copy to
    bf16), their fp32 gradients (reduced in fp32) and Adam's m and v sharded over the shard group S: 4 + 4 + 8 =
    16 bytes/param / S, in fp32 and bf16 alike (full_shard: S = d; hybrid_shard: S = the shard group; DDP: S = 1,
    gradients as bucket views, no second copy).
    """
    return 4 * n_params / shard, 4 * n_params / shard, 8 * n_params / shard


def fsdp_unsharded_bytes(arch: Arch, k: Knobs) -> float:
    """What FSDP2 gathers on top of the shards: the compute-dtype parameters of the block in use and the one
    prefetched (reshard_after_forward; else every block's, kept from its forward to its backward), the root's
    (embeddings, final norm, output layer: kept for the whole step), and one block's unsharded gradient before its
    reduce-scatter (fp32, plus the compute-dtype copy autograd produced). DDP under bf16 autocast: the weights' bf16
    copies autocast caches during the forward."""
    pc, layer = pieces(arch, 1), pieces(arch, k.layout.tensor_size).layer  # FSDP x TP: a block's TP share
    e = 4 if k.precision == "fp32" else 2
    root = pc.word_embedding + pc.position_embedding + pc.final_norm + pc.output_layer
    if k.fsdp_strategy == "ddp":
        return 0.0 if k.precision == "fp32" else e * (arch.layers * pc.layer + root)
    blocks = 2 if k.fsdp_reshard else arch.layers
    grad = (4 + (e if e != 4 else 0)) * layer
    return e * (min(blocks, arch.layers) * layer + root) + grad


def _fsdp_comm(arch: Arch, n: int, k: Knobs, hw: "Hardware", m: int, compute: float) -> float:
    """Exposed seconds of FSDP's collectives per step.

    DDP: one all-reduce of the fp32 gradients per step (``no_sync`` for the other microbatches), in buckets
    overlapped with the last microbatch's backward; exposed: what exceeds that backward, at least the last bucket
    (~ one block). full_shard / hybrid_shard, every microbatch: an all-gather of the compute-dtype parameters before
    each block's forward and (reshard_after_forward) again before its backward, a reduce-scatter of its fp32
    gradients after it, inside the shard group S; HSDP adds an all-reduce of the fp32 gradient shard (Ψ/S) across
    the d/S replica groups. FSDP2 prefetches the next block's all-gather while this one computes, so per phase the
    exposed part is the first unit's collective (1/(L+1) of the phase's) or whatever exceeds the phase's compute."""
    d = k.layout.data_size
    fwd, bwd = compute / m / 3, 2 * compute / m / 3
    units = arch.layers + 1
    if k.fsdp_strategy == "ddp":
        reduce = allreduce_s(4 * n, d, hw.link_bw(spans_nodes=d > hw.gpus_per_node))
        return max(reduce - bwd, reduce / units)
    shard = k.shard_group
    e = 4 if k.precision == "fp32" else 2
    inner = hw.link_bw(spans_nodes=shard * k.layout.tensor_size > hw.gpus_per_node)  # TP groups inside a node
    gather, scatter = gather_s(e * n, shard, inner), gather_s(4 * n, shard, inner)
    replicas = allreduce_s(4 * n / shard, d // shard, hw.link_bw(spans_nodes=d > hw.gpus_per_node))
    forward, backward = gather, (gather if k.fsdp_reshard else 0.0) + scatter + replicas
    return m * (max(forward - fwd, forward / units) + max(backward - bwd, backward / units))


class Fsdp(Scheme):
    """PyTorch FSDP2: parameters, gradients and optimizer states sharded over the shard group (full_shard: every
    data-parallel rank; hybrid_shard: a node-sized group, replicated across the others, HSDP), or DDP replicas."""

    name = "fsdp"
    dimension = ("FSDP strategy and reshard_after_forward", ("fsdp_strategy", "fsdp_reshard"))

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        n = fsdp_parameters(arch, k.layout.tensor_size)
        return n, *fsdp_state_bytes(n, k.shard_group)

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        return {UNSHARDED: fsdp_unsharded_bytes(arch, k)}

    def held(self, k: Knobs, stage_params: int) -> float:
        return stage_params / k.shard_group

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        sg, d = k.shard_group, k.layout.data_size
        over = {"ddp": f"DDP: every one of the {d} ranks a full copy",
                "full_shard": f"FSDP2 full_shard: sharded over all S = d = {d} ranks"}.get(
            k.fsdp_strategy, f"HSDP: sharded over S = {sg} ranks, {d // sg} replica groups")
        params = f"4 bytes/param{'' if sg == 1 else f' / {sg}'}: fp32 parameters (the master copy; {over})"
        grads = f"4 bytes/param{'' if sg == 1 else f' / {sg}'}: fp32 gradients (reduced in fp32)"
        optim = f"8 bytes/param{'' if sg == 1 else f' / {sg}'}: Adam m and v; model states 16Ψ/S"
        return params, grads, optim

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        cd = "fp32" if k.precision == "fp32" else "bf16"
        held = "2 blocks (in use + prefetched)" if k.fsdp_reshard else "every block (reshard_after_forward false)"
        return {UNSHARDED: (("bf16 copies of the weights autocast caches in the forward" if cd == "bf16" else
                             "none (fp32 DDP computes on its own parameters)") if k.fsdp_strategy == "ddp" else
                            f"{cd} parameters of {held}"
                            f" + the root's (embeddings, final norm, output layer) + one block's unsharded gradient "
                            "before its reduce-scatter")}

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        n = fsdp_parameters(arch, k.layout.tensor_size)
        return _fsdp_comm(arch, n, k, hw, max(k.layout.num_microbatches, 1), compute), 0.0

    def dp_note(self, k: Knobs) -> str:
        if k.fsdp_strategy == "ddp":
            return "DDP: fp32 gradient all-reduce once per step, bucketed behind the last backward (exposed: the " \
                   "excess, at least one block's bucket) at "
        again = " and again before its backward" if k.fsdp_reshard else ""
        hsdp = f" + fp32 all-reduce of the gradient shard across {k.layout.data_size // k.shard_group} replica " \
               "groups" if k.fsdp_strategy == "hybrid_shard" else ""
        return (f"FSDP2 per block and microbatch: parameter all-gather before its forward{again}, fp32 gradient "
                f"reduce-scatter after its backward, over {k.shard_group} ranks{hsdp}; prefetched behind the "
                "neighbouring block's compute (exposed: the first unit's, or the excess over compute) at ")

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[dict[str, Any]]:
        for reshard in (True, False):
            yield {"fsdp_strategy": "full_shard", "fsdp_shard_size": None, "fsdp_reshard": reshard}
            node = base.layout.ranks_per_node
            if t == 1 and d > node and d % node == 0:
                yield {"fsdp_strategy": "hybrid_shard", "fsdp_shard_size": None, "fsdp_reshard": reshard}
        if t == 1:  # FSDP x TP is full_shard over the data-parallel ranks only
            yield {"fsdp_strategy": "ddp", "fsdp_shard_size": None, "fsdp_reshard": True}

    def describe(self, k: Knobs) -> list[str]:
        s, d = k.shard_group, k.layout.data_size
        parts = [{"ddp": "ddp", "full_shard": "fsdp"}.get(k.fsdp_strategy, f"hsdp{d // s}x{s}")]
        if k.fsdp_strategy != "ddp":
            parts.append("reshard" if k.fsdp_reshard else "no-reshard")
        return parts

    def option_updates(self, k: Knobs) -> dict[str, Any]:
        return {"strategy": k.fsdp_strategy, "reshard_after_forward": k.fsdp_reshard,
                "shard_size": k.fsdp_shard_size if k.fsdp_strategy == "hybrid_shard" else None}

    def changes(self, k: Knobs, options: str) -> Iterator[Change]:
        if k.fsdp_strategy != "full_shard" and k.layout.data_size > 1:
            yield ([f"{options}.strategy=full_shard", f"{options}.shard_size=null"],
                   replace(k, fsdp_strategy="full_shard", fsdp_shard_size=None))
        if k.fsdp_strategy != "ddp" and not k.fsdp_reshard:
            yield [f"{options}.reshard_after_forward=true"], replace(k, fsdp_reshard=True)

    def carries(self, base: Knobs, cand: Knobs) -> bool:
        """DCP reshards parameters and optimizer state across any world size: the same strategy is enough."""
        return cand.fsdp_strategy == base.fsdp_strategy
