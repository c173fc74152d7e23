"""Sharding schemes: how a backend holds its model states across the data-parallel ranks, one class per scheme.

A scheme owns everything in the planner that depends on it: the state bytes of one GPU (parameters, gradients,
optimizer states, and its own working terms and buffers: ``memory.stage_memory``), its data-parallel traffic per
step (``steptime.estimate_step_time``), the lines that say what those terms assume (``memory_notes``,
``time_notes``), the knobs the search turns (``search.enumerate_knobs``), the single changes ``validate`` suggests
(``fit``), and how a configuration names its knobs (``Knobs.describe``) and writes them back to the backend's options
section (``Knobs.overrides``).

    distributed_optimizer   Megatron-core: fp32 main grads reduced (or reduce-scattered) over DP x CP, the
                            optimizer states sharded when the distributed optimizer is on
    zero                    DeepSpeed ZeRO stages 0-3 with optional CPU offload (Rajbhandari et al. 2019)
    fsdp                    PyTorch FSDP2: full_shard, HSDP (hybrid_shard) or DDP
    horovod                 Horovod's DistributedOptimizer: DDP's memory, ring all-reduce of (compressed) gradients

Which backend uses which scheme is written once, in the backend table (``hpc_tools.backends.Backend.sharding``); the
planner looks the scheme up by that name (``Knobs.scheme``), so a new backend with an existing scheme is a new row
there and touches no planner file. Formulas and sources: docs/formulas.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol

from hpc_tools import backends
from hpc_tools.planner.arch import (
    Arch,
    busiest_moe_stage,
    fsdp_parameters,
    pieces,
    stage_parameters,
    stage_split,
)
from hpc_tools.planner.collectives import allreduce_s, gather_s

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.planner.hardware import Hardware

# memory terms of a scheme's own, beside parameters / gradients / optimizer states
GATHERED = "ZeRO-3 gathered parameters"
UNSHARDED = "FSDP unsharded parameters and gradients"
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed CPU-Adam throughput per rank (assumed; ZeRO-Offload reports ~1 s per 1B)



class Knobs(Protocol):
    """What a scheme reads of a configuration: ``hpc_tools.planner.knobs.Knobs`` (not imported: that module looks its
    scheme up here), the layout and precision every scheme reads, then each scheme's own knobs."""
    layout: "ParallelLayout"
    precision: str
    moe: bool
    distributed_optimizer: bool  # distributed_optimizer
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    zero_stage: int  # zero
    offload_optimizer: str
    offload_param: str
    ds_overlap_comm: bool
    ds_bucket_elems: int
    fsdp_strategy: str  # fsdp
    fsdp_shard_size: int | None
    fsdp_reshard: bool
    hvd_compression: str  # horovod
    hvd_fusion_mb: int

    @property
    def virtual(self) -> int: ...

    @property
    def shard_group(self) -> int: ...


Change = tuple[list[str], Knobs]  # ``--set`` strings and the configuration they make (``fit``)


class Scheme:
    """What the planner asks a sharding scheme. ``k`` is the configuration (``Knobs``) being planned."""

    name: ClassVar[str]
    """The backend table's ``sharding`` value."""
    dimension: ClassVar[tuple[str, tuple[str, ...]]]
    """What the search turns for it: the label users read and the ``Knobs`` attributes (``planner/dimensions.py``)."""

    # --- memory -----------------------------------------------------------------------------------------------------
    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        """(parameters of the stage one GPU computes with, parameter, gradient, optimizer bytes on one GPU)."""
        raise NotImplementedError

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        """Memory terms of its own (gathered or unsharded copies), after the activations."""
        return {}

    def bucket_bytes(self, k: Knobs, n_params: int) -> float:
        """Communication buffers beyond NCCL's own."""
        return 0.0

    def held(self, k: Knobs, stage_params: int) -> float:
        """The parameters one GPU keeps of the ``stage_params`` it computes with (sharded schemes: a 1/S share)."""
        return stage_params

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        """What the parameter, gradient and optimizer terms assume."""
        raise NotImplementedError

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        """What ``working_terms`` assume, by term."""
        return {}

    def bucket_note(self, k: Knobs) -> str:
        """Appended to the communication-buffer line."""
        return ""

    def moments_on_gpu(self, k: Knobs) -> bool:
        """The fp32 optimizer moments live in GPU memory (so storing them in BF16 would save some)."""
        return True

    # --- step time --------------------------------------------------------------------------------------------------
    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        """(exposed data-parallel communication, offload) seconds per step; ``compute``: the step's compute."""
        raise NotImplementedError

    def dp_note(self, k: Knobs) -> str:
        """The data-parallel line up to its bandwidth (``... at ``)."""
        raise NotImplementedError

    def offload_note(self, k: Knobs, hw: "Hardware") -> str:
        return "no offload"

    # --- knobs ------------------------------------------------------------------------------------------------------
    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[dict[str, Any]]:
        """The knob settings the search tries on a TP ``t`` x PP ``p`` x DP ``d`` layout (``overlap``: the recipe's
        DeepSpeed overlap_comm, None where it sets none)."""
        raise NotImplementedError

    def describe(self, k: Knobs) -> list[str]:
        """Its part of ``Knobs.describe``."""
        raise NotImplementedError

    def option_updates(self, k: Knobs) -> dict[str, Any]:
        """Its knobs as fields of the backend's own options section."""
        raise NotImplementedError

    def cheap_changes(self, k: Knobs, options: str) -> Iterator[Change]:
        """Single changes that cost (almost) no step time, tried before any relayout (``options``: the backend's
        options section, ``backend.<name>``)."""
        return iter(())

    def changes(self, k: Knobs, options: str) -> Iterator[Change]:
        """Single changes of its knobs, tried after the relayouts and before a deeper pipeline."""
        return iter(())


def _dp_bw(k: Knobs, hw: "Hardware") -> float:
    lay = k.layout
    return hw.link_bw(spans_nodes=lay.tensor_size * lay.context_size * lay.data_size > hw.gpus_per_node)


def _busiest_split(arch: Arch, k: Knobs) -> tuple[int, int]:
    """(dense, expert) parameters of the pipeline stage that holds the most (first, last or the busiest MoE stage)."""
    lay, v = k.layout, k.virtual
    t, p = lay.tensor_size, lay.pipeline_size
    shards = lay.expert_size * lay.expert_tensor_size
    first, last = lay.first_stage_layers, lay.last_stage_layers
    busiest = busiest_moe_stage(arch, p, v, first, last)
    stages = {0, p - 1} | ({busiest} if busiest is not None else set())
    return max((stage_split(arch, t, p, s, shards, v, first, last) for s in stages), key=sum)


# --- Megatron-core's distributed optimizer ---------------------------------------------------------------------------

def megatron_state_bytes(n_params: float, data: int, precision: str,
                         distributed_optimizer: bool) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes on one GPU holding ``n_params`` parameters.

    16-bit training: 2 (16-bit params) + 4 (fp32 main grads) + 12 (fp32 master params, Adam m and v) = 18 bytes/param;
    the distributed optimizer shards the 12 across the data-parallel group: 6 + 12/d. fp32 training: 4 + 4 + 8
    (no master copy) = 16, distributed 8 + 8/d.
    """
    p, g, o = (4, 4, 8) if precision == "fp32" else (2, 4, 12)
    return p * n_params, g * n_params, o * n_params / (data if distributed_optimizer else 1)


def _megatron_dp(n: int, k: Knobs, d: int, bw: float, fwd_per_mb: float, bwd_per_mb: float) -> float:
    """Gradient sync in fp32 (main grads); with the distributed optimizer a reduce-scatter of grads and an all-gather
    of 16-bit params. Overlap hides the reduce behind the last microbatch's backward, the gather behind the first
    microbatch's forward (that is where Megatron issues them)."""
    param_bytes = 4 if k.precision == "fp32" else 2
    if k.distributed_optimizer:
        reduce, gather = gather_s(4 * n, d, bw), gather_s(param_bytes * n, d, bw)
    else:
        reduce, gather = allreduce_s(4 * n, d, bw), 0.0
    if k.overlap_grad_reduce:
        reduce = max(reduce - bwd_per_mb, 0.0)
    if k.overlap_param_gather:
        gather = max(gather - fwd_per_mb, 0.0)
    return reduce + gather


class DistributedOptimizer(Scheme):
    """Megatron-core's DDP with its distributed optimizer on or off: dense states reduced (and, on, the optimizer
    states sharded) over DP x CP; routed experts' over the expert-data-parallel group."""

    name = "distributed_optimizer"
    dimension = ("distributed optimizer", ("distributed_optimizer",))

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        # dense parameters: reduced and (distributed optimizer) sharded over DP x CP; routed experts, split over
        # EP x ETP, over the expert-data-parallel group EDP = world / (PP x ETP x EP)
        lay = k.layout
        dense, expert = stage_split(arch, lay.tensor_size, lay.pipeline_size, stage,
                                    lay.expert_size * lay.expert_tensor_size, k.virtual, lay.first_stage_layers,
                                    lay.last_stage_layers)
        params, grads, optim = megatron_state_bytes(dense, lay.dense_grad_size, k.precision, k.distributed_optimizer)
        if expert:
            ep, eg, eo = megatron_state_bytes(expert, max(lay.expert_data_size, 1), k.precision,
                                              k.distributed_optimizer)
            params, grads, optim = params + ep, grads + eg, optim + eo
        return dense + expert, params, grads, optim

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        lay = k.layout
        d = lay.dense_grad_size
        shard = (f" / d (distributed optimizer, d = {'DP x CP = ' if lay.context_size > 1 else ''}{d})"
                 if k.distributed_optimizer else "")
        if k.precision == "fp32":
            params, grads = "4 bytes/param (fp32)", "4 bytes/param (fp32 main grads)"
            optim = f"8 bytes/param{shard}: Adam m and v; model states {'8 + 8/d' if shard else '16'} bytes/param"
        else:
            params = "2 bytes/param (16-bit)"
            grads = "4 bytes/param: fp32 main grads (Megatron accumulates and reduces in fp32)"
            optim = (f"12 bytes/param{shard}: fp32 master params, Adam m and v; model states "
                     f"{'6 + 12/d' if shard else '18'} bytes/param")
        if arch.moe:
            optim += (f"; routed experts split over EP{lay.expert_size} x ETP{lay.expert_tensor_size} GPUs, their "
                      f"states{' sharded' if k.distributed_optimizer else ' reduced'} over EDP = world / (PP x ETP x "
                      f"EP) = {lay.expert_data_size} ranks")
        return params, grads, optim

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        # dense gradients over DP x CP; the routed experts' over the expert-data-parallel group
        lay = k.layout
        m, p = max(lay.num_microbatches, 1), lay.pipeline_size
        dense, expert = _busiest_split(arch, k)
        fwd_per_mb, bwd_per_mb = compute / m / 3, 2 * compute / m / 3
        comm = _megatron_dp(dense, k, lay.dense_grad_size, _dp_bw(k, hw), fwd_per_mb, bwd_per_mb)
        if expert:
            edp_bw = hw.link_bw(spans_nodes=lay.world_size // p > hw.gpus_per_node)
            comm += _megatron_dp(expert, k, max(lay.expert_data_size, 1), edp_bw, fwd_per_mb, bwd_per_mb)
        if arch.tied and p > 1:  # the two copies of the word embedding all-reduce their gradients (fp32)
            comm += allreduce_s(4 * pieces(arch, lay.tensor_size).word_embedding, 2, hw.link_bw(lay.nodes > 1))
        return comm, 0.0

    def dp_note(self, k: Knobs) -> str:
        return (("dense " if k.moe or k.layout.context_size > 1 else "") + "fp32 grads "
                f"{'reduce-scatter + 16-bit param all-gather' if k.distributed_optimizer else 'all-reduce'}"
                f"{' (overlapped with the last backward)' if k.overlap_grad_reduce else ''} at ")

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[dict[str, Any]]:
        yield {"distributed_optimizer": True}
        if d > 1:
            yield {"distributed_optimizer": False}

    def describe(self, k: Knobs) -> list[str]:
        return ["distopt" if k.distributed_optimizer else "no-distopt"]

    def option_updates(self, k: Knobs) -> dict[str, Any]:
        return {"distributed_optimizer": k.distributed_optimizer}

    def cheap_changes(self, k: Knobs, options: str) -> Iterator[Change]:
        if not k.distributed_optimizer and k.layout.data_size > 1:
            yield [f"{options}.distributed_optimizer=true"], replace(k, distributed_optimizer=True)


# --- DeepSpeed ZeRO --------------------------------------------------------------------------------------------------

def zero_state_bytes(n_params: float, data: int, stage: int, precision: str = "bf16",
                     offload_optimizer: str = "none", offload_param: str = "none") -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per GPU under DeepSpeed ZeRO (Rajbhandari et al. 2019).

    Mixed precision: 2 + 2 + K with K = 12; stage 1 shards the optimizer (4Ψ + 12Ψ/N), stage 2 also the gradients
    (2Ψ + 14Ψ/N), stage 3 also the parameters (16Ψ/N). fp32: 4 + 4 + 8. Offloaded states leave the GPU.
    """
    p, g, o = (4, 4, 8) if precision == "fp32" else (2, 2, 12)
    params = p * n_params / (data if stage >= 3 else 1)
    grads = g * n_params / (data if stage >= 2 else 1)
    optim = o * n_params / (data if stage >= 1 else 1)
    if offload_optimizer != "none":
        optim = 0.0
    if offload_param != "none":
        params = 0.0
    return params, grads, optim


def _zero_comm(n: int, k: Knobs, d: int, m: int, bw: float, host_bw: float) -> tuple[float, float]:
    """(collective seconds, offload seconds) per step under ZeRO. Stage 0: all-reduce of 16-bit grads at the step;
    1: reduce-scatter + all-gather at the step (the same 2Ψ as data parallelism, ZeRO paper); 2: a reduce-scatter
    every microbatch + the all-gather; 3: two all-gathers (forward, backward) and a reduce-scatter every microbatch
    (3Ψ per microbatch)."""
    g = 4 if k.precision == "fp32" else 2
    grads = g * n
    comm = {0: allreduce_s(grads, d, bw), 1: 2 * gather_s(grads, d, bw),
            2: m * gather_s(grads, d, bw) + gather_s(grads, d, bw), 3: 3 * m * gather_s(grads, d, bw)}[k.zero_stage]
    offload = 0.0
    shard = n / d if k.zero_stage >= 1 else n
    if k.offload_optimizer != "none":  # gradients down, updated parameters up, Adam on the CPU
        offload += 2 * g * shard / host_bw + shard / CPU_ADAM_PARAMS_PER_S
    if k.offload_param != "none":  # every microbatch fetches the parameter partition for forward and backward
        offload += 2 * m * g * shard / host_bw
    return comm, offload


class Zero(Scheme):
    """DeepSpeed ZeRO: stage 1 shards the optimizer states over the data-parallel ranks, 2 also the gradients, 3 also
    the parameters (gathered per module for use); the optimizer states and parameters can be offloaded to the CPU."""

    name = "zero"
    dimension = ("ZeRO stage and offload", ("zero_stage", "offload_optimizer", "offload_param", "ds_overlap_comm"))

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        lay = k.layout
        n = stage_parameters(arch, lay.tensor_size, lay.pipeline_size, stage, first=lay.first_stage_layers,
                             last=lay.last_stage_layers)
        return n, *zero_state_bytes(n, lay.data_size, k.zero_stage, k.precision, k.offload_optimizer,
                                    k.offload_param)

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        """ZeRO-3 gathers each module's full 16-bit parameters to use them: the current layer plus one prefetched, or
        the whole word embedding, whichever is larger."""
        if k.zero_stage != 3:
            return {}
        pc = pieces(arch, 1)
        return {GATHERED: (4 if k.precision == "fp32" else 2) * max(2 * pc.layer, pc.word_embedding)}

    def bucket_bytes(self, k: Knobs, n_params: int) -> float:
        """DeepSpeed's reduce bucket (zero_optimization.reduce_bucket_size elements of the gradient dtype)."""
        return (4 if k.precision == "fp32" else 2) * min(k.ds_bucket_elems, n_params)

    def held(self, k: Knobs, stage_params: int) -> float:
        return stage_params / k.layout.data_size if k.zero_stage == 3 else stage_params

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        n = f" / N (N = d = {k.layout.data_size})"
        p16 = "4" if k.precision == "fp32" else "2"
        params = f"{p16} bytes/param{n if k.zero_stage >= 3 else ''} (ZeRO-{k.zero_stage})"
        grads = (f"{p16} bytes/param{n if k.zero_stage >= 2 else ''} "
                 f"(ZeRO-{k.zero_stage}; 16-bit grads as in the ZeRO paper)")
        optim = (f"{'8' if k.precision == 'fp32' else '12'} bytes/param{n if k.zero_stage >= 1 else ''}: "
                 f"{'' if k.precision == 'fp32' else 'fp32 master, '}Adam m and v (ZeRO paper K)")
        if k.offload_optimizer != "none":
            optim = f"offloaded to {k.offload_optimizer} (0 on the GPU; host holds the shard)"
        if k.offload_param != "none":
            params = f"offloaded to {k.offload_param} (0 on the GPU; see gathered parameters)"
        total = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[k.zero_stage]
        grads += f"; model states {total}" if k.precision != "fp32" else ""
        return params, grads, optim

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        if k.zero_stage != 3:
            return {}
        return {GATHERED: "16-bit parameters of the current and one prefetched layer (or the whole embedding)"}

    def bucket_note(self, k: Knobs) -> str:
        return f" + DeepSpeed reduce bucket {k.ds_bucket_elems:.3g} elements"

    def moments_on_gpu(self, k: Knobs) -> bool:
        return k.offload_optimizer == "none"

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        lay = k.layout
        m = max(lay.num_microbatches, 1)
        comm, offload = _zero_comm(sum(_busiest_split(arch, k)), k, lay.data_size, m, _dp_bw(k, hw), hw.host_bw)
        hidden = (compute if k.zero_stage == 3 else 2 * compute / 3) if k.ds_overlap_comm else 0.0
        return max(comm - hidden, 0.0), offload

    def dp_note(self, k: Knobs) -> str:
        return f"ZeRO-{k.zero_stage} collectives at "

    def offload_note(self, k: Knobs, hw: "Hardware") -> str:
        if k.offload_optimizer == "none" and k.offload_param == "none":
            return "no offload"
        return f"PCIe {hw.host_bw / 1e9:.0f} GB/s, CPU Adam {CPU_ADAM_PARAMS_PER_S:.0e} params/s per rank (assumed)"

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[dict[str, Any]]:
        for stage in (0, 1, 2, 3):
            if p > 1 and stage >= 2:
                continue  # DeepSpeed refuses ZeRO-2/3 with its pipeline
            yield {"zero_stage": stage, "offload_optimizer": "none", "offload_param": "none",
                   "ds_overlap_comm": stage == 3 if overlap is None else bool(overlap)}
            if stage >= 1:
                yield {"zero_stage": stage, "offload_optimizer": "cpu", "offload_param": "none",
                       "ds_overlap_comm": stage == 3 if overlap is None else bool(overlap)}
            if stage == 3:
                yield {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu",
                       "ds_overlap_comm": True if overlap is None else bool(overlap)}

    def describe(self, k: Knobs) -> list[str]:
        return [f"zero{k.zero_stage}", f"opt->{k.offload_optimizer}", f"param->{k.offload_param}"]

    def option_updates(self, k: Knobs) -> dict[str, Any]:
        return {"zero_stage": k.zero_stage, "offload_optimizer": k.offload_optimizer, "offload_param": k.offload_param}

    def changes(self, k: Knobs, options: str) -> Iterator[Change]:
        for stage in range(k.zero_stage + 1, 4):
            if k.layout.pipeline_size == 1 or stage <= 1:
                yield [f"{options}.zero_stage={stage}"], replace(k, zero_stage=stage, ds_overlap_comm=stage == 3)
        if k.zero_stage >= 1 and k.offload_optimizer == "none":
            yield [f"{options}.offload_optimizer=cpu"], replace(k, offload_optimizer="cpu")


# --- PyTorch FSDP2 / HSDP / DDP --------------------------------------------------------------------------------------

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


# --- Horovod ----------------------------------------------------------------------------------------------------------

HVD_COPIES = "autocast and compression copies"


class Horovod(Scheme):
    """Horovod's DistributedOptimizer: every rank a full copy of the model states (DDP's memory), the gradients
    ring-all-reduced once per step (``backward_passes_per_step`` = the microbatches) in fused buffers of
    ``backend.horovod.fusion_threshold_mb``, issued by Horovod's background thread as the last backward produces them
    (Sergeev and Del Balso, "Horovod: fast and easy distributed deep learning in TensorFlow", arXiv:1802.05799);
    ``compression: fp16`` halves the bytes on the wire. No knob for the search: compression changes the numbers and
    the fusion buffer only the buffer term, so both stay as the recipe gives them."""

    name = "horovod"
    dimension = ("Horovod (nothing to turn)", ())

    def states(self, arch: Arch, k: Knobs, stage: int) -> tuple[int, float, float, float]:
        n = fsdp_parameters(arch, 1)
        return n, *fsdp_state_bytes(n, 1)

    def working_terms(self, arch: Arch, k: Knobs) -> dict[str, float]:
        n = fsdp_parameters(arch, 1)
        return {HVD_COPIES: (2 * n if k.precision != "fp32" else 0.0) + (2 * n if k.hvd_compression == "fp16" else 0.0)}

    def bucket_bytes(self, k: Knobs, n_params: int) -> float:
        """The fusion buffer: Horovod allocates HOROVOD_FUSION_THRESHOLD bytes once, at the first fused all-reduce."""
        return k.hvd_fusion_mb * 2.0 ** 20

    def state_notes(self, arch: Arch, k: Knobs) -> tuple[str, str, str]:
        d = k.layout.data_size
        return (f"4 bytes/param: fp32 parameters (every one of the {d} ranks a full copy, as DDP)",
                "4 bytes/param: fp32 gradients (p.grad, all-reduced in place after the last microbatch)",
                "8 bytes/param: Adam m and v; model states 16 bytes/param, as DDP")

    def working_notes(self, arch: Arch, k: Knobs) -> dict[str, str]:
        parts = ["bf16 copies of the weights autocast caches in the forward (2 bytes/param)"
                 if k.precision != "fp32" else "no autocast copies (fp32)"]
        parts.append("fp16 copies of every gradient until the all-reduce ends (2 bytes/param)"
                     if k.hvd_compression == "fp16" else "no compression copies")
        return {HVD_COPIES: "; ".join(parts)}

    def bucket_note(self, k: Knobs) -> str:
        return f" + Horovod's fusion buffer {k.hvd_fusion_mb} MiB (backend.horovod.fusion_threshold_mb)"

    def dp_time(self, arch: Arch, k: Knobs, hw: "Hardware", compute: float) -> tuple[float, float]:
        """Ring all-reduce of the gradients (2(d-1)/d of their bytes per rank) once per step, overlapped with the last
        microbatch's backward as DDP's buckets are; exposed: the excess, at least one block's share."""
        n, d, m = fsdp_parameters(arch, 1), k.layout.data_size, max(k.layout.num_microbatches, 1)
        wire = 2 if k.hvd_compression == "fp16" else 4
        reduce = allreduce_s(wire * n, d, hw.link_bw(spans_nodes=d > hw.gpus_per_node))
        return max(reduce - 2 * compute / m / 3, reduce / (arch.layers + 1)), 0.0

    def dp_note(self, k: Knobs) -> str:
        wire = "fp16-compressed" if k.hvd_compression == "fp16" else "fp32"
        return (f"Horovod: ring all-reduce of the {wire} gradients once per step, fused up to {k.hvd_fusion_mb} MiB "
                "and issued as the last backward produces them (exposed: the excess, at least one block's share) at ")

    def options(self, base: Knobs, t: int, p: int, d: int, overlap: bool | None) -> Iterator[dict[str, Any]]:
        yield {}

    def describe(self, k: Knobs) -> list[str]:
        return ["hvd" + ("-fp16" if k.hvd_compression == "fp16" else "")]

    def option_updates(self, k: Knobs) -> dict[str, Any]:
        return {"compression": k.hvd_compression, "fusion_threshold_mb": k.hvd_fusion_mb}


SCHEMES: dict[str, Scheme] = {s.name: s for s in (DistributedOptimizer(), Zero(), Fsdp(), Horovod())}
# backend kind -> its scheme, for the kinds that train a model (asked per scored candidate: one dict lookup)
_BY_KIND: dict[str, Scheme] = {b.kind: SCHEMES[b.sharding] for b in backends.BACKENDS.values() if b.sharding}


def of(kind: str) -> Scheme:
    """The sharding scheme of backend ``kind`` (its row's ``sharding``)."""
    return _BY_KIND[kind]


def dimensions() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each scheme's search dimension, labelled with the backend kinds that use it: ``ZeRO stage ... (deepspeed)``."""
    return tuple((f"{s.dimension[0]} ({', '.join(b.kind for b in backends.BACKENDS.values() if b.sharding == name)})",
                  s.dimension[1]) for name, s in SCHEMES.items() if s.dimension[1])  # Horovod turns nothing
