"""The Hugging Face causal LM of an FSDP job, built from ``model:`` (the one recipe -> config, ``hpc_tools.hf.config``)
with the deterministic initial values every HF-class backend uses, or read from ``checkpoint.init_from_hf``.

Built without memory: ``build_empty`` makes the modules with their parameters on the meta device (their buffers, the
RoPE frequencies, real); ``parallel.parallelize`` shards them, allocates each rank's shard on its device and fills it
from ``full_values`` (one full parameter at a time), so no rank ever holds the whole model.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

from hpc_tools.errors import UserError
from hpc_tools.hf.config import ATTENTION, hf_config
from hpc_tools.train.hf_causal_lm import initial_values

if TYPE_CHECKING:
    import torch

    from hpc_tools.recipe.schema import Recipe

SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "n_embd", "n_layer", "n_head", "n_inner", "tie_word_embeddings")
"""The config keys an ``init_from_hf`` folder must share with the recipe's model section (those either family has)."""


def build_empty(recipe: "Recipe"):
    """The causal LM with its parameters on the meta device (no storage, no initialisation) and its buffers real on
    the host (accelerate's ``init_empty_weights(include_buffers=False)``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
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


def full_values(recipe: "Recipe", model) -> Callable[[str, tuple], "torch.Tensor"]:
    """``(name, shape) -> the full fp32 value`` of each parameter of ``model``: the init_from_hf folder's tensor, else
    ``hf_causal_lm.initial_value`` (norm weights 1, biases 0, the rest seeded by name: the DeepSpeed backend's
    weights)."""
    folder = recipe.checkpoint.init_from_hf
    if folder:
        return _folder_tensors(folder)
    return initial_values(model, recipe)


def _folder_tensors(folder: str) -> Callable[[str, tuple], "torch.Tensor"]:
    """Tensors by name from a Hugging Face folder's safetensors files (one file or an index of shards)."""
    import json

    from safetensors import safe_open

    root = os.path.abspath(folder)
    index = os.path.join(root, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            where = {k: os.path.join(root, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        single = os.path.join(root, "model.safetensors")
        if not os.path.isfile(single):
            raise UserError(f"checkpoint.init_from_hf={folder} has no model.safetensors (save the folder with "
                            "save_pretrained's safetensors, or `export` it)")
        with safe_open(single, "pt") as f:
            where = {k: single for k in f.keys()}

    def value(name: str, shape: tuple):
        if name not in where:
            raise UserError(f"checkpoint.init_from_hf={folder} lacks {name} (is it a folder of this model?)")
        with safe_open(where[name], "pt") as f:
            tensor = f.get_tensor(name).float()
        if tuple(tensor.shape) != tuple(shape):
            raise UserError(f"checkpoint.init_from_hf={folder}: {name} has shape {tuple(tensor.shape)}, the "
                            f"recipe's model needs {tuple(shape)}")
        return tensor

    return value


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
