"""PyTorch FSDP2: full_shard, HSDP (hybrid_shard) or DDP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

from hpc_tools.planner.arch import (
    Arch,
    fsdp_parameters,
    pieces,
)
from hpc_tools.planner.collectives import allreduce_s, gather_s
from hpc_tools.planner.sharding.base import Change, Knobs, Scheme, SchemeKnobs, change

if TYPE_CHECKING:
    from hpc_tools.planner.hardware import Hardware


UNSHARDED = "FSDP unsharded parameters and gradients"  # a memory term of its own


@dataclass(frozen=True, slots=True)
class FsdpKnobs(SchemeKnobs):
    """``backend.fsdp``'s sharding options."""
    strategy: str  # full_shard | hybrid_shard | ddp
    reshard_after_forward: bool
    shard_size: int | None  # hybrid_shard: ranks per shard group (None: GPUs per node)
    elsewhere: ClassVar[dict[str, str]] = {
        "compile": "the default efficiency (backends.compiled)",
        "liger": "not modelled (Liger's fused kernels)"}

    def option_updates(self) -> dict[str, Any]:
        """shard_size is written only where it means something (hybrid_shard), else null."""
        hybrid = self.strategy == "hybrid_shard"
        return {**SchemeKnobs.option_updates(self), "shard_size": self.shard_size if hybrid else None}


def shard_group(k: Knobs) -> int:
    """Ranks one copy of the model states is sharded over (full_shard: every data-parallel rank; ddp: 1)."""
    f, lay = k.sharding, k.layout
    if f.strategy == "ddp":
        return 1
    if f.strategy == "hybrid_shard":
        return min(f.shard_size or lay.ranks_per_node, lay.data_size)
    return lay.data_size


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
    if k.sharding.strategy == "ddp":
        return 0.0 if k.precision == "fp32" else e * (arch.layers * pc.layer + root)
    blocks = 2 if k.sharding.reshard_after_forward else arch.layers
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
    if k.sharding.strategy == "ddp":
        reduce = allreduce_s(4 * n, d, hw.link_bw(spans_nodes=d > hw.gpus_per_node))
        return max(reduce - bwd, reduce / units)
    shard = shard_group(k)
    e = 4 if k.precision == "fp32" else 2
    inner = hw.link_bw(spans_nodes=shard * k.layout.tensor_size > hw.gpus_per_node)  # TP groups inside a node
    gather, scatter = gather_s(e * n, shard, inner), gather_s(4 * n, shard, inner)
    replicas = allreduce_s(4 * n / shard, d // shard, hw.link_bw(spans_nodes=d > hw.gpus_per_node))
    forward, backward = gather, (gather if k.sharding.reshard_after_forward else 0.0) + scatter + replicas
    return m * (max(forward - fwd, forward / units) + max(backward - bwd, backward / units))


class Fsdp(Scheme):
    """PyTorch FSDP2: parameters, gradients and optimizer states sharded over the shard group (full_shard: every
    data-parallel rank; hybrid_shard: a node-sized group, replicated across the others, HSDP), or DDP replicas."""

    name = "fsdp"
    knobs = FsdpKnobs
    dimension = ("FSDP strategy and reshard_after_forward", ("strategy", "reshard_after_forward"))

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        n = fsdp_parameters(arch, k.layout.tensor_size)
        return n, *fsdp_state_bytes(n, shard_group(k))

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        return {UNSHARDED: fsdp_unsharded_bytes(arch, k)}

    def held(self, k: Knobs, stage_params: int) -> float:
        return stage_params / shard_group(k)

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        sg, d = shard_group(k), k.layout.data_size
        over = {"ddp": f"DDP: every one of the {d} ranks a full copy",
                "full_shard": f"FSDP2 full_shard: sharded over all S = d = {d} ranks"}.get(
            k.sharding.strategy, f"HSDP: sharded over S = {sg} ranks, {d // sg} replica groups")
        params = f"4 bytes/param{'' if sg == 1 else f' / {sg}'}: fp32 parameters (the master copy; {over})"
        grads = f"4 bytes/param{'' if sg == 1 else f' / {sg}'}: fp32 gradients (reduced in fp32)"
        optim = f"8 bytes/param{'' if sg == 1 else f' / {sg}'}: Adam m and v; model states 16Ψ/S"
        return params, grads, optim

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        cd = "fp32" if k.precision == "fp32" else "bf16"
        held = ("2 blocks (in use + prefetched)" if k.sharding.reshard_after_forward
                else "every block (reshard_after_forward false)")
        return {UNSHARDED: (("bf16 copies of the weights autocast caches in the forward" if cd == "bf16" else
                             "none (fp32 DDP computes on its own parameters)") if k.sharding.strategy == "ddp" else
                            f"{cd} parameters of {held}"
                            f" + the root's (embeddings, final norm, output layer) + one block's unsharded gradient "
                            "before its reduce-scatter")}

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        n = fsdp_parameters(arch, k.layout.tensor_size)
        return _fsdp_comm(arch, n, k, hw, max(k.layout.num_microbatches, 1), compute), 0.0

    def dp_note(self, k: Knobs) -> str:
        strategy = k.sharding.strategy
        if strategy == "ddp":
            return "DDP: fp32 gradient all-reduce once per step, bucketed behind the last backward (exposed: the " \
                   "excess, at least one block's bucket) at "
        again = " and again before its backward" if k.sharding.reshard_after_forward else ""
        hsdp = f" + fp32 all-reduce of the gradient shard across {k.layout.data_size // shard_group(k)} replica " \
               "groups" if strategy == "hybrid_shard" else ""
        return (f"FSDP2 per block and microbatch: parameter all-gather before its forward{again}, fp32 gradient "
                f"reduce-scatter after its backward, over {shard_group(k)} ranks{hsdp}; prefetched behind the "
                "neighbouring block's compute (exposed: the first unit's, or the excess over compute) at ")

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[FsdpKnobs]:
        for reshard in (True, False):
            yield FsdpKnobs("full_shard", reshard, None)
            node = base.layout.ranks_per_node
            if t == 1 and d > node and d % node == 0:
                yield FsdpKnobs("hybrid_shard", reshard, None)
        if t == 1:  # FSDP x TP is full_shard over the data-parallel ranks only
            yield FsdpKnobs("ddp", True, None)

    def describe(self, k: Knobs) -> list[str]:
        s, d, f = shard_group(k), k.layout.data_size, k.sharding
        parts = [{"ddp": "ddp", "full_shard": "fsdp"}.get(f.strategy, f"hsdp{d // s}x{s}")]
        if f.strategy != "ddp":
            parts.append("reshard" if f.reshard_after_forward else "no-reshard")
        return parts

    def changes(self, k: Knobs, options: str) -> Iterator[Change]:
        f = k.sharding
        if f.strategy != "full_shard" and k.layout.data_size > 1:
            yield change(k, options, strategy="full_shard", shard_size=None)
        if f.strategy != "ddp" and not f.reshard_after_forward:
            yield change(k, options, reshard_after_forward=True)

    def carries(self, base: Knobs, cand: Knobs) -> bool:
        """DCP reshards parameters and optimizer state across any world size: the same strategy is enough."""
        return cand.sharding.strategy == base.sharding.strategy
