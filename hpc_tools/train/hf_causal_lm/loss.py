"""The loss of a Hugging Face causal LM, and Liger Kernel's fused layers.

One definition, so that a recipe reports the same loss under every backend that trains such a model:
``causal_lm_loss`` is the mean next-token cross entropy in fp32. ``backend.<kind>.liger`` (``apply_liger``) swaps in
Liger Kernel's Triton kernels on CUDA: RMSNorm, SwiGLU, RoPE and the fused linear cross entropy (the logits are never
materialised; ``forward_loss`` then takes the loss from the model). Torch is imported only when called.
"""

from __future__ import annotations

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
