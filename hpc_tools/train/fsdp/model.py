"""The Hugging Face causal LM of an FSDP job, built from ``model:`` (the one recipe -> config, ``hpc_tools.hf.config``)
with the deterministic initial values every HF-class backend uses, or read from ``checkpoint.init_from_hf``.

The model is built whole in fp32 on the host, then sharded (``parallel.py``); FSDP2 keeps only each rank's shard.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hpc_tools.errors import UserError
from hpc_tools.hf.config import ATTENTION, hf_config

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "n_embd", "n_layer", "n_head", "n_inner", "tie_word_embeddings")
"""The config keys an ``init_from_hf`` folder must share with the recipe's model section (those either family has)."""


def build_model(recipe: "Recipe"):
    """The causal LM in fp32 on the host: from ``checkpoint.init_from_hf`` when set, else fresh with
    ``initial_value`` (a pure function of seed and parameter name: the same weights as the DeepSpeed backend)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from hpc_tools.train.deepspeed.model import initialize_weights

    transformers.logging.set_verbosity_error()
    cfg = hf_config(recipe)
    torch.manual_seed(recipe.training.seed)
    folder = recipe.checkpoint.init_from_hf
    if folder:
        model = from_hf_folder(folder, cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTENTION, dtype=torch.float32)
        initialize_weights(model, recipe)
    model.config.use_cache = False
    return model


def from_hf_folder(folder: str, cfg):
    """``AutoModelForCausalLM.from_pretrained(folder)`` after checking its shape is the recipe's (UserError naming
    checkpoint.init_from_hf and the first key that differs)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isdir(folder):
        raise UserError(f"checkpoint.init_from_hf={folder} is not a local folder (give a folder written by "
                        "save_pretrained or `export`; nothing is downloaded)")
    theirs = AutoConfig.from_pretrained(folder, local_files_only=True)
    if theirs.model_type != cfg.model_type:
        raise UserError(f"checkpoint.init_from_hf={folder} holds a {theirs.model_type} model, the recipe builds "
                        f"{cfg.model_type} (set model.family to match the folder)")
    for key in SHAPE_KEYS:
        if hasattr(cfg, key) and getattr(theirs, key, None) != getattr(cfg, key):
            raise UserError(f"checkpoint.init_from_hf={folder} has {key}={getattr(theirs, key, None)}, the recipe's "
                            f"model section gives {getattr(cfg, key)} (make model: match the folder's config.json)")
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation=ATTENTION,
                                                dtype=torch.float32)


def blocks(model) -> list:
    """The transformer blocks of a LlamaForCausalLM (``model.layers``) or GPT2LMHeadModel (``transformer.h``): each
    becomes its own FSDP unit."""
    body = getattr(model, "model", None) or getattr(model, "transformer")
    return list(getattr(body, "layers", None) or getattr(body, "h"))


def causal_lm_loss(logits, labels):
    """Mean next-token cross entropy in fp32 (labels are already shifted by the data pipeline); the same definition
    as the other backends."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
