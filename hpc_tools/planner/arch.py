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
from hpc_tools.layout import pipeline_chunks

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
    # mixture of experts (experts = 0: a dense model)
    experts: int = 0  # routed experts per MoE layer (E)
    topk: int = 0  # experts per token (k)
    moe_ffn: int = 0  # one routed expert's MLP width
    shared_ffn: int = 0  # the shared expert's MLP width (0: none)
    moe_flags: tuple[bool, ...] = ()  # per layer: an MoE layer; () = none
    # multi-latent attention (mla False: standard attention with head_dim)
    mla: bool = False
    q_lora: int = 0  # 0: queries projected directly
    kv_lora: int = 0
    qk_dim: int = 0  # per-head query/key dimension without position embedding
    pos_dim: int = 0  # per-head RoPE part of queries/keys (the key part shared by the heads)
    v_dim: int = 0

    @classmethod
    def from_model(cls, m: "ModelConfig", pad_vocab: bool = True) -> "Arch":
        """``pad_vocab``: True for Megatron jobs (``ModelConfig.padded_vocab_size``), False for DeepSpeed jobs."""
        moe = m.num_experts is not None
        return cls(pad_vocab=pad_vocab, layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads,
                   groups=m.num_query_groups, head_dim=m.hidden_size // m.num_attention_heads, ffn=m.ffn_hidden_size,
                   seq=m.seq_length, vocab=m.vocab_size, gated=m.activation == "swiglu",
                   norm_params_per_h=2 if m.normalization == "LayerNorm" else 1, bias=bool(m.add_bias_linear),
                   learned_positions=m.position_embedding == "learned_absolute", tied=not m.untie_embeddings,
                   hidden_dropout=m.hidden_dropout > 0, attention_dropout=m.attention_dropout > 0,
                   experts=m.num_experts or 0, topk=m.moe_router_topk if moe else 0,
                   moe_ffn=(m.moe_ffn_hidden_size or m.ffn_hidden_size) if moe else 0,
                   shared_ffn=(m.moe_shared_expert_intermediate_size or 0) if moe else 0,
                   moe_flags=tuple(m.moe_layers()) if moe else (), mla=m.multi_latent_attention,
                   q_lora=m.q_lora_rank or 0, kv_lora=m.kv_lora_rank, qk_dim=m.qk_head_dim,
                   pos_dim=m.qk_pos_emb_head_dim, v_dim=m.v_head_dim)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        """MoE layers in the whole model."""
        return sum(self.moe_flags)

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
    layer: int  # one dense transformer layer
    final_norm: int
    output_layer: int  # V_pad x h / t when untied, else 0 (tied: shares word_embedding)
    moe_layer: int = 0  # one MoE layer without its routed experts: attention, norms, router, shared expert
    experts: int = 0  # the routed experts of one MoE layer, all of them, unsplit (divide by EP x ETP)


def _mlp(arch: Arch, f: int, t: int) -> int:
    """One MLP of width f under TP t: fc1 (2f under SwiGLU) column-parallel, fc2 row-parallel (bias replicated)."""
    h, b = arch.hidden, 1 if arch.bias else 0
    fc1_out = f * (2 if arch.gated else 1)
    return (h * fc1_out + b * fc1_out) // t + f * h // t + b * h


def _attention(arch: Arch, t: int) -> int:
    """One layer's attention projections on one GPU of TP t. MLA: the down-projections and latent norms
    replicated, the up-projections column-parallel, the output row-parallel."""
    h, b = arch.hidden, 1 if arch.bias else 0
    if arch.mla:
        a, q_out = arch.heads, arch.heads * (arch.qk_dim + arch.pos_dim)
        down = h * (arch.kv_lora + arch.pos_dim) + arch.kv_lora + (h * arch.q_lora + arch.q_lora if arch.q_lora else 0)
        up = (arch.q_lora * q_out if arch.q_lora else h * q_out) + arch.kv_lora * a * (arch.qk_dim + arch.v_dim)
        return down + up // t + a * arch.v_dim * h // t + b * h
    dh = arch.head_dim
    qkv_out = (arch.heads + 2 * arch.groups) * dh  # column-parallel: weight and bias split
    return (h * qkv_out + b * qkv_out) // t + arch.heads * dh * h // t + b * h


@lru_cache(maxsize=256)
def pieces(arch: Arch, tensor: int = 1) -> Pieces:
    """Per-GPU parameter pieces under tensor parallelism ``tensor`` (column/row-parallel splits as in Megatron)."""
    h, t = arch.hidden, tensor
    norm = arch.norm_params_per_h * h  # replicated across TP
    attention = _attention(arch, t) + 2 * norm
    layer = attention + _mlp(arch, arch.ffn, t)
    moe_layer = experts = 0
    if arch.moe:  # the router (replicated, fp32 in Megatron) and the shared expert (TP-split) stay with the layer
        moe_layer = (attention + arch.experts * (h + (1 if arch.bias else 0))
                     + (_mlp(arch, arch.shared_ffn, t) if arch.shared_ffn else 0))
        experts = arch.experts * _mlp(arch, arch.moe_ffn, 1)
    vocab = arch.padded_vocab(t)
    word = vocab * h // t
    return Pieces(word_embedding=word, position_embedding=arch.seq * h if arch.learned_positions else 0, layer=layer,
                  final_norm=norm, output_layer=0 if arch.tied else word, moe_layer=moe_layer, experts=experts)


@lru_cache(maxsize=4096)
def stage_layer_counts(arch: Arch, pipeline: int, stage: int, virtual: int = 1, first: int | None = None,
                       last: int | None = None) -> tuple[int, int]:
    """(dense layers, MoE layers) on pipeline stage ``stage``, the layers Megatron-core assigns its ``virtual``
    model chunks (``layout.pipeline_chunks``: even stages, chunks ``stage + p j`` of the ``p v`` equal chunks;
    uneven ones, ``first`` / ``last`` layers on the first / last stage and equal shares of the rest between)."""
    chunks = pipeline_chunks(arch.layers, pipeline, virtual, first, last)
    if chunks is None:  # a split the rules refuse (never planned): equal shares, rounded down
        chunk = arch.layers // (pipeline * virtual)
        chunks = tuple(tuple(range((s + pipeline * j) * chunk, (s + pipeline * j + 1) * chunk) for j in range(virtual))
                       for s in range(pipeline))
    mine = chunks[stage]
    n = sum(len(c) for c in mine)
    if not arch.moe:
        return n, 0
    n_moe = sum(sum(arch.moe_flags[c.start:c.stop]) for c in mine)
    return n - n_moe, n_moe


def busiest_moe_stage(arch: Arch, pipeline: int, virtual: int = 1, first: int | None = None,
                      last: int | None = None) -> int | None:
    """The middle pipeline stage with the most MoE layers, then the most layers (the earliest of them: it holds the
    most microbatches in flight) when it holds more than the first stage; None otherwise. A ``moe_layer_freq`` list
    such as DeepSeek-V3's (dense layers first) loads the stages unevenly, and so does a first stage shorter than the
    middle ones (uneven stages): a middle stage then can hold more than the first, and is planned too."""
    if pipeline < 3 or (not arch.moe and first is None and last is None):
        return None
    counts = [stage_layer_counts(arch, pipeline, s, virtual, first, last) for s in range(pipeline)]
    load = [(n_moe, n_dense + n_moe) for n_dense, n_moe in counts]
    best = max(range(1, pipeline - 1), key=lambda s: (load[s], -s))
    return best if load[best] > load[0] else None


def stage_layers(arch: Arch, pipeline: int, virtual: int = 1, first: int | None = None,
                 last: int | None = None) -> int:
    """Layers on the longest pipeline stage: the stage that sets the pipeline's pace (L / p when even)."""
    return max(sum(stage_layer_counts(arch, pipeline, s, virtual, first, last)) for s in range(pipeline))


def total_parameters(arch: Arch) -> int:
    """Parameters of the whole model (TP1, tied embeddings counted once), over the vocabulary the job allocates."""
    pc = pieces(arch, 1)
    n_moe = arch.moe_layers
    return (pc.word_embedding + pc.position_embedding + (arch.layers - n_moe) * pc.layer
            + n_moe * (pc.moe_layer + pc.experts) + pc.final_norm + pc.output_layer)


@lru_cache(maxsize=4096)
def fsdp_parameters(arch: Arch, tensor: int) -> int:
    """Parameters on one GPU under FSDP x TP before FSDP shards them: every block split by TP (``pieces``), the
    embeddings, final norm and output layer whole (the tensor-parallel plan splits the blocks only)."""
    whole = pieces(arch, 1)
    return (arch.layers * pieces(arch, tensor).layer + whole.word_embedding + whole.position_embedding
            + whole.final_norm + (0 if arch.tied else whole.output_layer))


def stage_split(arch: Arch, tensor: int, pipeline: int, stage: int, expert_shards: int = 1,
                virtual: int = 1, first: int | None = None, last: int | None = None) -> tuple[int, int]:
    """(dense, expert) parameters on one GPU of pipeline stage ``stage``. Dense: its dense layers and the non-expert
    part of its MoE layers (attention, norms, router, shared expert: TP-split); the embeddings on the first stage;
    the final norm and output layer on the last (with tied embeddings and p > 1 the last stage holds its own copy of
    the word embedding, whose gradient is all-reduced with the first stage's). Expert: the routed experts of its MoE
    layers split over ``expert_shards`` = EP x ETP GPUs."""
    pc = pieces(arch, tensor)
    n_dense, n_moe = stage_layer_counts(arch, pipeline, stage, virtual, first, last)
    n = n_dense * pc.layer + n_moe * pc.moe_layer
    if stage == 0:
        n += pc.word_embedding + pc.position_embedding
    if stage == pipeline - 1:
        n += pc.final_norm + (pc.output_layer if not arch.tied else (pc.word_embedding if pipeline > 1 else 0))
    return n, n_moe * pc.experts // expert_shards


def stage_parameters(arch: Arch, tensor: int, pipeline: int, stage: int, expert_shards: int = 1,
                     virtual: int = 1, first: int | None = None, last: int | None = None) -> int:
    """Parameters on one GPU of pipeline stage ``stage`` (``stage_split``: dense + expert)."""
    return sum(stage_split(arch, tensor, pipeline, stage, expert_shards, virtual, first, last))
