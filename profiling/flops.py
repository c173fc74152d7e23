"""Parameter count and FLOPs per training step of the recipe's GPT-family model (shared with the planner).

Counted per token and per layer in forward matmul FLOPs (2 per multiply-add), then multiplied by passes:

* attention projections: Q and output ``2 h (a d)`` each, K and V ``2 h (g d)`` each (GQA: g = num_query_groups,
  d = head dim; multi-latent attention: 2 x its projection parameters); the attention core (``Q K^T`` and
  ``P V``): ``4 s (a d)``, non-causal;
* MLP: ``2 h f`` per matrix, 2 matrices (GELU) or 3 (SwiGLU), f = ffn_hidden_size; in MoE layers the router
  ``2 h E`` plus the ``moe_router_topk`` experts a token is routed to and the shared expert (active FLOPs);
* logits: ``2 h V`` once per token (not per layer; not recomputed).

Forward + backward = 3 forward passes (backward computes data and weight gradients). Norms, biases, softmax,
activations and the embedding lookup are left out, as in both published forms.

Conventions (MFU figures are comparable only within one; the collector names the one it used):

``korthikanti``
    Korthikanti et al. 2022: the attention core counted in full (no causal saving). For dense MHA with ffn = 4h this
    is eq. 7, ``72 B L s h^2 (1 + s/(6h) + V/(12 h L))``. Selective recompute follows eq. 8 as published,
    ``72 B L s h^2 (1 + s/(3h) + V/(12 h L))``: the paper adds the attention core's fwd+bwd cost once more.
    Full recompute is one more forward of every layer: Narayanan et al. 2021 eq. 3,
    ``96 B s L h^2 (1 + s/(6h) + V/(16 L h))``.
``megatron``
    Megatron-LM's ``num_floating_point_operations`` since March 2025: the causal attention core is halved, giving
    ``72 B s L h^2 (1 + s/(12h) + V/(12 L h))`` for dense MHA with ffn = 4h. Megatron-LM itself never counts
    recomputation; our hardware FLOPs add one forward of what is recomputed (the halved attention core for
    selective, every layer for full).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from hpc_tools.recipe.model import ModelConfig

Convention = Literal["megatron", "korthikanti"]
Recompute = Literal["none", "selective", "full"]
CONVENTIONS = ("megatron", "korthikanti")
RECOMPUTE = ("none", "selective", "full")


def _check(convention: str, recompute: str = "none") -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"flops convention {convention!r} is unknown; use one of {', '.join(CONVENTIONS)}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} is unknown; use one of {', '.join(RECOMPUTE)}")


def _mlp_matrices(m: "ModelConfig") -> int:
    return 3 if m.activation == "swiglu" else 2


def _mlp_parameters(m: "ModelConfig", f: int) -> int:
    """One MLP of width ``f``: fc1 (2f outputs under SwiGLU: gate and up share it), fc2, their biases."""
    h = m.hidden_size
    fc1_out = 2 * f if m.activation == "swiglu" else f
    return h * fc1_out + f * h + ((fc1_out + h) if m.add_bias_linear else 0)


def attention_parameters(m: "ModelConfig") -> int:
    """One layer's attention projections. Standard (GQA-aware): QKV ``h (q + 2 kv)`` + output ``q h`` (+ biases).
    Multi-latent attention (Megatron-core's ``MLASelfAttention``, DeepSeek-V2/V3): query down-projection ``h r_q``, its
    norm ``r_q`` and up-projection ``r_q a (d_nope + d_rope)`` (or one ``h a (d_nope + d_rope)`` without q_lora_rank),
    key/value down-projection ``h (r_kv + d_rope)``, its norm ``r_kv``, up-projection ``r_kv a (d_nope + d_v)``, and
    the output ``a d_v h``."""
    h, a = m.hidden_size, m.num_attention_heads
    bias = bool(m.add_bias_linear)
    if m.multi_latent_attention:
        qk, pos, v, kv = m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank
        q_out = a * (qk + pos)
        q = h * q_out if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * q_out
        kv_part = h * (kv + pos) + kv + kv * a * (qk + v)
        return q + kv_part + a * v * h + (h if bias else 0)
    d = m.head_dim
    q, kvd = a * d, m.num_query_groups * d
    return h * (q + 2 * kvd) + q * h + (q + 2 * kvd + h if bias else 0)


def layer_parameters(m: "ModelConfig", moe: bool, active: bool = False) -> int:
    """One transformer layer: attention, two norms, and its MLP: dense, or (``moe``) the router ``E h`` (+ E biases),
    ``E``
    routed experts of ``moe_ffn_hidden_size`` (``active``: the ``moe_router_topk`` a token passes through) and the
    shared expert. The expert bias of aux-loss-free routing is a buffer, not a parameter."""
    norm = 2 * m.hidden_size if m.normalization == "LayerNorm" else m.hidden_size
    out = attention_parameters(m) + 2 * norm
    if not moe:
        return out + _mlp_parameters(m, m.ffn_hidden_size)
    experts = m.moe_router_topk if active else m.num_experts
    router = m.num_experts * (m.hidden_size + (1 if m.add_bias_linear else 0))
    out += router + experts * _mlp_parameters(m, m.moe_ffn_hidden_size or m.ffn_hidden_size)
    if m.moe_shared_expert_intermediate_size:
        out += _mlp_parameters(m, m.moe_shared_expert_intermediate_size)
    return out


def num_parameters(model_cfg: "ModelConfig", vocab_size: int | None = None) -> int:
    """Trainable parameters, counted exactly: embeddings (+ learned positions, + untied output layer), per layer QKV
    (GQA-aware) or multi-latent attention, output projection, MLP (2 or 3 matrices) or, in MoE layers, the router,
    every routed expert and the shared expert, biases when ``add_bias_linear``, two norms per layer and the final
    norm (LayerNorm: weight + bias, RMSNorm: weight).

    ``vocab_size`` overrides ``model_cfg.vocab_size`` (pass Megatron's padded vocabulary to count what it allocates).
    For a GPT with biases, LayerNorm, learned positions and tied embeddings this is Narayanan et al. 2021 eq. 2,
    ``12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h))``, plus the final norm's 2h that eq. 2 leaves out. Mixtral 8x7B's
    published config counts 46.7 B, DeepSeek-V3's 671 B (its multi-token-prediction module not included).
    """
    return _count(model_cfg, vocab_size, active=False)


def active_parameters(model_cfg: "ModelConfig", vocab_size: int | None = None, input_embedding: bool = True) -> int:
    """Parameters one token passes through: every dense part, and in MoE layers the router, the top-k routed experts
    and the shared expert; the input embedding counted whole unless ``input_embedding`` is False (a token reads one
    row of it). Equal to ``num_parameters`` for a dense model. Mixtral 8x7B: 12.9 B; DeepSeek-V3: 37.6 B, 36.6 B
    without the input embedding (published: 37 B)."""
    out = _count(model_cfg, vocab_size, active=True)
    if not input_embedding:
        v = model_cfg.vocab_size if vocab_size is None else vocab_size
        out -= v * model_cfg.hidden_size
    return out


def _count(m: "ModelConfig", vocab_size: int | None, active: bool) -> int:
    v = m.vocab_size if vocab_size is None else vocab_size
    h = m.hidden_size
    moe = m.moe_layers()
    n_moe = sum(moe)
    layers = ((m.num_layers - n_moe) * layer_parameters(m, False)
              + (n_moe * layer_parameters(m, True, active) if n_moe else 0))
    norm = 2 * h if m.normalization == "LayerNorm" else h
    embedding = v * h + (m.seq_length * h if m.position_embedding == "learned_absolute" else 0)
    output = v * h if m.untie_embeddings else 0
    return layers + embedding + output + norm


def _attention_flops(m: "ModelConfig", convention: str) -> tuple[float, float]:
    """Forward FLOPs per token of one layer's attention: (projections, core). Core: ``Q K^T`` over the query/key head
    dimension and ``P V`` over the value head dimension, ``2 s a (d_qk + d_v)`` (halved under ``megatron``: causal)."""
    s, a = m.seq_length, m.num_attention_heads
    if m.multi_latent_attention:
        d_qk, d_v = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim
        norms = (m.q_lora_rank or 0) + m.kv_lora_rank
        projections = 2 * (attention_parameters(m) - norms - (m.hidden_size if m.add_bias_linear else 0))
    else:
        d_qk = d_v = m.head_dim
        q, kv = a * m.head_dim, m.num_query_groups * m.head_dim
        projections = 2 * m.hidden_size * (q + 2 * kv) + 2 * q * m.hidden_size
    core = 2 * s * a * (d_qk + d_v) * (0.5 if convention == "megatron" else 1.0)
    return projections, core


def _mlp_flops(m: "ModelConfig", moe: bool) -> float:
    """Forward FLOPs per token of one layer's MLP: ``2 h f`` per matrix; in an MoE layer the router ``2 h E``, the
    top-k routed experts and the shared expert."""
    h, mats = m.hidden_size, _mlp_matrices(m)
    if not moe:
        return 2 * h * m.ffn_hidden_size * mats
    out = 2 * h * m.num_experts + m.moe_router_topk * 2 * h * (m.moe_ffn_hidden_size or m.ffn_hidden_size) * mats
    if m.moe_shared_expert_intermediate_size:
        out += 2 * h * m.moe_shared_expert_intermediate_size * mats
    return out


def _per_token(m: "ModelConfig", convention: str, vocab_size: int | None) -> tuple[float, float, float]:
    """Forward FLOPs per token: (dense matmuls of all layers, attention core of all layers, logits). In MoE layers a
    token's matmuls are those of the experts it is routed to (``moe_router_topk``), the shared expert and the
    router."""
    v = m.vocab_size if vocab_size is None else vocab_size
    projections, core = _attention_flops(m, convention)
    n_moe = sum(m.moe_layers())
    dense = (m.num_layers * projections + (m.num_layers - n_moe) * _mlp_flops(m, False)
             + (n_moe * _mlp_flops(m, True) if n_moe else 0))
    return dense, m.num_layers * core, 2 * m.hidden_size * v


def model_flops_per_step(model_cfg: "ModelConfig", global_batch: int, *, convention: Convention = "megatron",
                         vocab_size: int | None = None) -> float:
    """Model FLOPs of one optimizer step (forward + backward, no recomputation) for ``global_batch`` sequences."""
    _check(convention)
    layers, core, logits = _per_token(model_cfg, convention, vocab_size)
    return 3.0 * (layers + core + logits) * global_batch * model_cfg.seq_length


def hardware_flops_per_step(model_cfg: "ModelConfig", global_batch: int, recompute: Recompute = "none", *,
                            convention: Convention = "megatron", vocab_size: int | None = None) -> float:
    """FLOPs the GPUs execute in one step, counting activation recomputation (for HFU).

    ``none``: the model FLOPs. ``full``: one extra forward of every layer (logits are not recomputed).
    ``selective``: ``korthikanti`` follows eq. 8 (attention core fwd+bwd counted twice); ``megatron`` adds one
    forward of the causal-halved attention core.
    """
    _check(convention, recompute)
    layers, core, logits = _per_token(model_cfg, convention, vocab_size)
    passes = 3.0 * (layers + core + logits)
    if recompute == "full":
        passes += layers + core
    elif recompute == "selective":
        passes += 3.0 * core if convention == "korthikanti" else core
    return passes * global_batch * model_cfg.seq_length


def hardware_flops_parts(model_cfg: "ModelConfig", global_batch: int, recompute: Recompute = "none", *,
                         convention: Convention = "megatron", vocab_size: int | None = None) -> tuple[float, float]:
    """``hardware_flops_per_step`` in two parts: (the layers' weight GEMMs: projections, MLPs, experts, router; the
    rest: attention core and logits). FP8 training runs the first part in FP8 (Transformer Engine's linear layers),
    the second in 16-bit."""
    _check(convention, recompute)
    layers, core, logits = _per_token(model_cfg, convention, vocab_size)
    gemm, rest = 3.0 * layers, 3.0 * (core + logits)
    if recompute == "full":
        gemm, rest = gemm + layers, rest + core
    elif recompute == "selective":
        rest += 3.0 * core if convention == "korthikanti" else core
    tokens = global_batch * model_cfg.seq_length
    return gemm * tokens, rest * tokens


def recomputed_flops_per_token(model_cfg: "ModelConfig", modules: "tuple[str, ...] | list[str]", *,
                               convention: Convention = "megatron") -> tuple[float, float]:
    """Forward FLOPs per token that selective recomputation of ``modules`` (Megatron-core's ``recompute_modules``
    names) runs again in the backward, as (weight-GEMM part, the rest). ``core_attn``: the attention core of every
    layer (``korthikanti``: eq. 8's 3x, as ``hardware_flops_per_step``'s selective case); ``mla_up_proj``: multi-latent
    attention's query and key/value up-projections; ``mlp``: the dense layers' MLPs; ``moe``: the MoE layers' router,
    routed top-k and shared experts; ``shared_experts``: the shared experts. A module inside a recomputed ``moe``
    layer is recomputed again by its own checkpoint (counted twice, as it runs). ``layernorm`` and ``moe_act`` are
    elementwise: no matmul FLOPs (left out here as norms and activations are everywhere)."""
    m = model_cfg
    n_moe = sum(m.moe_layers())
    mats = _mlp_matrices(m)
    gemm = rest = 0.0
    if "core_attn" in modules:
        core = m.num_layers * _attention_flops(m, convention)[1]
        rest += 3.0 * core if convention == "korthikanti" else core
    if "mla_up_proj" in modules and m.multi_latent_attention:
        a = m.num_attention_heads
        q_up = (m.q_lora_rank or 0) * a * (m.qk_head_dim + m.qk_pos_emb_head_dim)
        gemm += m.num_layers * 2 * (q_up + m.kv_lora_rank * a * (m.qk_head_dim + m.v_head_dim))
    if "mlp" in modules:
        gemm += (m.num_layers - n_moe) * _mlp_flops(m, False)
    if "moe" in modules and n_moe:
        gemm += n_moe * _mlp_flops(m, True)
    if "shared_experts" in modules and n_moe and m.moe_shared_expert_intermediate_size:
        gemm += n_moe * 2 * m.hidden_size * m.moe_shared_expert_intermediate_size * mats
    return gemm, rest


def flops_per_token(model_cfg: "ModelConfig", *, convention: Convention = "megatron",
                    vocab_size: int | None = None) -> float:
    """Model FLOPs per trained token (fwd + bwd); ~6 x parameters for large h (EleutherAI's C = 6 P D)."""
    return model_flops_per_step(model_cfg, 1, convention=convention, vocab_size=vocab_size) / model_cfg.seq_length
