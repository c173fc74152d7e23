"""``model:`` — the GPT-family architecture, shared by the Megatron and DeepSpeed jobs."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from hpc_tools.recipe.base import Section

# The family only fills in the defaults below; every resolved recipe carries explicit values.
FAMILY_DEFAULTS = {
    "gpt": {"normalization": "LayerNorm", "activation": "gelu", "position_embedding": "learned_absolute",
            "untie_embeddings": False, "add_bias_linear": True},
    "llama": {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding": "rope",
              "untie_embeddings": True, "add_bias_linear": False},
}

# model.moe_layer_freq: every N-th layer, or one 0/1 per layer
LayerFreq = Annotated[int, Field(gt=0, le=100_000)] | Annotated[list[Literal[0, 1]], Field(max_length=100_000)]


def default_ffn_hidden_size(hidden_size: int, activation: str) -> int:
    """4h for GELU; for SwiGLU 8h/3 rounded up to a multiple of 64 (LLaMA's convention keeps the FLOPs of 4h GELU)."""
    if activation == "swiglu":
        return -(-int(8 * hidden_size / 3) // 64) * 64
    return 4 * hidden_size


def pad_vocab(vocab_size: int, tensor_size: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: ``vocab_size`` rounded up to a multiple of ``divisible_by * tensor_size``."""
    multiple = divisible_by * tensor_size
    return -(-vocab_size // multiple) * multiple


class ModelConfig(Section):
    family: Literal["gpt", "llama"] = "gpt"
    """Architecture preset: `gpt` (LayerNorm, GELU, learned positions, tied embeddings) or `llama` (RMSNorm, SwiGLU,
    RoPE, untied)."""
    num_layers: int = Field(gt=0, le=100_000)
    """Number of transformer layers (L)."""
    hidden_size: int = Field(gt=0, le=1 << 20)
    """Model width (h)."""
    num_attention_heads: int = Field(gt=0, le=1 << 16)
    """Attention heads (a)."""
    num_query_groups: int | None = Field(default=None, gt=0, le=1 << 16)
    """Key/value head groups for grouped-query attention; null = one per head (plain multi-head attention)."""
    ffn_hidden_size: int | None = Field(default=None, gt=0, le=1 << 24)
    """MLP width; null = 4h (GELU) or 8h/3 rounded up to 64 (SwiGLU)."""
    seq_length: int = Field(gt=0, le=1 << 31)
    """Training sequence length in tokens (s)."""
    vocab_size: int = Field(gt=0, le=1 << 31)
    """Vocabulary size (V), at least the tokenizer's; the jobs pad it for tensor parallelism."""
    normalization: Literal["LayerNorm", "RMSNorm"] | None = None
    """Norm layer; null = the family's."""
    activation: Literal["gelu", "swiglu"] | None = None
    """MLP activation; null = the family's."""
    position_embedding: Literal["learned_absolute", "rope"] | None = None
    """Position encoding; null = the family's."""
    rotary_base: int = Field(default=10000, gt=0)
    """RoPE base frequency (only with position_embedding: rope)."""
    untie_embeddings: bool | None = None
    """Separate input embedding and output projection; null = the family's."""
    add_bias_linear: bool | None = None
    """Biases in the linear layers; null = the family's."""
    hidden_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout after attention and MLP (0 makes runs comparable across layouts)."""
    attention_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on attention probabilities."""
    init_method_std: float = Field(default=0.02, gt=0.0)
    """Standard deviation of the normal weight initialisation."""
    norm_epsilon: float = Field(default=1e-5, gt=0.0)
    """Epsilon of the norm layers."""

    # --- mixture of experts (Megatron-core's argument names) ---
    num_experts: int | None = Field(default=None, gt=0, le=1 << 16)
    """Routed experts per MoE layer (E); null = a dense model (every layer one MLP). Experts are split across
    parallel.expert_size ranks."""
    moe_router_topk: int = Field(default=2, gt=0, le=1 << 16)
    """Experts each token is routed to (k; at most num_experts)."""
    moe_ffn_hidden_size: int | None = Field(default=None, gt=0, le=1 << 24)
    """Hidden width of one routed expert's MLP; null = ffn_hidden_size (filled in when num_experts is set)."""
    moe_shared_expert_intermediate_size: int | None = Field(default=None, gt=0, le=1 << 24)
    """Hidden width of the shared expert(s) every token also passes through (DeepSeek-style, the total over all
    shared experts); null = no shared expert."""
    moe_layer_freq: LayerFreq = 1
    """Which layers are MoE layers: an int N makes every N-th layer one (1 = all); a list gives one 0 (dense MLP) or 1
    (MoE) per layer, num_layers long (DeepSeek-V3: three 0s, then 1s)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    """Router load balancing: `aux_loss` (Switch/GShard auxiliary loss over the micro batch), `seq_aux_loss` (per
    sequence, DeepSeek-V2/V3) or `none`."""
    moe_aux_loss_coeff: float = Field(default=0.01, ge=0.0, le=1e3)
    """Weight of the load-balancing auxiliary loss (0 = logged only)."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router score: `softmax` over the experts (Mixtral) or `sigmoid` per expert (DeepSeek-V3)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the scores for the top-k choice only,
    updated from the router load (a buffer, not a trained parameter)."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach their experts across the expert-parallel group: `alltoall` (each token sent to the ranks of
    its experts) or `allgather` (every rank gathers all tokens)."""
    moe_expert_capacity_factor: float | None = Field(default=None, gt=0.0, le=1e3)
    """Tokens an expert takes, as a multiple of its even share (k x tokens / E); tokens beyond it are dropped.
    null = dropless (every token reaches its experts)."""
    moe_grouped_gemm: bool | None = None
    """Run the local experts as one grouped GEMM; null = on with a GPU and Transformer Engine, off on CPU ranks."""

    # --- multi-latent attention (DeepSeek-V2/V3) ---
    multi_latent_attention: bool = False
    """Multi-latent attention: queries and keys/values pass through low-rank latents (q_lora_rank, kv_lora_rank)
    and each head has a no-position part (qk_head_dim) and a shared RoPE part (qk_pos_emb_head_dim)."""
    q_lora_rank: int | None = Field(default=None, gt=0, le=1 << 20)
    """MLA: rank of the query down-projection; null = queries projected directly from the hidden state."""
    kv_lora_rank: int = Field(default=512, gt=0, le=1 << 20)
    """MLA: rank of the compressed key/value latent."""
    qk_head_dim: int = Field(default=128, gt=0, le=1 << 16)
    """MLA: per-head query/key dimension without position embedding."""
    qk_pos_emb_head_dim: int = Field(default=64, gt=0, le=1 << 16)
    """MLA: per-head query/key dimension that carries RoPE (the key part is shared by all heads)."""
    v_head_dim: int = Field(default=128, gt=0, le=1 << 16)
    """MLA: per-head value dimension."""

    @model_validator(mode="after")
    def _fill_family_defaults(self) -> "ModelConfig":
        for key, value in FAMILY_DEFAULTS[self.family].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", default_ffn_hidden_size(self.hidden_size, self.activation))
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        return self

    @property
    def is_moe(self) -> bool:
        """The model has routed experts (num_experts set)."""
        return self.num_experts is not None

    def moe_layers(self) -> list[bool]:
        """One flag per layer: True where the layer's MLP is a mixture of experts (``moe_layer_freq``, as Megatron
        reads it); all False for a dense model. A list of the wrong length is a rule violation, read here as given
        (padded with 0s or cut)."""
        n = self.num_layers
        if self.num_experts is None:
            return [False] * n
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            return [i % freq == 0 for i in range(n)]
        return [bool(x) for x in (list(freq) + [0] * n)[:n]]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_size: int, divisible_by: int = 128) -> int:
        """Vocabulary padded as Megatron pads it: up to a multiple of ``divisible_by * tensor_size``."""
        return pad_vocab(self.vocab_size, tensor_size, divisible_by)
