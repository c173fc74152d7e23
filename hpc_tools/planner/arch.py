"""The model as the planner sees it: shapes, and parameters per tensor so that tensor and pipeline sharding are exact.

Total parameter counts are owned by ``profiling.flops.num_parameters``; this module only splits the same count into
pieces (embedding, one layer, final norm, output layer) and shards each piece as Megatron does. A unit test holds
``sum of pieces == profiling.flops.num_parameters`` and both against the real Megatron-core and Hugging Face models.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from hpc_tools import backends

if TYPE_CHECKING:
    from hpc_tools.recipe.model import ModelConfig
    from hpc_tools.recipe.schema import Recipe


# eq=False: hashed by identity, so the caches below cost nothing per call (the search calls them ~10^4 times).
@dataclass(frozen=True, slots=True, eq=False)
class Arch:
    """Shapes of a GPT-family model (GQA, SwiGLU, untied embeddings included)."""

    layers: int
    hidden: int
    heads: int
    groups: int  # key/value heads (= heads without GQA)
    head_dim: int
    ffn: int
    seq: int
    vocab: int  # unpadded; see padded_vocab()
    gated: bool  # SwiGLU: fc1 produces 2 x ffn
    norm_params_per_h: int  # LayerNorm: weight + bias = 2; RMSNorm: 1
    bias: bool
    learned_positions: bool
    tied: bool
    hidden_dropout: bool
    attention_dropout: bool
    pad_vocab: bool = True  # Megatron pads the vocabulary for TP; the DeepSpeed (Hugging Face) job does not

    @classmethod
    def from_model(cls, m: "ModelConfig", pad_vocab: bool = True) -> "Arch":
        """``pad_vocab``: True for Megatron jobs (``ModelConfig.padded_vocab_size``), False for DeepSpeed jobs."""
        return cls(pad_vocab=pad_vocab, layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                   groups=m.num_query_groups, head_dim=m.hidden_size // m.num_attention_heads, ffn=m.ffn_hidden_size,
                   seq=m.seq_length, vocab=m.vocab_size, gated=m.activation == "swiglu",
                   norm_params_per_h=2 if m.normalization == "LayerNorm" else 1, bias=bool(m.add_bias_linear),
                   learned_positions=m.position_embedding == "learned_absolute", tied=not m.untie_embeddings,
                   hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0)

    def padded_vocab(self, tensor: int, divisible_by: int = 128) -> int:
        """The vocabulary the job allocates: ``ModelConfig.padded_vocab_size`` (a multiple of divisible_by x TP) for
        Megatron, the plain vocabulary for the Hugging Face models of DeepSpeed jobs."""
        from hpc_tools.recipe.model import pad_vocab

        return pad_vocab(self.vocab, tensor, divisible_by) if self.pad_vocab else self.vocab


def arch_for(recipe: "Recipe") -> Arch:
    """The recipe's model as its job builds it (vocabulary padded where the backend pads it)."""
    return Arch.from_model(recipe.model, pad_vocab=backends.of(recipe).pads_vocab)


@dataclass(frozen=True, slots=True)
class Pieces:
    """Parameters held by ONE GPU of a tensor-parallel group of size t, piece by piece."""

    word_embedding: int  # V_pad x h / t (vocab-parallel)
    position_embedding: int  # s x h, replicated (learned positions only)
    layer: int  # one transformer layer
    final_norm: int
    output_layer: int  # V_pad x h / t when untied, else 0 (tied: shares word_embedding)


@lru_cache(maxsize=256)
def pieces(arch: Arch, tensor: int = 1) -> Pieces:
    """Per-GPU parameter pieces under tensor parallelism ``tensor`` (column/row-parallel splits as in Megatron)."""
    h, t, dh = arch.hidden, tensor, arch.head_dim
    norm = arch.norm_params_per_h * h  # replicated across TP
    qkv_out = (arch.heads + 2 * arch.groups) * dh  # column-parallel: weight and bias split
    attn_out = arch.heads * dh
    fc1_out = arch.ffn * (2 if arch.gated else 1)
    b = 1 if arch.bias else 0
    layer = (norm + (h * qkv_out + b * qkv_out) // t  # input norm, QKV
             + attn_out * h // t + b * h  # output projection (row-parallel: its bias is replicated)
             + norm + (h * fc1_out + b * fc1_out) // t  # pre-MLP norm, fc1
             + arch.ffn * h // t + b * h)  # fc2 (row-parallel)
    vocab = arch.padded_vocab(t)
    word = vocab * h // t
    return Pieces(word_embedding=word, position_embedding=arch.seq * h if arch.learned_positions else 0, layer=layer,
                  final_norm=norm, output_layer=0 if arch.tied else word)


def total_parameters(arch: Arch) -> int:
    """Parameters of the whole model (TP1, tied embeddings counted once), over the vocabulary the job allocates."""
    pc = pieces(arch, 1)
    return pc.word_embedding + pc.position_embedding + arch.layers * pc.layer + pc.final_norm + pc.output_layer


@lru_cache(maxsize=4096)
def fsdp_parameters(arch: Arch, tensor: int) -> int:
    """Parameters on one GPU under FSDP x TP before FSDP shards them: every block split by TP (``pieces``), the
    embeddings, final norm and output layer whole (the tensor-parallel plan splits the blocks only)."""
    whole = pieces(arch, 1)
    return (arch.layers * pieces(arch, tensor).layer + whole.word_embedding + whole.position_embedding
            + whole.final_norm + (0 if arch.tied else whole.output_layer))


def stage_parameters(arch: Arch, tensor: int, pipeline: int, stage: int) -> int:
    """Parameters on one GPU of pipeline stage ``stage``: its layers; the embeddings on the first stage; the final
    norm and output layer on the last (with tied embeddings and p > 1 the last stage holds its own copy of the word
    embedding, whose gradient is all-reduced with the first stage's)."""
    pc = pieces(arch, tensor)
    n = arch.layers // pipeline * pc.layer
    if stage == 0:
        n += pc.word_embedding + pc.position_embedding
    if stage == pipeline - 1:
        n += pc.final_norm + (pc.output_layer if not arch.tied else (pc.word_embedding if pipeline > 1 else 0))
    return n
