"""Memory per GPU: model states, activations and stated overheads, for Megatron-core, DeepSpeed and FSDP jobs.

Sources (docs/formulas.md states each): model states from the ZeRO paper (16 bytes/param with mixed-precision Adam,
stage 1/2/3 partitioning) and Megatron-LM's distributed-optimizer notes (18 bytes/param, 6 + 12/d); activations from
Korthikanti et al. 2022, Table 2, generalised term by term to GQA, SwiGLU, no dropout and fused attention; pipeline
in-flight microbatches from the 1F1B and interleaved schedules. Every term carries a note that says what it assumes
(``memory_notes``). Bytes everywhere; GB = 1e9 bytes.

The model states, their notes and the terms of a scheme's own (ZeRO-3's gathered parameters, FSDP's unsharded copies,
DeepSpeed's reduce bucket) belong to the backend's sharding scheme (``hpc_tools.planner.sharding``); what a layer,
the embedding and the head keep belongs to its layer code (``LayerCode`` below: Megatron-core's or Hugging Face's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from hpc_tools import backends
from hpc_tools.planner.arch import Arch, busiest_moe_stage, stage_layer_counts
from hpc_tools.planner.attention import attention_note, sdpa_kernel
from hpc_tools.planner.knobs import Knobs
from hpc_tools.recipe.training import recompute_modules

GB = 1e9
CUDA_CONTEXT_BYTES = 1.5e9  # CUDA context + kernels + cuBLAS workspace: 1-2 GB (Ultra-Scale Playbook)
NCCL_BUFFER_BYTES = 0.5e9  # NCCL channels/buffers per process (assumed; grows with the number of communicators)

PARAMETERS, GRADIENTS, OPTIMIZER = "parameters", "gradients", "optimizer states"
ACTIVATIONS, EDGE_ACTIVATIONS, RECOMPUTE_WS = "activations", "embedding/logits activations", "recompute working set"
BUCKETS, CONTEXT = "communication buffers", "CUDA context"


# --- activations (Korthikanti et al. 2022, Table 2, generalised) ----------------------------------------------------

def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, groups: int | None = None,
                           head_dim: int | None = None, ffn: int | None = None, gated: bool = False,
                           sp: bool = False, recompute: str = "none", flash: bool = False, hidden_dropout: bool = True,
                           attention_dropout: bool = True, act_bytes: int = 2, softmax_fp32: bool = False,
                           glu_offset_copy: bool = False, expand_kv: bool = False) -> float:
    """Bytes one transformer layer keeps for the backward pass, for one microbatch on one GPU.

    With MHA, GELU, ffn = 4h, dropout and explicit attention this is Korthikanti Table 2 exactly:
    sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with TP, sbh/t (34 + 5as/h) with TP+SP, the s^2
    terms dropped by selective recompute, and 2sbh (2sbh/t with SP) for full recompute (the layer input only).

    Implementation details Korthikanti does not have (off by default, the Megatron plan turns them on):
    ``softmax_fp32`` -- Megatron's unfused softmax with attention_softmax_in_fp32 keeps its output in fp32 (4as^2b)
    and, without attention dropout, the 16-bit copy the P.V matmul saves (2as^2b); ``glu_offset_copy`` -- Megatron's
    unfused SwiGLU saves ``x_linear + glu_linear_offset``, one more s b f tensor; ``expand_kv`` -- Megatron's unfused
    attention repeats the K and V groups to every head before the matmuls, so with GQA they are saved at a heads.
    Norm statistics (mean/rstd, 4 bytes per token each) are not counted.
    """
    e, g = act_bytes, groups or a
    dh = head_dim or h // a
    f = ffn or 4 * h
    tok = s * b
    rep = 1 / t if sp else 1.0  # replicated across TP unless sequence-parallel
    if recompute == "full":
        return e * tok * h * rep
    masks = (2 if hidden_dropout else 0) * tok * h  # 1-byte dropout masks after attention and after the MLP
    replicated = (4 * e * tok * h + masks) * rep  # two norm inputs, QKV input, fc1 input
    explicit = not flash and recompute != "selective"
    kv = a if expand_kv and explicit else g
    attention = e * tok * (a * dh + 2 * kv * dh + a * dh)  # Q, K and V; the context (input of the output projection)
    # fc1 output and activation output; SwiGLU: fc1's 2f, silu(gate) f and the product f (+ Megatron's offset copy)
    mlp = e * tok * f * ((5 if glu_offset_copy else 4) if gated else 2)
    quadratic = 0.0
    if explicit:
        # softmax output; with attention dropout also its 1-byte mask and the dropout output, without it (fp32
        # softmax only) the 16-bit copy of the probabilities that the P.V matmul saves
        upcast = softmax_fp32 and e < 4
        extra = 1 + e if attention_dropout else (e if upcast else 0)
        quadratic = a * s * s * b * ((4 if upcast else e) + extra)
    return replicated + (attention + mlp + quadratic) / t


def megatron_layer_terms(s: int, b: int, h: int, a: int, t: int = 1, *, groups: int | None = None,
                         head_dim: int | None = None, ffn: int | None = None, gated: bool = False, sp: bool = False,
                         recompute: str = "none", flash: bool = False, hidden_dropout: bool = False,
                         attention_dropout: bool = False, act_bytes: int = 2, rope: bool = False,
                         rmsnorm: bool = False, on_gpu: bool = True, sdpa: str | None = None) -> dict[str, float]:
    """Bytes one Megatron-core transformer layer (the job's local layer spec) saves for backward, term by term, for
    one microbatch on one GPU of a TP group of ``t``: Korthikanti's Table 2 with every tensor the implementation
    really keeps. Exact against autograd on the CPU build (``tests/integration/test_planner_activations.py``).

    What the table leaves out: (1) the fused QKV projection output stays alive whole, (a/t + 2g/t) heads, whenever a
    view of it is saved: V always unless K/V are expanded for grouped-query attention, and Q and K too without RoPE
    (RoPE writes new Q and K tensors of a/t and g/t heads); the unfused explicit attention expands K and V to a/t
    heads and copies Q when its head layout is not a view; selective recomputation and fused attention save Q, K, V
    as they enter the attention core. (2) The RoPE cos/sin tables, 4 s d_h e per layer (unfused RoPE recomputes
    them for Q and K). (3) Norm statistics: LayerNorm mean and rstd per token (fp32 on CUDA, the activation dtype on
    the CPU build); torch's RMSNorm keeps rstd (fp32) and, on the CPU build (composite kernel), the fp32 input and
    the fp32 normalised input instead of the 16-bit input. (4) Dropout masks: 1 byte per element on CUDA, a noise
    tensor of the activation dtype on the CPU build. (5) The explicit attention's causal mask, s^2 booleans.
    Full recomputation is counted per checkpoint (``stage_activation_bytes``), not here.

    ``sdpa``: the local layers' attention core on torch's scaled_dot_product_attention (``sdpa_kernel``):
    ``flash`` -- a flash-style kernel (torch's flash kernel for CPU, dropout 0; on a GPU flash / cuDNN /
    memory-efficient, planned alike): Q, K, V as they enter the core and the fp32 log-sum-exp per head and token,
    no s^2 term; ``math`` -- torch's math kernel (CPU with attention dropout): fp32 copies of the scaled Q and K
    and of V at a/t heads (K, V expanded for GQA; 16-bit inputs upcast; V in fp32 without GQA stays a view of the
    fused QKV output, which it keeps alive) instead of the Q, K, V views, and three fp32 s^2
    tensors (softmax output, dropout mask, dropped probabilities), no causal mask. Selective recomputation of the
    core keeps its inputs only, whichever kernel.
    """
    e, g = act_bytes, groups or a
    dh = head_dim or h // a
    f = ffn or 4 * h
    a_t, g_t, f_t = a // t, g // t, f // t
    tok = s * b
    rep = tok / t if sp else tok  # tokens in the replicated (or sequence-parallel) region
    mask = 1 if on_gpu else e

    def norm() -> float:
        if rmsnorm:
            return (4 * rep * h + 4 * rep + 4 * rep * h) if not on_gpu else (e * rep * h + 4 * rep)
        return e * rep * h + 2 * rep * (4 if on_gpu else e)

    terms = {"norms (inputs and statistics)": 2 * norm(), "linear inputs (QKV, fc1)": 2 * e * rep * h}
    if hidden_dropout:
        terms["dropout masks"] = 2 * mask * rep * h
    explicit = not flash and not sdpa and recompute != "selective"
    math = sdpa == "math" and recompute != "selective"
    terms["Q, K, V (+ fused QKV output kept by views)"] = _qkv_kept(tok, a_t, g_t, dh, e, b=b, rope=rope,
                                                                   explicit=explicit, math=math)
    terms["attention output (output projection input)"] = e * tok * a_t * dh
    if rope:
        terms["RoPE cos/sin tables"] = 4 * s * dh * e
    terms |= _core_terms(s, b, a_t, e, mask, recompute=recompute, flash=flash, sdpa=sdpa, explicit=explicit,
                         math=math, attention_dropout=attention_dropout)
    # fc1 output and activation output; SwiGLU: fc1's 2f, silu(gate) f, Megatron's unfused offset copy f, product f
    terms["MLP"] = e * tok * f_t * (5 if gated else 2)
    return terms


def _core_terms(s: int, b: int, a_t: int, e: int, mask: int, *, recompute: str, flash: bool, sdpa: str | None,
                explicit: bool, math: bool, attention_dropout: bool) -> dict[str, float]:
    """What the attention core itself keeps beyond Q, K and V: the s^2 tensors of the unfused core and of SDPA's
    math kernel, the flash-style kernels' log-sum-exp, selective recomputation's bookkeeping."""
    terms: dict[str, float] = {}
    if recompute == "selective" and not flash:
        terms["recompute bookkeeping"] = 4  # one int32 the checkpoint keeps
    if sdpa == "flash" and (recompute != "selective" or flash):  # (flash: the job drops core_attn's recompute)
        terms["SDPA log-sum-exp (fp32)"] = 4 * b * a_t * s
    if math:
        terms["attention scores (softmax, dropout)"] = 3 * 4 * a_t * s * s * b
    if explicit:
        upcast = e < 4  # attention_softmax_in_fp32: the softmax runs and is saved in fp32
        quad = (4 if upcast else e) + ((mask + e) if attention_dropout else (e if upcast else 0))
        terms["attention scores (softmax, dropout)"] = quad * a_t * s * s * b
        terms["causal mask"] = s * s
    return terms


def _qkv_kept(tok: int, a_t: int, g_t: int, dh: int, e: int, *, b: int, rope: bool, explicit: bool,
              math: bool) -> float:
    """Bytes of Q, K and V one layer keeps for backward (with the fused QKV output that views of it keep alive):
    ``megatron_layer_terms``' item (1), per attention core (``explicit``: the unfused one; ``math``: SDPA's math
    kernel; otherwise fused, flash-style or selective recomputation's inputs)."""
    gqa = g_t < a_t
    if math:  # scaled fp32 Q and K; V an fp32 copy, except in fp32 without GQA: a view of the fused QKV output
        v_kept = e * tok * (a_t + 2 * g_t) * dh if e == 4 and not gqa else 4 * tok * a_t * dh
        return 4 * 2 * tok * a_t * dh + v_kept
    if explicit and gqa:
        # K and V repeated to a/t heads; Q is RoPE's output, or a copy made for the grouped head layout (1 < g/t) or
        # for the [s, b x heads, d_h] matmul layout (b > 1); only with g/t = 1 and b = 1 is it still a view
        q_own = rope or g_t > 1 or b > 1
        own, views = 2 * a_t + (a_t if q_own else 0), not q_own
    elif explicit:  # MHA: Q, K, V views of the QKV output, or new Q and K after RoPE (V still a view)
        own, views = (2 * a_t if rope else 0), True
    else:  # as they enter the attention core: new Q (RoPE, or a copy when 1 < g/t < a/t: the grouped head layout is
        # no view of [s, b, heads, d_h]) and new K (RoPE); V a view
        own, views = (a_t if rope or 1 < g_t < a_t else 0) + (g_t if rope else 0), True
    return e * tok * dh * (own + ((a_t + 2 * g_t) if views else 0))


def _chunks_in_flight(p: int, v: int, m: int, stage: int) -> int:
    """Model chunks whose activations a stage holds at its peak: 1F1B p - stage (capped by m); interleaved
    (p - stage - 1) x 2 + (v - 1) x p + 1 warm-up chunks (capped by m x v), which on stage 0 is Korthikanti's
    p x (1 + (p-1)/(p v)) layers' worth."""
    if v == 1:
        return min(p - stage, m)
    return min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)


@lru_cache(maxsize=1024)
def first_chunk_in_flight(p: int, v: int, m: int) -> int:
    """Microbatches whose first model chunk (the one with the embedding) stage 0 holds at once, at most.

    1F1B: min(p, m). Interleaved (Megatron's order, groups of p microbatches per chunk): forwards run chunk 0 for
    microbatches 0..p-1, chunk 1 for the same, ..., then chunk 0 for p..2p-1; backwards run the chunks in reverse
    order; after the warm-up every forward is followed by one backward. Walked step by step, since the count of
    chunk-0 microbatches in flight rises above p during the steady state."""
    if v == 1:
        return min(p, m)
    total = m * v
    warmup = min((p - 1) * 2 + (v - 1) * p, total)

    def chunk(k: int, forward: bool) -> int:
        c = (k % (p * v)) // p
        return c if forward else v - 1 - c

    held = best = sum(1 for k in range(warmup) if chunk(k, True) == 0)
    # steady state: forward warmup + j, then backward j. Both chunk sequences repeat every p x v steps, each adding and
    # removing p chunk-0 microbatches per period, so the count is periodic: one period holds its maximum (O(p v), not
    # O(m v): a huge global batch must not hang `validate`).
    for j in range(min(total - warmup, p * v)):
        held += chunk(warmup + j, True) == 0
        best = max(best, held)
        held -= chunk(j, False) == 0
    return best


def local_seq(arch: Arch, k: Knobs) -> int:
    """Tokens of one sequence on one GPU: seq_length / CP (context parallelism splits every sequence)."""
    return arch.seq // k.layout.context_size


MOE_ROUTER, MOE_DISPATCHED, MOE_EXPERTS, MOE_COMBINE, MOE_SHARED = (
    "router (fp32 logits, scores, routing map)", "dispatched tokens (expert inputs, x top-k)",
    "routed experts' MLP (x top-k)", "expert outputs for the weighted combine (x top-k)", "shared expert MLP")
QKV, LINEAR_INPUTS = "Q, K, V (+ fused QKV output kept by views)", "linear inputs (QKV, fc1)"


def drop_recomputed(terms: dict[str, float], arch: Arch, k: Knobs, s: int, mods: "tuple[str, ...]",
                    moe: bool) -> dict[str, float]:
    """A Megatron-core layer's terms less what ``training.recompute_modules`` recomputes instead of keeping (each
    checkpoint keeps its input, which the layer keeps anyway): ``layernorm`` the norms' outputs (the QKV and fc1 /
    MoE inputs); ``mlp`` a dense layer's MLP; ``mla_up_proj`` everything multi-latent attention keeps above its
    latents; ``moe`` the whole MoE MLP; ``moe_act`` the routed experts' activation (their fc1 output stays);
    ``shared_experts`` the shared expert's MLP. ``core_attn`` is ``megatron_layer_terms``' selective case (the s^2
    terms). The one layer being recomputed during its backward is not counted (smaller than a chunk in flight)."""
    if "layernorm" in mods:
        terms.pop(LINEAR_INPUTS, None)
    if "mlp" in mods and not moe:
        terms.pop("MLP", None)
    if "mla_up_proj" in mods and arch.mla:
        latents = 2 * (arch.q_lora + arch.kv_lora) + arch.pos_dim
        terms[QKV] = k.act_bytes * s * k.layout.micro_batch_size * latents
    if moe and "moe" in mods:
        for name in (MOE_ROUTER, MOE_DISPATCHED, MOE_EXPERTS, MOE_COMBINE, MOE_SHARED):
            terms.pop(name, None)
    elif moe:
        if "moe_act" in mods:  # fc1's output (2f under SwiGLU, f under GELU) of the 5f / 2f the experts keep
            terms[MOE_EXPERTS] *= 2 / 5 if arch.gated else 1 / 2
        if "shared_experts" in mods:
            terms.pop(MOE_SHARED, None)
    return terms


def routed_tokens(arch: Arch, k: Knobs, s: int) -> float:
    """Token copies one GPU's experts process per MoE layer and microbatch: the tokens entering the layer on this GPU
    (s b / CP, / TP under sequence parallelism) x top-k, x ETP (each expert-tensor shard sees every token of its
    ETP group); balanced routing assumed (the aux loss's aim), capped by the capacity factor when one is set."""
    lay = k.layout
    tok = s * lay.micro_batch_size / (lay.tensor_size if lay.sequence_parallel else 1)
    return tok * arch.topk * lay.expert_tensor_size


def moe_mlp_terms(arch: Arch, k: Knobs, s: int) -> dict[str, float]:
    """What an MoE layer's MLP keeps instead of the dense MLP (Megatron-core's MoELayer, alltoall dispatcher,
    dropless): the router's fp32 logits, scores and routing map per token and expert, the dispatched tokens each
    local expert's fc1 saves, the experts' fc1 output / activation (x top-k tokens, width moe_ffn / ETP), the expert
    outputs the combine weights by the routing probabilities, and the shared expert as a TP-split dense MLP."""
    lay, e = k.layout, k.act_bytes
    tok = s * lay.micro_batch_size
    rep = tok / lay.tensor_size if lay.sequence_parallel else tok
    routed = routed_tokens(arch, k, s)
    f_e = arch.moe_ffn / lay.expert_tensor_size
    glu = 5 if arch.gated else 2
    terms = {MOE_ROUTER: 3 * 4 * rep * arch.experts, MOE_DISPATCHED: e * routed * arch.hidden,
             MOE_EXPERTS: e * routed * f_e * glu, MOE_COMBINE: e * routed * arch.hidden}
    if arch.shared_ffn:
        terms[MOE_SHARED] = e * tok * arch.shared_ffn / lay.tensor_size * glu
    return terms


def mla_attention_terms(arch: Arch, k: Knobs, s: int) -> dict[str, float]:
    """Multi-latent attention's tensors instead of the Q, K, V and attention-output terms (estimated from
    Megatron-core's MLASelfAttention, not measured): the query and key/value latents and their normed copies
    (replicated across TP), the up-projections' outputs, the RoPE'd queries and keys entering the attention core
    (a/t heads of qk + rope dims), V and the context (a/t heads of v_head_dim)."""
    lay, e = k.layout, k.act_bytes
    tok = s * lay.micro_batch_size
    a_t = arch.heads / lay.tensor_size
    latents = 2 * (arch.q_lora + arch.kv_lora) + arch.pos_dim
    qk = arch.qk_dim + arch.pos_dim
    return {"Q, K, V (+ fused QKV output kept by views)": e * tok * (latents + a_t * (qk + (arch.qk_dim + arch.v_dim)
                                                                                     + 2 * qk + arch.v_dim)),
            "attention output (output projection input)": e * tok * a_t * arch.v_dim}


def layer_bytes(arch: Arch, k: Knobs, recompute: str, moe: bool = False) -> float:
    """Bytes one layer (dense, or ``moe``) keeps for one microbatch on one GPU under ``k``: its layer code's terms
    (``LayerCode.terms``; Megatron: ``megatron_layer_terms``, ``moe_mlp_terms``)."""
    return sum(layers_of(k).terms(arch, k, recompute, moe).values())


def _checkpoint_bytes(arch: Arch, k: Knobs) -> float:
    """What one full-recompute checkpoint keeps: the input of its group of layers."""
    lay = k.layout
    rep = 1 / lay.tensor_size if lay.sequence_parallel else 1.0
    return k.act_bytes * local_seq(arch, k) * lay.micro_batch_size * arch.hidden * rep


def stage_activation_bytes(arch: Arch, k: Knobs, stage: int, layer=layer_bytes) -> tuple[float, float]:
    """(activations held at the stage's peak, recompute working set) in bytes for one GPU of ``stage`` (``layer``:
    ``layer_bytes``, or the search memo's, planner/memo.py)."""
    lay, v = k.layout, k.virtual
    chunks = _chunks_in_flight(p := lay.pipeline_size, v, max(lay.num_microbatches, 1), stage)
    n_dense, n_moe = stage_layer_counts(arch, p, stage, v, lay.first_stage_layers, lay.last_stage_layers)
    chunk_layers = (n_dense + n_moe) // v  # this stage's chunks (uneven stages: its own length)
    # Hugging Face models have no selective recompute; with fused attention it changes nothing anyway.
    recompute = "none" if not k.row.selective_recompute and k.recompute == "selective" else k.recompute
    if recompute != "full":
        # a chunk in flight holds its layers; with MoE layers spread unevenly, the stage's average chunk
        per_chunk = (n_dense * layer(arch, k, recompute)
                     + (n_moe * layer(arch, k, recompute, moe=True) if n_moe else 0)) / v
        return chunks * per_chunk, 0.0
    full, ckpt = layer(arch, k, "none"), _checkpoint_bytes(arch, k)
    if n_moe:
        full = max(full, layer(arch, k, "none", moe=True))
    group, block, rope_freqs = layers_of(k).checkpoints(arch, k)
    n = min(group, chunk_layers)
    if block:
        per_chunk = n * ckpt + (chunk_layers - n) * full  # first n layers of each chunk checkpointed one by one
        return chunks * (per_chunk + (rope_freqs if n else 0)), full
    # uniform: one checkpoint per group of n layers
    return chunks * (math.ceil(chunk_layers / n) * ckpt + rope_freqs), n * full


def edge_activation_bytes(arch: Arch, k: Knobs, stage: int) -> float:
    """Activations outside the layers: the embedding's on the first stage (per microbatch whose first chunk is in
    flight), the head and loss on the last stage (one microbatch: its backward follows its forward at once)."""
    lay = k.layout
    p = lay.pipeline_size
    out = 0.0
    if stage == 0:
        out += layers_of(k).embedding_bytes(arch, k) * first_chunk_in_flight(p, k.virtual, max(lay.num_microbatches, 1))
    if stage == p - 1:
        out += layers_of(k).head_bytes(arch, k)
    return out


# --- whose layers: Megatron-core's or Hugging Face's (the backend row's ``layers``) --------------------------------

class LayerCode:
    """What the activation model asks of the layer code a backend runs (its row's ``layers``): the terms one layer
    keeps, how full recomputation checkpoints, what the embedding and the head keep, and the notes that say so."""

    name: ClassVar[str]
    explicit_attention: ClassVar[str] = ""
    """Appended to the explicit-attention note: what this code's unfused attention keeps beyond the table."""
    caveat: ClassVar[str] = ""
    """Appended to the activations note."""
    edge_note: ClassVar[str]
    """What the embedding / head terms assume."""

    def terms(self, arch: Arch, k: Knobs, recompute: str, moe: bool) -> dict[str, float]:
        """Bytes one layer (dense, or ``moe``) keeps for one microbatch on one GPU, by term."""
        raise NotImplementedError

    def checkpoints(self, arch: Arch, k: Knobs) -> tuple[int, bool, float]:
        """Full recomputation: (layers per checkpoint, block method: the first n layers of each chunk checkpointed
        one by one, bytes every chunk's checkpoints share)."""
        return 1, False, 0.0

    def embedding_bytes(self, arch: Arch, k: Knobs) -> float:
        """What the first stage's embedding keeps per microbatch."""
        raise NotImplementedError

    def head_bytes(self, arch: Arch, k: Knobs) -> float:
        """What the last stage keeps per microbatch after its layers: final norm, output-layer input, the loss."""
        raise NotImplementedError

    def layer_note(self, arch: Arch, k: Knobs, attn: str) -> str:
        """What the per-layer term assumes (``attn``: the attention's own note)."""
        raise NotImplementedError


class MegatronLayers(LayerCode):
    """Megatron-core's modules: every tensor autograd keeps (``megatron_layer_terms``), MoE and MLA layers,
    ``training.recompute_modules``, the recompute method and layer groups."""

    name = "megatron"
    explicit_attention = (", softmax in fp32 (Megatron attention_softmax_in_fp32), GQA K/V expanded to all heads, "
                          "causal mask")
    edge_note = ("last stage: final norm + output input 4sbh + fp32 logits 4sbV/t (Korthikanti 4.3) + the loss's "
                 "target mask and targets 9sb; first stage: token ids 8sb (+ position ids, dropout mask) per "
                 "microbatch whose embedding chunk is in flight")

    def terms(self, arch: Arch, k: Knobs, recompute: str, moe: bool) -> dict[str, float]:
        lay = k.layout
        s = local_seq(arch, k)
        mods = recompute_modules(recompute, k.recompute_modules)
        attention = "selective" if "core_attn" in mods else "none" if recompute == "selective" else recompute
        terms = megatron_layer_terms(s, lay.micro_batch_size, arch.hidden, arch.heads, lay.tensor_size,
                                     groups=arch.groups, head_dim=arch.head_dim, ffn=arch.ffn, gated=arch.gated,
                                     sp=lay.sequence_parallel, recompute=attention, flash=k.flash,
                                     hidden_dropout=arch.hidden_dropout, attention_dropout=arch.attention_dropout,
                                     act_bytes=k.act_bytes, rope=not arch.learned_positions,
                                     rmsnorm=arch.norm_params_per_h == 1, on_gpu=k.on_gpu,
                                     sdpa=sdpa_kernel(arch, k))
        if arch.mla:
            terms.update(mla_attention_terms(arch, k, s))
            if "RoPE cos/sin tables" in terms:  # MLA rotates only the qk_pos_emb_head_dim part
                terms["RoPE cos/sin tables"] *= arch.pos_dim / arch.head_dim
        if moe:
            del terms["MLP"]
            terms.update(moe_mlp_terms(arch, k, s))
        return drop_recomputed(terms, arch, k, s, mods, moe)

    def checkpoints(self, arch: Arch, k: Knobs) -> tuple[int, bool, float]:
        # with RoPE the checkpoints also keep the chunk's RoPE frequencies (fp32, s x d_h, one tensor shared by all)
        rope_freqs = (4 * local_seq(arch, k) * (arch.pos_dim if arch.mla else arch.head_dim)
                      if not arch.learned_positions else 0.0)
        return k.recompute_num_layers, k.recompute_method == "block", rope_freqs

    def embedding_bytes(self, arch: Arch, k: Knobs) -> float:
        """The token ids (int64, for the embedding's backward; with t > 1 the vocab-parallel out-of-range mask too),
        the position ids (learned positions: the engine's expanded arange, s int64) and the dropout mask."""
        lay = k.layout
        tok = local_seq(arch, k) * lay.micro_batch_size
        # token ids (the vocab-parallel lookup with t > 1 keeps its shifted copy and its out-of-range mask, 1 byte
        # each)
        out = 8 * tok + (tok if lay.tensor_size > 1 else 0) + (8 * local_seq(arch, k) if arch.learned_positions else 0)
        if arch.hidden_dropout:
            rep = tok / lay.tensor_size if lay.sequence_parallel else tok
            out += (1 if k.on_gpu else k.act_bytes) * rep * arch.hidden
        return out

    def head_bytes(self, arch: Arch, k: Knobs) -> float:
        lay = k.layout
        t, tok, e = lay.tensor_size, local_seq(arch, k) * lay.micro_batch_size, k.act_bytes
        vocab = arch.padded_vocab(t)
        rep = tok / t if lay.sequence_parallel else tok
        h = arch.hidden
        if arch.norm_params_per_h == 1:
            final_norm = (8 * rep * h + 4 * rep) if not k.on_gpu else (e * rep * h + 4 * rep)
        else:
            final_norm = e * rep * h + 2 * rep * (4 if k.on_gpu else e)
        # Korthikanti sec. 4.3: final norm, output-layer input, fp32 logits in the vocab-parallel cross-entropy
        # (4sbV/t); the cross-entropy also keeps its target mask (bool) and masked targets (int64) per token
        return final_norm + e * rep * h + 4 * tok * vocab / t + 9 * tok

    def layer_note(self, arch: Arch, k: Knobs, attn: str) -> str:
        lay = k.layout
        terms = self.terms(arch, k, "none" if k.recompute == "full" else k.recompute, arch.moe)
        big = ", ".join(f"{name} {value / max(sum(terms.values()), 1):.0%}"
                        for name, value in sorted(terms.items(), key=lambda kv: -kv[1])[:4])
        mask = "1-byte dropout masks" if k.on_gpu else "dropout noise tensors of the activation dtype (CPU build)"
        layer = (f"Megatron-core layer as autograd keeps it (exact on the CPU build, tests/integration/"
                 f"test_planner_activations.py): Korthikanti Table 2 + the fused QKV output kept alive by views, "
                 f"RoPE tables, norm statistics{', ' + mask if arch.hidden_dropout else ''}; {attn}; "
                 f"TP{lay.tensor_size}{' + SP' if lay.sequence_parallel else ''}; largest: {big}")
        if arch.moe:
            layer += (f"; MoE layers ({arch.moe_layers} of {arch.layers}): router, tokens x top-{arch.topk} "
                      f"dispatched to the experts (balanced routing assumed, estimated from Megatron-core's MoELayer, "
                      f"not measured)")
        if arch.mla:
            layer += "; multi-latent attention's latents and up-projections (estimated, not measured)"
        if lay.context_size > 1:
            layer += f"; CP{lay.context_size}: every per-token term over s / CP = {local_seq(arch, k)} tokens"
        if k.recompute == "selective" and k.recompute_modules is not None:
            layer += (f"; recompute_modules [{', '.join(k.recompute_modules)}]: their outputs recomputed in the "
                      "backward, not kept (the checkpoint inputs are)")
        return layer


class HuggingFaceLayers(LayerCode):
    """transformers' modules (SDPA, separate gate/up projections): the generalised Korthikanti table per layer, one
    checkpoint per layer under full recomputation, the returned logits and their fp32 loss at the head."""

    name = "huggingface"
    caveat = " (Hugging Face layers assumed to store what Megatron's do; their fp32 RMSNorm upcast is not counted)"
    edge_note = "last stage: HF logits 16-bit + fp32 upcast + fp32 log-softmax = 10 sbV bytes"

    def terms(self, arch: Arch, k: Knobs, recompute: str, moe: bool) -> dict[str, float]:
        lay = k.layout
        return {"layer": layer_activation_bytes(local_seq(arch, k), lay.micro_batch_size, arch.hidden, arch.heads,
                                                lay.tensor_size, groups=arch.groups, head_dim=arch.head_dim,
                                                ffn=arch.ffn, gated=arch.gated, sp=lay.sequence_parallel,
                                                recompute=recompute, flash=k.flash, hidden_dropout=arch.hidden_dropout,
                                                attention_dropout=arch.attention_dropout, act_bytes=k.act_bytes)}

    def embedding_bytes(self, arch: Arch, k: Knobs) -> float:
        """The dropout mask only."""
        return local_seq(arch, k) * k.layout.micro_batch_size * arch.hidden if arch.hidden_dropout else 0.0

    def head_bytes(self, arch: Arch, k: Knobs) -> float:
        # returned 16-bit logits + fp32 upcast + fp32 log-softmax kept for backward = (2 + 4 + 4) s b V
        lay = k.layout
        tok, e = local_seq(arch, k) * lay.micro_batch_size, k.act_bytes
        return 2 * e * tok * arch.hidden + (e + 8) * tok * arch.padded_vocab(lay.tensor_size)

    def layer_note(self, arch: Arch, k: Knobs, attn: str) -> str:
        lay = k.layout
        mlp = "SwiGLU fc1 2f + silu f + product f" if arch.gated else "GELU fc1 f + act f"
        return (f"Korthikanti Table 2 per layer generalised: {'GQA ' if arch.groups != arch.heads else ''}Q,K,V by "
                f"head counts; {mlp} (f={arch.ffn}); "
                f"{'dropout masks 1 byte' if arch.hidden_dropout else 'no dropout masks (dropout 0)'}; {attn}; "
                f"TP{lay.tensor_size}{' + SP' if lay.sequence_parallel else ''}; norm statistics not counted")


LAYER_CODES: dict[str, LayerCode] = {c.name: c for c in (MegatronLayers(), HuggingFaceLayers())}
# backend kind -> its layer code, for the kinds that train a model (asked per scored candidate: one dict lookup)
_CODE_BY_KIND = {b.kind: LAYER_CODES[b.layers] for b in backends.BACKENDS.values() if b.layers}


def layers_of(k: Knobs) -> LayerCode:
    """The layer code of ``k``'s backend (its row's ``layers``)."""
    return _CODE_BY_KIND[k.backend]


# --- a whole GPU ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StageMemory:
    stage: int
    params: int  # parameters held by one GPU of this stage
    terms: dict[str, float]
    total: float  # sum of the terms (stored: the search compares it many times)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    stages: tuple[StageMemory, ...]  # the first and the last stage (middle stages hold less than the first)
    peak: StageMemory

    @property
    def total(self) -> float:
        return self.peak.total


def stage_memory(arch: Arch, k: Knobs, stage: int, on_gpu: bool = True, memo=None) -> StageMemory:
    """Every term for one GPU of ``stage`` (``memo``: the search's, planner/memo.py: activations computed once)."""
    scheme = k.scheme  # parameters, gradients, optimizer states and the scheme's own terms (planner/sharding/)
    n, params, grads, optim = scheme.states(arch, k, stage)
    acts, working, edge = (memo.activations(arch, k, stage) if memo else
                           (*stage_activation_bytes(arch, k, stage), edge_activation_bytes(arch, k, stage)))
    terms = {PARAMETERS: params, GRADIENTS: grads, OPTIMIZER: optim, ACTIVATIONS: acts, EDGE_ACTIVATIONS: edge,
             RECOMPUTE_WS: working, **scheme.working_terms(arch, k)}
    terms[BUCKETS] = NCCL_BUFFER_BYTES + scheme.bucket_bytes(k, n) if on_gpu else 0.0
    terms[CONTEXT] = CUDA_CONTEXT_BYTES if on_gpu else 0.0
    return StageMemory(stage, n, terms, sum(terms.values()))


def estimate_memory(arch: Arch, k: Knobs, on_gpu: bool = True, memo=None) -> MemoryPlan:
    """Memory of the first and last pipeline stages; the peak is the larger (middle stages hold less than the
    first: fewer microbatches in flight and no embedding), unless a middle stage holds more MoE layers or more
    layers than the first (``busiest_moe_stage``: MoE layers placed unevenly, or uneven stages with a shorter
    first stage), which is then planned too, between them."""
    lay, p = k.layout, k.layout.pipeline_size
    first = stage_memory(arch, k, 0, on_gpu, memo)
    if p == 1:
        return MemoryPlan((first,), first)
    last = stage_memory(arch, k, p - 1, on_gpu, memo)
    middle = (memo.busiest_moe_stage if memo else busiest_moe_stage)(arch, p, k.virtual, lay.first_stage_layers,
                                                                      lay.last_stage_layers)
    stages = (first, last) if middle is None else (first, stage_memory(arch, k, middle, on_gpu, memo), last)
    return MemoryPlan(stages, max(stages, key=lambda st: st.total))


def memory_notes(arch: Arch, k: Knobs, on_gpu: bool = True) -> dict[str, str]:
    """What each term assumes, in words, for this model and configuration."""
    lay = k.layout
    t = lay.tensor_size
    params, grads, optim = k.scheme.state_notes(arch, k)
    tied = "tied: last stage keeps its own copy of the word embedding" if arch.tied and lay.pipeline_size > 1 else (
        "tied (counted once)" if arch.tied else "untied output layer on the last stage")
    code = layers_of(k)
    attn = attention_note(arch, k, code)
    layer = code.layer_note(arch, k, attn)
    if k.recompute == "full":
        kept = f"group of {k.recompute_num_layers} layers" if k.recompute_num_layers > 1 else "layer"
        layer += f"; full recompute keeps each {kept}'s input (2sbh{'/t' if lay.sequence_parallel else ''})"
    p, v = lay.pipeline_size, k.virtual
    chunks = (f"first stage holds min(p, m) = {min(p, lay.num_microbatches)} microbatches in flight (1F1B)"
              + (f" x (1 + (p-1)/(p v)) = {1 + (p - 1) / (p * v):.3f} (interleaved; the embedding chunk: "
                 f"{first_chunk_in_flight(p, v, max(lay.num_microbatches, 1))} microbatches at most)" if v > 1 else "")
              if p > 1 else "one microbatch at a time (gradient accumulation frees the rest)")
    notes = {
        PARAMETERS: f"{params}; the stage's parameters per GPU, TP{t}-sharded as Megatron does (norms and "
                    f"row-parallel biases replicated); embeddings on the first stage, {tied}; vocab padded to "
                    f"{arch.padded_vocab(t)}",
        GRADIENTS: grads,
        OPTIMIZER: optim,
        ACTIVATIONS: f"{layer}; {chunks}{code.caveat}",
        EDGE_ACTIVATIONS: code.edge_note,
        RECOMPUTE_WS: "one recompute group's full activations, rebuilt during its backward" if k.recompute == "full"
                      else "no full recomputation",
        BUCKETS: "NCCL buffers 0.5 GB (assumed)" + k.scheme.bucket_note(k) if on_gpu else "CPU ranks",
        CONTEXT: "CUDA context and kernels 1.5 GB (1-2 GB, Ultra-Scale Playbook)" if on_gpu else "CPU ranks",
    }
    notes.update(k.scheme.working_notes(arch, k))
    return notes
