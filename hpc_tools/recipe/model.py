"""``model:`` — the GPT-family architecture, shared by the Megatron and DeepSpeed jobs."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hpc_tools.recipe.base import Section

# The family only fills in the defaults below; every resolved recipe carries explicit values.
FAMILY_DEFAULTS = {
    "gpt": {"normalization": "LayerNorm", "activation": "gelu", "position_embedding": "learned_absolute",
            "untie_embeddings": False, "add_bias_linear": True},
    "llama": {"normalization": "RMSNorm", "activation": "swiglu", "position_embedding": "rope",
              "untie_embeddings": True, "add_bias_linear": False},
}


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

    @model_validator(mode="after")
    def _fill_family_defaults(self) -> "ModelConfig":
        for key, value in FAMILY_DEFAULTS[self.family].items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", default_ffn_hidden_size(self.hidden_size, self.activation))
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_size: int, divisible_by: int = 128) -> int:
        """Vocabulary padded as Megatron pads it: up to a multiple of ``divisible_by * tensor_size``."""
        return pad_vocab(self.vocab_size, tensor_size, divisible_by)
