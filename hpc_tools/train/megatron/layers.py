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
    """What a rank's layers run on: ``layers`` (``transformer_engine`` | ``local``), ``attention`` (mcore's
    ``AttnBackend`` name, which sets TE's ``NVTE_*_ATTN`` variables: ``auto`` = Transformer Engine chooses among its
    flash, cuDNN fused and unfused attention at the first forward, ``unfused`` inside TE, ``local`` = the local
    layers), ``path`` (the attention path the run gets, named on the start line and by ``doctor``: ``sdpa`` = the
    local layers' core attention on torch's ``scaled_dot_product_attention`` (``sdpa_attention.SDPAttention``),
    ``te-flash|te-fused`` = TE's flash or cuDNN fused attention, chosen by TE at the first forward (the trainer then
    names the one it chose), ``unfused`` = O(s^2) attention, TE's or Megatron's own ``DotProductAttention``),
    ``flash_style`` (the attention keeps no s^2 tensor: TE's ``auto`` and SDPA on a GPU, in 16-bit), plus a note when
    the plan is not what the recipe's words suggest."""

    layers: str
    attention: str
    note: str = ""
    flash_style: bool = False
    path: str = "unfused"

    @property
    def transformer_engine(self) -> bool:
        return self.layers == "transformer_engine"

    @property
    def sdpa(self) -> bool:
        """The local layers' core attention is ``SDPAttention`` (torch's scaled_dot_product_attention)."""
        return self.path == SDPA

    def describe(self) -> str:
        return f"layers={self.layers}, attention={self.path}" + (f" ({self.note})" if self.note else "")


SDPA, TE_AUTO, UNFUSED = "sdpa", "te-flash|te-fused", "unfused"
"""The attention paths of ``LayerPlan.path`` (the planner's names: ``hpc_tools/backends.py`` ``attention_path``)."""


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported here (found on the path; not imported)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def te_version() -> str | None:
    """The installed Transformer Engine's version (its package metadata; TE is not imported), None where it has
    none."""
    from importlib import metadata

    for dist in ("transformer_engine", "transformer_engine_torch"):  # (names are matched normalised: - or _)
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_at_least(version: str | None, least: tuple[int, ...]) -> bool:
    """Whether ``version`` (``2.11.0``, ``2.7.0.dev0+abc``, ``2.9.0a0``) is at least ``least``, by its release
    numbers (a pre-release of 2.7 counts as 2.7, as the kernels are there); False for None or an unreadable version."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release if version is not None else ()
    except InvalidVersion:
        return False
    return len(release) >= len(least) and release[:len(least)] >= least


FP32_NOTE = "fp32: Transformer Engine's flash and fused attention take bf16/fp16 only, TE runs its unfused O(s^2) one"
CPU_NOTE = "CPU: Transformer Engine is CUDA-only"
NO_TE_NOTE = "transformer_impl=auto: transformer_engine not importable, local layers"


def layer_plan(recipe: "Recipe", device_type: str, *, te_available: bool | None = None) -> LayerPlan:
    """The layer implementation and attention path for this recipe on this device.

    ``use_flash_attention: true`` (the default) on the local layers -- ``transformer_impl: local``, ``auto`` on a
    node without TE, and every CPU rank -- runs their core attention on torch's ``scaled_dot_product_attention``
    (path ``sdpa``: flash, cuDNN or memory-efficient kernels on a GPU; on CPU torch's flash kernel for CPU, or its
    math kernel with attention dropout), so the CPU tests run the GPU's code; ``false`` keeps Megatron's unfused
    ``DotProductAttention``. On a GPU, ``transformer_impl: transformer_engine`` without TE fails with one line
    instead of running slowly. ``te_available`` overrides the probe (tests).

    With TE and ``use_flash_attention: true`` the attention backend is ``auto``, TE's own choice, never a pinned
    ``flash``/``fused``: megatron-core turns the other TE backends off for a pinned one (``NVTE_*_ATTN=0``,
    ``language_module.py``), and TE disables flash and fused attention for fp32 inputs and flash attention outside
    its supported flash-attn versions (``dot_product_attention/utils.py``), so a pinned backend can leave none
    ("No dot product attention backend is available"). ``auto`` also lets TE prefer cuDNN's fused attention where it
    is faster (H100). The engine logs what TE chose (``te_attention_choice``).
    """
    from hpc_tools.errors import UserError

    mg = recipe.backend.megatron
    sixteen = recipe.training.precision != "fp32"
    if device_type != "cuda":
        note = "" if mg.transformer_impl == "local" else CPU_NOTE
        return LayerPlan("local", "local", note, path=SDPA if mg.use_flash_attention else UNFUSED)
    te = module_available("transformer_engine") if te_available is None else te_available
    if mg.transformer_impl == "local" or not te:
        if mg.transformer_impl == "transformer_engine":
            raise UserError("backend.megatron.transformer_impl=transformer_engine but transformer_engine is not "
                            "importable on this node (install it, or use transformer_impl: auto or local)")
        note = "" if mg.transformer_impl == "local" else NO_TE_NOTE
        if mg.use_flash_attention:  # SDPA keeps no s^2 tensor where torch runs a flash-style kernel (16-bit)
            return LayerPlan("local", "local", note, flash_style=sixteen, path=SDPA)
        return LayerPlan("local", "local", note, path=UNFUSED)
    if not mg.use_flash_attention:
        return LayerPlan("transformer_engine", "unfused", path=UNFUSED)
    if not sixteen:
        return LayerPlan("transformer_engine", "auto", FP32_NOTE, path=UNFUSED)
    return LayerPlan("transformer_engine", "auto", flash_style=True, path=TE_AUTO)


def te_attention_choice() -> str | None:
    """The attention backend Transformer Engine chose at its latest forward (under ``attention: auto``), or None
    (no TE here, or no forward yet). Read from TE's module state ``_attention_backends`` in
    ``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py`` (v2.11 and main), the
    record TE itself keeps of its last choice."""
    try:
        from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa
    except Exception:  # noqa: BLE001 - TE missing, or present without a usable CUDA build: nothing to report
        return None
    return describe_te_choice(getattr(dpa, "_attention_backends", None))


FUSED_SUB_BACKENDS = {0: "max-512 sequence", 1: "arbitrary sequence", 2: "FP8"}
"""TE's ``NVTE_Fused_Attn_Backend`` values (``transformer_engine/common/include/transformer_engine/fused_attn.h``)."""


def describe_te_choice(backends: dict | None) -> str | None:
    """``te-flash (flash-attn 2.8.3)``, ``te-fused (cuDNN, arbitrary sequence)``, ``unfused`` (the attention path
    names) from TE's ``_attention_backends`` record; None when it holds no choice yet."""
    if not backends or backends.get("attention_params") is None:
        return None
    if backends.get("use_flash_attention"):
        return f"te-flash (flash-attn {backends.get('flash_attention_backend')})"
    if backends.get("use_fused_attention"):
        sub = backends.get("fused_attention_backend")
        sub = None if sub is None else int(sub)
        return f"te-fused (cuDNN, {FUSED_SUB_BACKENDS.get(sub, f'sub-backend {sub}')})"
    if backends.get("use_unfused_attention"):
        return "unfused"
    return None


def attention_environment_check(plan: LayerPlan, env) -> None:
    """Refuse, in one line at rank start, an ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` / ``NVTE_UNFUSED_ATTN`` in the
    rank's environment (a site's module, ``cluster.setup.env`` or the site file) other than what megatron-core sets
    for this plan's attention: it asserts on it at model build (``hpc_tools/recipe/te_support.py``). ``env``:
    ``os.environ`` at the rank, a mapping in tests."""
    from hpc_tools.recipe.te_support import nvte_conflict

    clash = nvte_conflict({plan.attention}, env)
    if clash:
        from hpc_tools.errors import UserError

        name, value, expected = clash
        raise UserError(f"{name}={value} is set in this rank's environment, but megatron-core sets {name}={expected} "
                        f"for this rank's attention ({plan.describe()}) and asserts at model build (unset {name} in "
                        "cluster.setup.env, the site file or the modules the job loads; "
                        "backend.megatron.use_flash_attention: false chooses Transformer Engine's unfused attention)")
