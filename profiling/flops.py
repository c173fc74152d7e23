"""Parameter count and FLOPs per training step of the recipe's GPT-family model (shared with the planner).

Counted per token and per layer in forward matmul FLOPs (2 per multiply-add), then multiplied by passes:

* attention projections: Q and output ``2 h (a d)`` each, K and V ``2 h (g d)`` each (GQA: g = num_query_groups,
  d = head dim); the attention core (``Q K^T`` and ``P V``): ``4 s (a d)``, non-causal;
* MLP: ``2 h f`` per matrix, 2 matrices (GELU) or 3 (SwiGLU), f = ffn_hidden_size;
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


def num_parameters(model_cfg: "ModelConfig", vocab_size: int | None = None) -> int:
    """Trainable parameters, counted exactly: embeddings (+ learned positions, + untied output layer), per layer QKV
    (GQA-aware), output projection, MLP (2 or 3 matrices), biases when ``add_bias_linear``, two norms per layer and
    the final norm (LayerNorm: weight + bias, RMSNorm: weight).

    ``vocab_size`` overrides ``model_cfg.vocab_size`` (pass Megatron's padded vocabulary to count what it allocates).
    For a GPT with biases, LayerNorm, learned positions and tied embeddings this is Narayanan et al. 2021 eq. 2,
    ``12 L h^2 (1 + 13/(12h) + (V+s)/(12 L h))``, plus the final norm's 2h that eq. 2 leaves out.
    """
    m = model_cfg
    v = m.vocab_size if vocab_size is None else vocab_size
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    bias = bool(m.add_bias_linear)
    norm = 2 * h if m.normalization == "LayerNorm" else h
    attention = h * (q + 2 * kv) + q * h + (q + 2 * kv + h if bias else 0)
    fc1_out = 2 * f if m.activation == "swiglu" else f  # SwiGLU's gate and up projections share one fc1
    mlp = h * fc1_out + f * h + (fc1_out + h if bias else 0)
    layer = attention + mlp + 2 * norm
    embedding = v * h + (m.seq_length * h if m.position_embedding == "learned_absolute" else 0)
    output = v * h if m.untie_embeddings else 0
    return m.num_layers * layer + embedding + output + norm


def _per_token(m: "ModelConfig", convention: str, vocab_size: int | None) -> tuple[float, float, float]:
    """Forward FLOPs per token: (dense matmuls of all layers, attention core of all layers, logits)."""
    h, f, s, d = m.hidden_size, m.ffn_hidden_size, m.seq_length, m.head_dim
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    v = m.vocab_size if vocab_size is None else vocab_size
    dense = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * h * f * _mlp_matrices(m)
    core = 4 * s * q * (0.5 if convention == "megatron" else 1.0)  # causal mask: Megatron counts half the scores
    return m.num_layers * dense, m.num_layers * core, 2 * h * v


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


def flops_per_token(model_cfg: "ModelConfig", *, convention: Convention = "megatron",
                    vocab_size: int | None = None) -> float:
    """Model FLOPs per trained token (fwd + bwd); ~6 x parameters for large h (EleutherAI's C = 6 P D)."""
    return model_flops_per_step(model_cfg, 1, convention=convention, vocab_size=vocab_size) / model_cfg.seq_length
