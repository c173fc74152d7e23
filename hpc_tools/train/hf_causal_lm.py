"""What every backend that trains a Hugging Face causal LM shares (DeepSpeed, FSDP): the loss, the seeded initial
value of each parameter, and loading a state dict into the model.

One definition each, so that a recipe starts from the same weights and reports the same loss under either backend
(and under a backend to come): ``initial_value`` is a pure function of (seed, parameter name), whatever ZeRO stage,
sharding or layout builds the model; ``causal_lm_loss`` is the mean next-token cross entropy in fp32. The backends'
own modules (``deepspeed/model.py``, ``fsdp/model.py``) build the model their way. Torch is imported only when called.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from hpc_tools.errors import UserError

if TYPE_CHECKING:
    import torch

    from hpc_tools.recipe.schema import Recipe


def causal_lm_loss(logits: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
    """Mean next-token cross entropy (labels are already shifted by the data pipeline), computed in fp32."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


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
