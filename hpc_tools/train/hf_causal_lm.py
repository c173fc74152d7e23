"""What every backend that trains a Hugging Face causal LM shares (DeepSpeed, FSDP, Horovod): the loss, the seeded
initial value of each parameter, loading a state dict into the model, and Liger Kernel's fused layers.

One definition each, so that a recipe starts from the same weights and reports the same loss under either backend
(and under a backend to come): ``initial_value`` is a pure function of (seed, parameter name), whatever ZeRO stage,
sharding or layout builds the model; ``causal_lm_loss`` is the mean next-token cross entropy in fp32.
``backend.<kind>.liger`` (``apply_liger``) swaps in Liger Kernel's Triton kernels on CUDA: RMSNorm, SwiGLU, RoPE and
the fused linear cross entropy (the logits are never materialised; ``forward_loss`` then takes the loss from the
model). The backends' own modules (``deepspeed/model.py``, ``fsdp/model.py``) build the model their way. Torch is
imported only when called.
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


def forward_loss(model, tokens: "torch.Tensor", labels: "torch.Tensor", fused: bool) -> "torch.Tensor":
    """The mean next-token loss of one microbatch. ``fused`` (Liger applied): the model's own forward computes it from
    the last hidden states and the output weight in chunks (``shift_labels``: our labels are shifted already), in
    training mode without the (tokens x vocabulary) logits; otherwise ``causal_lm_loss`` of the logits."""
    if fused:
        return model(input_ids=tokens, shift_labels=labels).loss
    return causal_lm_loss(model(input_ids=tokens).logits, labels)


LIGER_FAMILIES = ("llama",)
"""The model families whose Hugging Face class Liger Kernel patches here (``apply_liger_kernel_to_llama``)."""


def liger_requested(recipe: "Recipe") -> bool:
    """``backend.<kind>.liger`` of the recipe's backend (False for a backend without the switch)."""
    return bool(getattr(getattr(recipe.backend, recipe.backend.kind, None), "liger", False))


def apply_liger(model, recipe: "Recipe", device, info: Callable[..., None], fused_loss: bool = True) -> bool:
    """Liger Kernel's RMSNorm, SwiGLU, RoPE and fused linear cross entropy on ``model`` (in place, before it is
    compiled or sharded) when the recipe asks for them; whether the loss is fused (then ``forward_loss(...,
    fused=True)``). ``fused_loss=False`` keeps the plain loss (ZeRO-3: the output weight is partitioned outside its
    own forward).

    Its kernels are Triton, which runs on CUDA only: on a CPU device the switch is a note in the rank log (``info``)
    and the run keeps the plain layers, so one recipe serves its CPU ``local`` profile and the GPU cluster. On GPU a
    missing package or a family Liger does not patch here is one line naming the field."""
    if not liger_requested(recipe):
        return False
    field = f"backend.{recipe.backend.kind}.liger"
    if device.type != "cuda":
        info("%s=true: Liger Kernel's Triton kernels run on CUDA only; this %s run keeps the plain PyTorch layers "
             "and loss", field, device.type)
        return False
    if recipe.model.family not in LIGER_FAMILIES:
        raise UserError(f"{field}=true with model.family={recipe.model.family}: Liger Kernel patches "
                        f"{', '.join(LIGER_FAMILIES)} models here (set {field}=false)")
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as exc:
        raise UserError(f"{field}=true but liger-kernel does not import here ({exc}): install it on the GPU nodes "
                        f"(environment/requirements-gpu.txt), or set {field}=false") from None
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=fused_loss, model=model)
    loss = " and fused linear cross entropy" if fused_loss else " (plain cross entropy: no fused loss on this engine)"
    info("%s: Liger Kernel's RMSNorm, SwiGLU, RoPE%s applied", field, loss)
    return fused_loss


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
