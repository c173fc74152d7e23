"""What a rank's layers run on: the layer implementation (Transformer Engine or Megatron's local layers) and the
attention backend, decided from the recipe, the device and the libraries this node has (``layer_plan``).

Imported by ``config`` (fusions, the TransformerConfig) and ``model`` (the layer spec); it imports neither, and
nothing from megatron-core or torch, so the decision is checked without building a model (docs/gpu-path.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """What a rank's layers run on: ``layers`` (``transformer_engine`` | ``local``) and ``attention`` (mcore's
    ``AttnBackend`` name: ``flash``/``fused``/``unfused`` inside TE, ``local`` = Megatron's unfused
    DotProductAttention, O(s^2) memory), plus a note when ``auto`` fell back. Named on the start line."""

    layers: str
    attention: str
    note: str = ""

    @property
    def transformer_engine(self) -> bool:
        return self.layers == "transformer_engine"

    def describe(self) -> str:
        return f"layers={self.layers}, attention={self.attention}" + (f" ({self.note})" if self.note else "")


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported here (found on the path; not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def layer_plan(recipe: "Recipe", device_type: str, *, te_available: bool | None = None,
               flash_available: bool | None = None) -> LayerPlan:
    """The layer implementation and attention backend for this recipe on this device.

    On a GPU, a recipe that asks for what this node cannot give fails with one line instead of running slowly:
    ``transformer_impl: transformer_engine`` without TE, or ``use_flash_attention: true`` without TE (the local
    layers only have unfused attention). ``auto`` without TE and without flash falls back to the local layers and
    says so. On CPU the local layers with unfused attention always run (TE and flash attention are CUDA-only):
    allowed, documented in docs/gpu-path.md. ``te_available``/``flash_available`` override the probes (tests).
    """
    from hpc_tools.errors import UserError

    mg = recipe.backend.megatron
    if device_type != "cuda":
        note = "" if mg.transformer_impl == "local" else "CPU: Transformer Engine and flash attention are CUDA-only"
        return LayerPlan("local", "local", note)
    te = module_available("transformer_engine") if te_available is None else te_available
    if mg.transformer_impl == "local":
        if mg.use_flash_attention:
            raise UserError("backend.megatron.use_flash_attention=true needs Transformer Engine layers but "
                            "transformer_impl=local (set transformer_impl: auto or use_flash_attention: false)")
        return LayerPlan("local", "local")
    if not te:
        if mg.transformer_impl == "transformer_engine":
            raise UserError("backend.megatron.transformer_impl=transformer_engine but transformer_engine is not "
                            "importable on this node (install it, or use transformer_impl: auto or local)")
        if mg.use_flash_attention:
            raise UserError("backend.megatron.use_flash_attention=true but transformer_engine is not importable on "
                            "this GPU node, and Megatron's local layers have only unfused O(s^2) attention "
                            "(install transformer_engine, or set use_flash_attention: false to run slowly)")
        return LayerPlan("local", "local", "transformer_impl=auto: transformer_engine not importable, local layers")
    if not mg.use_flash_attention:
        return LayerPlan("transformer_engine", "unfused")
    flash = module_available("flash_attn") if flash_available is None else flash_available
    # Without the flash-attn package TE's cuDNN fused attention is the flash-style kernel (no s^2 tensor either).
    return LayerPlan("transformer_engine", "flash" if flash else "fused")
