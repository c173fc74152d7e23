"""The full value of every parameter of a Hugging Face causal LM, the same under every backend that builds one.

``initial_value`` is a pure function of (seed, parameter name), whatever ZeRO stage, sharding, rank count or layout
builds the model, so a recipe starts from the same weights under DeepSpeed, FSDP or Horovod; ``full_values`` gives
those, or the tensors of ``checkpoint.init_from_hf``; ``materialize`` allocates a model built on the meta device and
fills it (each rank only its own shard of a sharded parameter); ``load_into`` loads a state dict (export). Torch is
imported only when called.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from hpc_tools.errors import UserError

if TYPE_CHECKING:
    import torch

    from hpc_tools.recipe.schema import Recipe


def initial_value(name: str, shape, std: float, kind: str, seed: int, num_layers: int) -> "torch.Tensor":
    """The initial value of one parameter, a pure function of (seed, name): the same for every ZeRO stage and layout.

    The rules are Hugging Face's own ``_init_weights`` for GPT-2 and LLaMA: norms 1, biases 0, other weights
    N(0, std), GPT-2's residual projections (``c_proj``) N(0, std / sqrt(2 L)).
    """
    import zlib

    import torch

    if kind == "norm" and name.endswith("weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if name.endswith("c_proj.weight"):
        std = std / math.sqrt(2 * num_layers)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(shape, generator=gen) * std


def initial_values(model, recipe: "Recipe") -> Callable[[str, tuple], "torch.Tensor"]:
    """``(name, shape) -> initial_value`` of each parameter of ``model`` (its norm weights found by module type)."""
    norms = {f"{mod_name}.{p}" if mod_name else p for mod_name, mod in model.named_modules()
             if "Norm" in type(mod).__name__ for p, _ in mod.named_parameters(recurse=False)}
    m, seed = recipe.model, recipe.training.seed
    return lambda name, shape: initial_value(name, shape, m.init_method_std, "norm" if name in norms else "weight",
                                             seed, m.num_layers)


def load_into(model, state: dict, ckpt: Path) -> None:
    """Load weights; only a tied output projection may be absent from the checkpoint."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise UserError(f"checkpoint {ckpt} does not match the run's model (missing {missing[:4]}, unexpected "
                        f"{unexpected[:4]}); was the recipe's model section changed after training?")
    if tied:
        model.tie_weights()


def full_values(recipe: "Recipe", model) -> Callable[[str, tuple], "torch.Tensor"]:
    """``(name, shape) -> the full fp32 value`` of each parameter of ``model``: the init_from_hf folder's tensor, else
    ``initial_value`` (norm weights 1, biases 0, the rest seeded by name)."""
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


def materialize(model, device, fill: Callable[[str, tuple], Any]) -> None:
    """Allocate the (meta) parameters on ``device`` and set each to ``fill(name, full shape)``: a sharded parameter
    (DTensor) takes its own shard of the full value (no communication); buffers keep their values."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not any(p.is_meta for p in model.parameters()):
        return  # already materialized (tied embeddings: on the host, before sharding)
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    model.to_empty(device=device)
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        model.tie_weights()  # from meta, to_empty gives each module a Parameter of its own: tie them again
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = fill(name, tuple(param.shape)).to(device)
            if isinstance(param, DTensor):
                mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(mine.to_local())
            else:
                param.copy_(full)
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
