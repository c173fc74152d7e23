"""The Hugging Face causal LM of a recipe, built from ``model:`` (the one recipe -> config, ``hpc_tools.hf.config``).

Built without memory: ``build_empty`` makes the modules with their parameters on the meta device (their buffers, the
RoPE frequencies, real); a backend then spreads them its way (FSDP shards them first) and ``values.materialize``
allocates each rank's part on its device and fills it from ``values.full_values`` (one full parameter at a time), so
no rank need ever hold more than its share. ``blocks`` are the transformer blocks (FSDP's units, the compiled and
tensor-parallel pieces); ``param_groups`` AdamW's groups as Megatron-core makes them.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hpc_tools.errors import UserError
from hpc_tools.hf.config import ATTENTION, hf_config

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "n_embd", "n_layer", "n_head", "n_inner", "tie_word_embeddings")
"""The config keys an ``init_from_hf`` folder must share with the recipe's model section (those either family has)."""


def build_empty(recipe: "Recipe"):
    """The causal LM with its parameters on the meta device (no storage, no initialisation) and its buffers real on
    the host (accelerate's ``init_empty_weights(include_buffers=False)``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from hpc_tools.train.imports import import_transformers

    import_transformers()  # without what no rank uses (torchao, scipy: ~600 modules)
    import transformers
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    cfg = hf_config(recipe)
    if recipe.checkpoint.init_from_hf:
        check_hf_folder(recipe.checkpoint.init_from_hf, cfg)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTENTION, dtype=torch.float32)
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()  # built this way, transformers leaves the output layer a parameter of its own
    model.config.use_cache = False
    return model


def check_hf_folder(folder: str, cfg) -> None:
    """The folder's config.json describes the recipe's model (UserError naming checkpoint.init_from_hf and the first
    key that differs)."""
    from transformers import AutoConfig

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


def blocks(model) -> list:
    """The transformer blocks of a LlamaForCausalLM (``model.layers``) or GPT2LMHeadModel (``transformer.h``): each
    becomes its own FSDP unit."""
    body = getattr(model, "model", None) or getattr(model, "transformer")
    return list(getattr(body, "layers", None) or getattr(body, "h"))


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's groups as Megatron-core makes them: no weight decay on biases and 1-D parameters (norm weights), so a
    recipe trains alike under every backend."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        (plain if p.ndim == 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def adamw(model, training):
    """torch's AdamW over ``param_groups`` with the recipe's ``training`` settings (the learning rate is set each
    step from the schedule)."""
    import torch

    return torch.optim.AdamW(param_groups(model, training.weight_decay), lr=training.lr,
                             betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_eps)
