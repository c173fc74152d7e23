"""The Hugging Face causal LM as a DeepSpeed ``PipelineModule`` (``parallel.pipeline_size > 1``, ZeRO stage 0/1).

The full model is built once per rank with the job's seed (so every stage starts from exactly the weights the
non-pipelined job would) and cut into a flat list of layers that pass one tensor, the hidden states, between them::

    [token embedding (+ positions for gpt)] [block 0] ... [block L-1] [final norm] [output projection]

With tied embeddings the output projection is a ``TiedLayerSpec`` of the token embedding (DeepSpeed keeps the two
copies equal across the first and last stage). Every layer knows the Hugging Face parameter prefix it came from
(``hf_prefix``), which is how ``export`` turns pipeline checkpoints back into a plain model folder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hpc_tools.train.hf_causal_lm.loss import causal_lm_loss

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

TIED_KEY = "embed"


class TokenEmbedding(nn.Module):
    """Token ids -> hidden states; also the output projection when embeddings are tied (its ``weight``)."""

    def __init__(self, embedding: nn.Embedding, hf_prefix: str):
        super().__init__()
        self.weight = embedding.weight
        self.hf_prefix = hf_prefix

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


def tied_head(module: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The output projection of tied embeddings: logits = hidden @ embedding^T."""
    return F.linear(hidden, module.weight)


class GPTPositions(nn.Module):
    """GPT-2: add learned absolute position embeddings, then embedding dropout."""

    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.wpe = transformer.wpe
        self.drop = transformer.drop
        self.hf_prefix = "transformer."

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device)
        return self.drop(hidden + self.wpe(positions).unsqueeze(0))


class Block(nn.Module):
    """One decoder layer; llama layers compute their rotary embedding from the sequence length."""

    def __init__(self, layer: nn.Module, hf_prefix: str, rotary: nn.Module | None = None, recompute: bool = False):
        super().__init__()
        self.layer = layer
        self.hf_prefix = hf_prefix
        self.rotary = [rotary]  # a list: the rotary module has no weights and must not be registered per layer
        self.recompute = recompute

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, hidden, use_reentrant=False)
        return self._forward(hidden)

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rotary = self.rotary[0]
        if rotary is None:
            out = self.layer(hidden, attention_mask=None)
        else:
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            cos_sin = rotary(hidden, position_ids=positions)
            out = self.layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out


class Named(nn.Module):
    """A plain module (final norm, untied output projection) under its Hugging Face prefix."""

    def __init__(self, module: nn.Module, hf_prefix: str):
        super().__init__()
        self.module = module
        self.hf_prefix = hf_prefix

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module(hidden)


def pipeline_layers(hf_model: nn.Module, recompute: bool = False) -> list:
    """The flat layer list of a GPT2LMHeadModel or LlamaForCausalLM (tied embeddings become a TiedLayerSpec)."""
    from deepspeed.pipe import TiedLayerSpec

    tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
    if hasattr(hf_model, "transformer"):  # GPT-2
        body = hf_model.transformer
        embed, blocks, norm, rotary = body.wte, body.h, body.ln_f, None
        head_in = [GPTPositions(body)]
        block_prefix, norm_prefix = "transformer.h.", "transformer.ln_f."
        embed_prefix = "transformer.wte."
    else:  # llama
        body = hf_model.model
        embed, blocks, norm, rotary = body.embed_tokens, body.layers, body.norm, body.rotary_emb
        head_in = []
        block_prefix, norm_prefix, embed_prefix = "model.layers.", "model.norm.", "model.embed_tokens."
    first = (TiedLayerSpec(TIED_KEY, TokenEmbedding, embed, embed_prefix) if tied
             else TokenEmbedding(embed, embed_prefix))
    layers = [first, *head_in]
    layers += [Block(layer, f"{block_prefix}{i}.", rotary, recompute) for i, layer in enumerate(blocks)]
    layers.append(Named(norm, norm_prefix))
    if tied:
        layers.append(TiedLayerSpec(TIED_KEY, TokenEmbedding, embed, embed_prefix, forward_fn=tied_head))
    else:
        layers.append(Named(hf_model.lm_head, "lm_head."))
    return layers


def build_pipeline(recipe: "Recipe", hf_model: nn.Module, num_stages: int):
    """The PipelineModule: stages balanced by decoder blocks, loss on the last stage."""
    from deepspeed.pipe import PipelineModule

    # Recomputation happens inside each Block (non-reentrant checkpoint), not through DeepSpeed's interval, which
    # would also wrap the embedding layer whose input needs no gradient.
    layers = pipeline_layers(hf_model, recompute=recipe.training.recompute_granularity == "full")
    return PipelineModule(layers=layers, num_stages=num_stages, loss_fn=causal_lm_loss,
                          partition_method="type:Block", activation_checkpoint_interval=0)


def hf_state_dict(layer_index_to_prefix: dict[int, str], layer_states: dict[int, dict]) -> dict[str, torch.Tensor]:
    """Pipeline layer states (``layer_XX-model_states.pt`` contents) -> Hugging Face parameter names."""
    out: dict[str, torch.Tensor] = {}
    for idx, state in layer_states.items():
        prefix = layer_index_to_prefix[idx]
        for key, value in state.items():
            for inner in ("layer.", "module."):
                if key.startswith(inner):
                    key = key[len(inner):]
                    break
            out[prefix + key] = value
    return out


def layer_prefixes(hf_model: nn.Module) -> dict[int, str]:
    """Layer index -> Hugging Face prefix, for the layers that own parameters (the tied head is left out)."""
    out = {}
    for idx, layer in enumerate(pipeline_layers(hf_model)):
        if isinstance(layer, nn.Module):
            out[idx] = layer.hf_prefix
        elif idx == 0:  # the first TiedLayerSpec owns the embedding
            out[idx] = layer.module_args[1]
    return out
