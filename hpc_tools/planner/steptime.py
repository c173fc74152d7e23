"""Step time: compute at a fraction of peak, plus communication over the hardware table's bus bandwidths, plus the
pipeline bubble. Gives predicted tokens/s and MFU.

    compute = hardware FLOPs per GPU / (peak x efficiency)      FLOPs from profiling.flops (its owner)
    bubble  = compute x (p-1)/(v m)                              ParallelLayout.bubble_fraction
    comm    = bytes x nccl-tests bus factor / busbw              all-reduce 2(n-1)/n, all-gather/reduce-scatter (n-1)/n

The efficiency factor is what calibration fits per cluster (``calibrate.py``); it absorbs kernel efficiency, small
GEMMs and everything the model leaves out. Communication is assumed exposed unless the recipe turns on an overlap
the framework really performs (Megatron overlap_grad_reduce / overlap_param_gather, DeepSpeed overlap_comm, FSDP2's
per-block prefetch and DDP's bucketed all-reduce, both always on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_tools.planner.arch import Arch, fsdp_parameters, pieces, stage_parameters
from hpc_tools.planner.hardware import Hardware
from hpc_tools.planner.knobs import Knobs

if TYPE_CHECKING:
    from hpc_tools.recipe.model import ModelConfig

DEFAULT_EFFICIENCY = 0.6  # fraction of dense peak the GEMM-bound compute reaches (calibrate to replace it)
CPU_ADAM_PARAMS_PER_S = 1e9  # DeepSpeed CPU-Adam throughput per rank (assumed; ZeRO-Offload reports ~1 s per 1B)

COMPUTE, BUBBLE, TP_COMM, PP_COMM, DP_COMM, OFFLOAD = (
    "compute", "pipeline bubble", "tensor-parallel comm", "pipeline p2p", "data-parallel comm (exposed)",
    "offload (PCIe + CPU Adam)")


@dataclass(frozen=True, slots=True)
class StepTime:
    terms: dict[str, float]  # seconds per step
    model_flops: float  # whole job, one step
    hardware_flops: float
    tokens_per_step: int
    world: int
    peak_flops: float

    @property
    def total_s(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total_s

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total_s * self.world * self.peak_flops)


def step_flops(model_cfg: "ModelConfig", k: Knobs, convention: str) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step, over the vocabulary the job pads to."""
    from profiling.flops import hardware_flops_per_step, model_flops_per_step

    vocab = model_cfg.padded_vocab_size(k.layout.tensor_size) if k.row.pads_vocab else model_cfg.vocab_size
    recompute = "none" if not k.row.selective_recompute and k.recompute == "selective" else k.recompute
    batch = k.layout.global_batch_size
    return (model_flops_per_step(model_cfg, batch, convention=convention, vocab_size=vocab),
            hardware_flops_per_step(model_cfg, batch, recompute, convention=convention, vocab_size=vocab))


def _allreduce(nbytes: float, n: int, bw: float) -> float:
    return nbytes * 2 * (n - 1) / n / bw if n > 1 else 0.0


def _gather(nbytes: float, n: int, bw: float) -> float:
    """All-gather or reduce-scatter of a ``nbytes`` buffer (the full, unsharded size)."""
    return nbytes * (n - 1) / n / bw if n > 1 else 0.0


def estimate_step_time(arch: Arch, k: Knobs, hw: Hardware, flops: tuple[float, float],
                       efficiency: float = DEFAULT_EFFICIENCY) -> StepTime | None:
    """Seconds per step, term by term; None when the peak FLOP/s is unknown (CPU ranks, GPU not in the table)."""
    if not hw.peak_flops:
        return None
    lay = k.layout
    t, p, d, m, v = lay.tensor_size, lay.pipeline_size, lay.data_size, max(lay.num_microbatches, 1), k.virtual
    model_flops, hardware_flops = flops
    tok = arch.seq * lay.micro_batch_size
    e = k.act_bytes
    compute = hardware_flops / lay.world_size / (hw.peak_flops * efficiency)
    terms = {COMPUTE: compute, BUBBLE: compute * lay.bubble_fraction}

    # TP: per layer and microbatch 2 all-reduces forward and 2 backward of b s h (SP: all-gather + reduce-scatter
    # pairs, same bus bytes) = 8 b s h (t-1)/t elements (Narayanan et al.); full recompute repeats the forward's 2.
    collectives = 6 if k.recompute == "full" else 4
    tp_bw = hw.link_bw(spans_nodes=t > hw.gpus_per_node)
    terms[TP_COMM] = collectives * _allreduce(e * tok * arch.hidden, t, tp_bw) * (arch.layers // p) * m

    # PP: each microbatch crosses each stage boundary forward (activations) and backward (their gradients), v times
    # when interleaved; b s h per message (b s h / t with SP). Taken as exposed (the send of one microbatch is on the
    # critical path of the next stage).
    msg = e * tok * arch.hidden / (t if lay.sequence_parallel else 1)
    pp_bw = hw.link_bw(spans_nodes=lay.nodes > 1)
    terms[PP_COMM] = 2 * m * v * msg / pp_bw if p > 1 else 0.0

    n = (fsdp_parameters(arch, t) if k.fsdp
         else max(stage_parameters(arch, t, p, 0), stage_parameters(arch, t, p, p - 1)))
    dp_bw = hw.link_bw(spans_nodes=t * d > hw.gpus_per_node)
    fwd_per_mb, bwd_per_mb = compute / m / 3, 2 * compute / m / 3
    if k.fsdp:
        terms[DP_COMM] = _fsdp_comm(arch, n, k, hw, m, compute)
        terms[OFFLOAD] = 0.0
    elif not k.zero:
        terms[DP_COMM] = _megatron_dp(n, k, d, dp_bw, fwd_per_mb, bwd_per_mb)
        if arch.tied and p > 1:  # the two copies of the word embedding all-reduce their gradients (fp32)
            terms[DP_COMM] += _allreduce(4 * pieces(arch, t).word_embedding, 2, hw.link_bw(lay.nodes > 1))
        terms[OFFLOAD] = 0.0
    else:
        comm, offload = _zero_comm(n, k, d, m, dp_bw, hw.host_bw)
        hidden = (compute if k.zero_stage == 3 else 2 * compute / 3) if k.ds_overlap_comm else 0.0
        terms[DP_COMM] = max(comm - hidden, 0.0)
        terms[OFFLOAD] = offload
    return StepTime(terms, model_flops, hardware_flops, lay.global_batch_size * arch.seq, lay.world_size,
                    hw.peak_flops)


def _megatron_dp(n: int, k: Knobs, d: int, bw: float, fwd_per_mb: float, bwd_per_mb: float) -> float:
    """Gradient sync in fp32 (main grads); with the distributed optimizer a reduce-scatter of grads and an all-gather
    of 16-bit params. Overlap hides the reduce behind the last microbatch's backward, the gather behind the first
    microbatch's forward (that is where Megatron issues them)."""
    param_bytes = 4 if k.precision == "fp32" else 2
    if k.distributed_optimizer:
        reduce, gather = _gather(4 * n, d, bw), _gather(param_bytes * n, d, bw)
    else:
        reduce, gather = _allreduce(4 * n, d, bw), 0.0
    if k.overlap_grad_reduce:
        reduce = max(reduce - bwd_per_mb, 0.0)
    if k.overlap_param_gather:
        gather = max(gather - fwd_per_mb, 0.0)
    return reduce + gather


def _fsdp_comm(arch: Arch, n: int, k: Knobs, hw: Hardware, m: int, compute: float) -> float:
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
        reduce = _allreduce(4 * n, d, hw.link_bw(spans_nodes=d > hw.gpus_per_node))
        return max(reduce - bwd, reduce / units)
    shard = k.shard_group
    e = 4 if k.precision == "fp32" else 2
    inner = hw.link_bw(spans_nodes=shard * k.layout.tensor_size > hw.gpus_per_node)  # TP groups inside a node
    gather, scatter = _gather(e * n, shard, inner), _gather(4 * n, shard, inner)
    replicas = _allreduce(4 * n / shard, d // shard, hw.link_bw(spans_nodes=d > hw.gpus_per_node))
    forward, backward = gather, (gather if k.fsdp_reshard else 0.0) + scatter + replicas
    return m * (max(forward - fwd, forward / units) + max(backward - bwd, backward / units))


def _zero_comm(n: int, k: Knobs, d: int, m: int, bw: float, host_bw: float) -> tuple[float, float]:
    """(collective seconds, offload seconds) per step under ZeRO. Stage 0: all-reduce of 16-bit grads at the step;
    1: reduce-scatter + all-gather at the step (the same 2Ψ as data parallelism, ZeRO paper); 2: a reduce-scatter
    every microbatch + the all-gather; 3: two all-gathers (forward, backward) and a reduce-scatter every microbatch
    (3Ψ per microbatch)."""
    g = 4 if k.precision == "fp32" else 2
    grads = g * n
    comm = {0: _allreduce(grads, d, bw), 1: 2 * _gather(grads, d, bw),
            2: m * _gather(grads, d, bw) + _gather(grads, d, bw), 3: 3 * m * _gather(grads, d, bw)}[k.zero_stage]
    offload = 0.0
    shard = n / d if k.zero_stage >= 1 else n
    if k.offload_optimizer != "none":  # gradients down, updated parameters up, Adam on the CPU
        offload += 2 * g * shard / host_bw + shard / CPU_ADAM_PARAMS_PER_S
    if k.offload_param != "none":  # every microbatch fetches the parameter partition for forward and backward
        offload += 2 * m * g * shard / host_bw
    return comm, offload


def time_notes(k: Knobs, hw: Hardware, efficiency: float, efficiency_source: str, convention: str) -> dict[str, str]:
    """What each step-time term assumes."""
    lay = k.layout
    gb = 1e9
    return {
        COMPUTE: f"hardware FLOPs ({convention} convention, recompute={k.recompute}) / "
                 f"(peak {hw.peak_flops / 1e12:.0f} TFLOP/s x efficiency {efficiency:.2f}, {efficiency_source})"
                 if hw.peak_flops else "no peak",
        BUBBLE: f"compute x (p-1)/(v m) = {lay.bubble_fraction:.3f}",
        TP_COMM: f"{6 if k.recompute == 'full' else 4} x b s h per layer per microbatch, all-reduce busbw "
                 f"{hw.link_bw(lay.tensor_size > hw.gpus_per_node) / gb:.0f} GB/s, not overlapped",
        PP_COMM: f"2 x b s h{'/t' if lay.sequence_parallel else ''} per microbatch{' x v' if lay.interleaved else ''}, "
                 f"p2p at {hw.link_bw(lay.nodes > 1) / gb:.0f} GB/s, exposed",
        DP_COMM: (_fsdp_note(k) if k.fsdp else "fp32 grads "
                  f"{'reduce-scatter + 16-bit param all-gather' if k.distributed_optimizer else 'all-reduce'}"
                  f"{' (overlapped with the last backward)' if k.overlap_grad_reduce else ''} at "
                  if not k.zero else f"ZeRO-{k.zero_stage} collectives at ")
                 + f"{hw.link_bw(lay.tensor_size * lay.data_size > hw.gpus_per_node) / gb:.0f} GB/s",
        OFFLOAD: f"PCIe {hw.host_bw / gb:.0f} GB/s, CPU Adam {CPU_ADAM_PARAMS_PER_S:.0e} params/s per rank (assumed)"
                 if k.zero and (k.offload_optimizer != "none" or k.offload_param != "none")
                 else "no offload",
    }


def _fsdp_note(k: Knobs) -> str:
    if k.fsdp_strategy == "ddp":
        return "DDP: fp32 gradient all-reduce once per step, bucketed behind the last backward (exposed: the excess, " \
               "at least one block's bucket) at "
    again = " and again before its backward" if k.fsdp_reshard else ""
    hsdp = f" + fp32 all-reduce of the gradient shard across {k.layout.data_size // k.shard_group} replica groups" \
        if k.fsdp_strategy == "hybrid_shard" else ""
    return (f"FSDP2 per block and microbatch: parameter all-gather before its forward{again}, fp32 gradient "
            f"reduce-scatter after its backward, over {k.shard_group} ranks{hsdp}; prefetched behind the neighbouring "
            "block's compute (exposed: the first unit's, or the excess over compute) at ")
