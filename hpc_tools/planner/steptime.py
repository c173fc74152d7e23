"""Step time: compute at a fraction of peak, plus communication over the hardware table's bus bandwidths, plus the
pipeline bubble. Gives predicted tokens/s and MFU.

    compute = hardware FLOPs per GPU / (peak x efficiency)      FLOPs from profiling.flops (its owner)
    bubble  = compute x idle/slowest stage under the 1F1B schedule   pipeline_schedule.bubble_fraction
    comm    = bytes x nccl-tests bus factor / busbw              all-reduce 2(n-1)/n, all-gather/reduce-scatter (n-1)/n

The efficiency factor is what calibration fits per cluster (``calibrate.py``); it absorbs kernel efficiency, small
GEMMs and everything the model leaves out. Communication is assumed exposed unless the recipe turns on an overlap
the framework really performs (Megatron overlap_grad_reduce / overlap_param_gather, DeepSpeed overlap_comm, FSDP2's
per-block prefetch and DDP's bucketed all-reduce, both always on). The data-parallel traffic and offload are the
sharding scheme's (``hpc_tools.planner.sharding``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_tools.planner.arch import Arch, stage_layer_counts, stage_layers
from hpc_tools.planner.collectives import allreduce_s, gather_s
from hpc_tools.planner.efficiency import MEGATRON_EFFICIENCY
from hpc_tools.planner.hardware import Hardware
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.pipeline_schedule import bubble_fraction

if TYPE_CHECKING:
    from hpc_tools.recipe.model import ModelConfig

# fraction of dense peak the GEMM-bound compute reaches with Megatron-core's layers; other layers and calibrations:
# planner/efficiency.py (resolve_efficiency)
DEFAULT_EFFICIENCY = MEGATRON_EFFICIENCY
# FP8 GEMMs reach a smaller fraction of the (twice as high) FP8 peak than 16-bit GEMMs of theirs: scaling, casts and
# amax reductions. 0.75 x the 16-bit efficiency makes FP8 GEMMs 1.5x faster, and a dense model's whole step
# ~1.3-1.4x, inside the published 1.2-1.5x (Megatron-Bridge's guide; torchtitan measured 1.28x).
FP8_EFFICIENCY_RATIO = 0.75

COMPUTE, BUBBLE, TP_COMM, PP_COMM, DP_COMM, OFFLOAD = (
    "compute", "pipeline bubble", "tensor-parallel comm", "pipeline p2p", "data-parallel comm (exposed)",
    "offload (PCIe + CPU Adam)")
EP_COMM, CP_COMM = "expert all-to-all (exposed)", "context-parallel K/V exchange (exposed)"
RECOMPUTE_ELEMENTWISE = "recompute of norms / activations (memory-bound)"
MEMORY_BOUND_MODULES = frozenset({"layernorm", "moe_act"})
# HBM bandwidth per GPU, TB/s (NVIDIA / AMD datasheets): the memory-bound recomputations' pace.
HBM_TBPS = {"A100-40GB": 1.555, "A100-80GB": 2.039, "H100-SXM": 3.35, "H100-PCIe": 2.0, "H100-NVL": 3.9,
            "H200": 4.8, "H200-NVL": 4.8, "GH200": 4.0, "B200": 8.0, "MI300X": 5.3, "MI325X": 6.0, "L40S": 0.864,
            "L4": 0.3, "A10": 0.6, "A40": 0.696, "V100-SXM": 0.9, "V100-PCIe": 0.9}


@dataclass(frozen=True, slots=True)
class StepTime:
    terms: dict[str, float]  # seconds per step
    model_flops: float  # whole job, one step
    hardware_flops: float
    tokens_per_step: int
    world: int
    peak_flops: float  # the training precision's peak (bf16/fp16): the MFU everyone quotes
    peak_flops_fp8: float | None = None  # FP8 runs: the FP8 peak, for the second, stricter MFU

    @property
    def total_s(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.total_s

    @property
    def mfu(self) -> float:
        """Model FLOPs / (time x GPUs x the 16-bit peak), also for FP8 runs (so FP8 and 16-bit runs compare)."""
        return self.model_flops / (self.total_s * self.world * self.peak_flops)

    @property
    def mfu_fp8(self) -> float | None:
        """FP8 runs: model FLOPs against the FP8 peak (half the 16-bit MFU on Hopper); None otherwise."""
        if not self.peak_flops_fp8:
            return None
        return self.model_flops / (self.total_s * self.world * self.peak_flops_fp8)


def step_flops(model_cfg: "ModelConfig", k: Knobs, convention: str) -> tuple[float, float, float]:
    """(model FLOPs, hardware FLOPs, the part of the hardware FLOPs in the layers' weight GEMMs) of one step, over
    the vocabulary the job pads to. MoE layers count the FLOPs of the top-k experts a token is routed to."""
    from profiling.flops import hardware_flops_parts, model_flops_per_step, recomputed_flops_per_token

    vocab = model_cfg.padded_vocab_size(k.layout.tensor_size) if k.row.pads_vocab else model_cfg.vocab_size
    recompute = "none" if not k.row.selective_recompute and k.recompute == "selective" else k.recompute
    batch = k.layout.global_batch_size
    if recompute == "selective" and k.recompute_modules is not None:  # one forward of each recomputed module
        gemm, rest = hardware_flops_parts(model_cfg, batch, "none", convention=convention, vocab_size=vocab)
        extra_gemm, extra_rest = recomputed_flops_per_token(model_cfg, k.recompute_modules, convention=convention)
        tokens = batch * model_cfg.seq_length
        gemm, rest = gemm + extra_gemm * tokens, rest + extra_rest * tokens
    else:
        gemm, rest = hardware_flops_parts(model_cfg, batch, recompute, convention=convention, vocab_size=vocab)
    return model_flops_per_step(model_cfg, batch, convention=convention, vocab_size=vocab), gemm + rest, gemm


def estimate_step_time(arch: Arch, k: Knobs, hw: Hardware, flops: tuple[float, ...],
                       efficiency: float = DEFAULT_EFFICIENCY) -> StepTime | None:
    """Seconds per step, term by term; None when the peak FLOP/s is unknown (CPU ranks, GPU not in the table).

    ``flops``: (model, hardware[, weight-GEMM part of hardware]) FLOPs of one step (``step_flops``)."""
    if not hw.peak_flops:
        return None
    lay = k.layout
    t, p, m, v = lay.tensor_size, lay.pipeline_size, max(lay.num_microbatches, 1), k.virtual
    cp = lay.context_size
    model_flops, hardware_flops = flops[0], flops[1]
    gemm_flops = flops[2] if len(flops) > 2 else hardware_flops
    tok = arch.seq // cp * lay.micro_batch_size  # tokens of a microbatch on one GPU (CP splits each sequence)
    e = k.act_bytes
    fp8_peak = hw.peak_flops_fp8 if k.fp8 else None
    if fp8_peak:  # the layers' GEMMs in FP8 at their own efficiency; attention core and logits in 16-bit
        compute = (gemm_flops / (fp8_peak * efficiency * FP8_EFFICIENCY_RATIO)
                   + (hardware_flops - gemm_flops) / (hw.peak_flops * efficiency)) / lay.world_size
    else:
        compute = hardware_flops / lay.world_size / (hw.peak_flops * efficiency)
    # the pipeline runs at the pace of its longest stage: with uneven stages (or L not a multiple of p) one stage's
    # layers exceed L / p, and every stage waits for it (the embedding and head are not assigned to stages here)
    stage_n = stage_layers(arch, p, v, lay.first_stage_layers, lay.last_stage_layers) if p > 1 else arch.layers
    compute *= stage_n * p / arch.layers
    # the bubble under Megatron-core's schedule for these stages (embedding first, logits last, uneven splits):
    # (p-1)/(v m) only when the stages are equal (planner/pipeline_schedule.py)
    bubble = bubble_fraction(arch, p, v, m, lay.first_stage_layers, lay.last_stage_layers, t,
                             3.0 if k.recompute == "full" else 2.0)
    terms = {COMPUTE: compute, BUBBLE: compute * bubble}

    # TP: per layer and microbatch 2 all-reduces forward and 2 backward of b s h (SP: all-gather + reduce-scatter
    # pairs, same bus bytes) = 8 b s h (t-1)/t elements (Narayanan et al.); full recompute repeats the forward's 2.
    collectives = 6 if k.recompute == "full" else 4
    tp_bw = hw.link_bw(spans_nodes=t > hw.gpus_per_node)
    terms[TP_COMM] = collectives * allreduce_s(e * tok * arch.hidden, t, tp_bw) * stage_n * m

    # PP: each microbatch crosses each stage boundary forward (activations) and backward (their gradients), v times
    # when interleaved; b s h per message (b s h / t with SP). Taken as exposed (the send of one microbatch is on the
    # critical path of the next stage).
    msg = e * tok * arch.hidden / (t if lay.sequence_parallel else 1)
    pp_bw = hw.link_bw(spans_nodes=lay.nodes > 1)
    terms[PP_COMM] = 2 * m * v * msg / pp_bw if p > 1 else 0.0
    if arch.moe:
        terms[EP_COMM] = exposed_expert_comm(arch, k, hw, tok, compute, efficiency)
    if k.recomputed & MEMORY_BOUND_MODULES and k.row.recompute_modules:
        terms[RECOMPUTE_ELEMENTWISE] = _elementwise_recompute(arch, k, hw, tok, stage_n) * m
    if cp > 1:
        terms[CP_COMM] = _context_comm(arch, k, hw, tok, efficiency) * stage_n * m

    # data-parallel traffic: the sharding scheme's (planner/sharding/)
    terms[DP_COMM], terms[OFFLOAD] = k.scheme.dp_time(arch, k, hw, compute)
    return StepTime(terms, model_flops, hardware_flops, lay.global_batch_size * arch.seq, lay.world_size,
                    hw.peak_flops, fp8_peak)


def _moe_stage_layers(arch: Arch, k: Knobs) -> int:
    """MoE layers of the pipeline stage that holds the most."""
    lay = k.layout
    return max(stage_layer_counts(arch, lay.pipeline_size, s, k.virtual, lay.first_stage_layers,
                                  lay.last_stage_layers)[1] for s in range(lay.pipeline_size))


def a2a_passes(k: Knobs) -> int:
    """Dispatches and combines per MoE layer and microbatch: forward and backward (4), + the forward again when the
    layer is recomputed (full recomputation, or ``moe`` in recompute_modules: 6)."""
    return 6 if k.recompute == "full" or "moe" in k.recomputed else 4


def unpaired_microbatches(k: Knobs) -> float:
    """Microbatches of one step whose all-to-all Megatron-core's combined 1F1B cannot pair with another's compute:
    the warm-up forwards and the cool-down backwards of the first stage (one extra warm-up forward, as the schedule
    adds): PP1 one microbatch (the first forward, the last backward); interleaved (p-1) x 2 + (v-1) x p + 1 model
    chunks, i.e. that / v microbatches; plain 1F1B p chunks (DualPipe-like schedules, for comparisons only: the
    rules ask Megatron-core's interleaving)."""
    lay = k.layout
    p, v, m = lay.pipeline_size, k.virtual, max(lay.num_microbatches, 1)
    if p == 1:
        chunks = 1
    elif v == 1:
        chunks = p
    else:
        chunks = (p - 1) * 2 + (v - 1) * p + 1
    return min(chunks / v, m)


def exposed_expert_comm(arch: Arch, k: Knobs, hw: Hardware, tok: int, compute: float, efficiency: float) -> float:
    """Exposed seconds per step of the token dispatcher on the busiest stage.

    Not overlapped: every pass of every microbatch (``_expert_comm`` x m). ``overlap_moe_expert_parallel_comm``
    (combined 1F1B): a paired forward's dispatch and combine run during the other microbatch's backward compute
    (2/3 of a microbatch's compute), the backward's (and a recomputed forward's) during the forward compute (1/3):
    exposed per pair max(0, a2a_fwd - compute_bwd) + max(0, a2a_bwd - compute_fwd); the unpaired warm-up and
    cool-down microbatches (``unpaired_microbatches``) keep all of theirs. ``moe_shared_expert_overlap``: each pass
    hidden behind the shared expert's compute of the same layer (its GEMMs at the 16-bit peak x efficiency).
    The result is never negative and never below what no overlap could hide (the unpaired microbatches)."""
    lay = k.layout
    m = max(lay.num_microbatches, 1)
    per_mb = _expert_comm(arch, k, hw, tok)
    if k.ep_overlap:
        fwd_a2a = per_mb * 2 / a2a_passes(k)
        bwd_a2a = per_mb - fwd_a2a
        fwd_c, bwd_c = compute / m / 3, 2 * compute / m / 3
        pair = max(0.0, fwd_a2a - bwd_c) + max(0.0, bwd_a2a - fwd_c)
        alone = unpaired_microbatches(k)
        return alone * per_mb + (m - alone) * pair
    if k.shared_expert_overlap and arch.shared_ffn:
        mats = 3 if arch.gated else 2
        shared = (3 * 2 * arch.hidden * arch.shared_ffn * mats / lay.tensor_size * tok * _moe_stage_layers(arch, k)
                  / (hw.peak_flops * efficiency))
        return m * max(0.0, per_mb - shared)
    return m * per_mb


def _elementwise_recompute(arch: Arch, k: Knobs, hw: Hardware, tok: int, stage_layers_n: int) -> float:
    """Seconds per microbatch of the memory-bound recomputations on the busiest stage, one read of the input and one
    write of the output at the GPU's HBM bandwidth: ``layernorm`` (the two norms of every layer, s b h each, / TP
    with SP), ``moe_act`` (the routed experts' activation: SwiGLU reads 2f and writes f per token copy, GELU f and
    f). 0 where the HBM bandwidth is unknown."""
    bw = hbm_bandwidth(hw.gpu_type)
    if not bw:
        return 0.0
    lay, e, mods = k.layout, k.act_bytes, k.recomputed
    rep = tok / lay.tensor_size if lay.sequence_parallel else tok
    nbytes = 0.0
    if "layernorm" in mods:
        nbytes += stage_layers_n * 2 * 2 * e * rep * arch.hidden
    if "moe_act" in mods and arch.moe:
        routed = rep * arch.topk * lay.expert_tensor_size
        nbytes += _moe_stage_layers(arch, k) * e * routed * arch.moe_ffn / lay.expert_tensor_size * (
            3 if arch.gated else 2)
    return nbytes / bw


def hbm_bandwidth(gpu_type: str) -> float | None:
    """The GPU's memory bandwidth in bytes/s (vendor datasheets), None when not in the table."""
    from profiling.peaks import canonical_gpu

    tbps = HBM_TBPS.get(canonical_gpu(gpu_type) or "")
    return tbps * 1e12 if tbps else None


def _expert_comm(arch: Arch, k: Knobs, hw: Hardware, tok: int) -> float:
    """Seconds per microbatch of the token dispatcher on the busiest stage: per MoE layer a dispatch and a combine
    forward and again backward (4, 6 with full recompute). ``alltoall``: each GPU sends its tokens x top-k (16-bit,
    h wide), the share (EP-1)/EP to other ranks; ``allgather``: the EP group's tokens gathered, then
    reduce-scattered. ETP > 1 adds an all-gather / reduce-scatter of the routed tokens inside the ETP group. The
    EP group is ETP x EP consecutive ranks: NVLink while that fits in a node, the network beyond."""
    lay, e, h = k.layout, k.act_bytes, arch.hidden
    ep, etp = lay.expert_size, lay.expert_tensor_size
    rep = tok / lay.tensor_size if lay.sequence_parallel else tok
    passes = a2a_passes(k)
    bw = hw.link_bw(spans_nodes=ep * etp > hw.gpus_per_node)
    if k.dispatcher == "allgather":
        one = gather_s(e * rep * h * ep, ep, bw)
    else:
        one = e * rep * arch.topk * h * (ep - 1) / ep / bw if ep > 1 else 0.0
    one += gather_s(e * rep * arch.topk * h * etp, etp, hw.link_bw(spans_nodes=etp > hw.gpus_per_node))
    return passes * one * _moe_stage_layers(arch, k)


def _context_comm(arch: Arch, k: Knobs, hw: Hardware, tok: int, efficiency: float) -> float:
    """Exposed seconds per layer and microbatch of context parallelism's ring (Transformer Engine, P2P): each rank
    passes its K and V chunk CP-1 times forward, and K/V plus their gradients backward (3 (CP-1) chunk transfers, 4
    with full recompute), each overlapped with the attention of the chunk before: exposed is the first transfer of
    each pass and what the ring's remaining transfers take beyond the attention core's compute."""
    lay, e = k.layout, k.act_bytes
    cp, t = lay.context_size, lay.tensor_size
    if arch.mla:  # MLA's keys and values are per head once up-projected
        kv_width = arch.heads / t * (arch.qk_dim + arch.pos_dim + arch.v_dim)
    else:
        kv_width = 2 * arch.groups / t * arch.head_dim
    chunk = e * tok * kv_width
    passes = 4 if k.recompute == "full" else 3
    comm = passes * (cp - 1) * chunk / hw.link_bw(spans_nodes=t * cp > hw.gpus_per_node)
    d_qk = arch.qk_dim + arch.pos_dim if arch.mla else arch.head_dim
    d_v = arch.v_dim if arch.mla else arch.head_dim
    core = 3 * 2 * tok * arch.seq * 0.5 * arch.heads / t * (d_qk + d_v) / (hw.peak_flops * efficiency)
    first = passes * chunk / hw.link_bw(spans_nodes=t * cp > hw.gpus_per_node)
    return first + max(comm - first - core, 0.0)


def time_notes(k: Knobs, hw: Hardware, efficiency: float, efficiency_source: str, convention: str) -> dict[str, str]:
    """What each step-time term assumes."""
    lay = k.layout
    gb = 1e9
    fp8 = (f"; the layers' weight GEMMs in FP8 ({k.fp8}) at the FP8 peak {hw.peak_flops_fp8 / 1e12:.0f} TFLOP/s x "
           f"{efficiency * FP8_EFFICIENCY_RATIO:.2f} ({FP8_EFFICIENCY_RATIO} x the efficiency), attention core and "
           "logits in 16-bit" if k.fp8 and hw.peak_flops_fp8 else "")
    notes = {
        COMPUTE: f"hardware FLOPs ({convention} convention, recompute={k.recompute}"
                 + (f" [{', '.join(k.recompute_modules)}]: one more forward of each" if k.recompute == "selective"
                    and k.recompute_modules is not None else "")
                 + f"{', MoE: top-k experts per token' if k.moe else ''}) / "
                 f"(peak {hw.peak_flops / 1e12:.0f} TFLOP/s x efficiency {efficiency:.2f}, {efficiency_source}){fp8}"
                 + (f"; x p x (longest stage's layers) / L: the pipeline runs at its longest stage's pace "
                    f"(uneven stages: first {lay.first_stage_layers}, last {lay.last_stage_layers})"
                    if lay.uneven else "")
                 if hw.peak_flops else "no peak",
        BUBBLE: f"compute x the idle time of Megatron-core's schedule beyond the slowest stage's work, stages from "
                f"the layer split with the logits on the last (pipeline_schedule.py); equal stages: (p-1)/(v m) = "
                f"{lay.bubble_fraction:.3f}",
        TP_COMM: f"{6 if k.recompute == 'full' else 4} x b s h per layer per microbatch, all-reduce busbw "
                 f"{hw.link_bw(lay.tensor_size > hw.gpus_per_node) / gb:.0f} GB/s, not overlapped",
        PP_COMM: f"2 x b s h{'/t' if lay.sequence_parallel else ''} per microbatch{' x v' if lay.interleaved else ''}, "
                 f"p2p at {hw.link_bw(lay.nodes > 1) / gb:.0f} GB/s, exposed",
        DP_COMM: k.scheme.dp_note(k) + f"{hw.link_bw(lay.tensor_size * lay.data_size > hw.gpus_per_node) / gb:.0f} GB/s"
                 + (f" over DP x CP = {lay.dense_grad_size} ranks" if lay.context_size > 1 else "")
                 + (f"; routed experts' grads over EDP = {lay.expert_data_size} ranks" if k.moe else ""),
        OFFLOAD: k.scheme.offload_note(k, hw),
    }
    ep, etp, cp = lay.expert_size, lay.expert_tensor_size, lay.context_size
    if k.moe:
        how = ("all-gather + reduce-scatter of the EP group's tokens" if k.dispatcher == "allgather" else
               "all-to-all of b s h x top-k (16-bit), the (EP-1)/EP share leaving the GPU")
        if k.ep_overlap:
            hidden = (f"overlapped (combined 1F1B): a paired microbatch's forward passes hide behind another's "
                      f"backward compute and its backward passes behind the forward compute; the "
                      f"{unpaired_microbatches(k):g} unpaired warm-up/cool-down microbatches fully exposed")
        elif k.shared_expert_overlap and k.moe:
            hidden = "overlapped with the shared expert's compute (moe_shared_expert_overlap)"
        else:
            hidden = "not overlapped"
        routing = ("; every token copy for another node crosses the network (node-limited routing with NVLink "
                   "forwarding, as DeepSeek-V3's, is not modelled)" if ep * etp > hw.gpus_per_node else "")
        notes[EP_COMM] = (f"{a2a_passes(k)} per MoE layer per microbatch (dispatch + combine, forward + backward"
                          f"{' + recomputed forward' if a2a_passes(k) == 6 else ''}): {how}, EP{ep} x ETP{etp} "
                          f"{'inside a node' if ep * etp <= hw.gpus_per_node else 'across nodes'} at "
                          f"{hw.link_bw(ep * etp > hw.gpus_per_node) / gb:.0f} GB/s; balanced routing{routing}; "
                          f"{hidden}")
    if k.recomputed & MEMORY_BOUND_MODULES and k.row.recompute_modules:
        bw = hbm_bandwidth(hw.gpu_type)
        notes[RECOMPUTE_ELEMENTWISE] = (
            f"{', '.join(sorted(k.recomputed & MEMORY_BOUND_MODULES))} recomputed: one read and one write of each "
            f"tensor per microbatch at HBM {bw / 1e12:.2f} TB/s (datasheet)" if bw else
            "not priced: this GPU's HBM bandwidth is not in the table")
    if cp > 1:
        notes[CP_COMM] = (f"ring of CP{cp}: 3 (CP-1) K/V chunk transfers per layer per microbatch (forward; K/V and "
                          f"their gradients backward) at {hw.link_bw(lay.tensor_size * cp > hw.gpus_per_node) / gb:.0f}"
                          " GB/s, overlapped with the attention core (exposed: the first transfer and any excess)")
    return notes
