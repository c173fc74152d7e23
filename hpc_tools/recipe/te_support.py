"""What Transformer Engine 2.11 (the version ``environment/requirements-gpu.txt`` installs) and megatron-core 0.16.1
accept on a GPU, as pure functions of the device, the CUDA version and the environment: the one owner of these facts
for the recipe's rules, the rank's start checks (``hpc_tools/train/megatron/config.py``) and ``doctor``.

Read from TE's sources at tag v2.11 (github.com/NVIDIA/TransformerEngine):

- block-scaled FP8 (``fp8_recipe: blockwise``, TE's ``Float8BlockScaling``): ``check_fp8_block_scaling_support`` in
  ``transformer_engine/pytorch/quantization.py`` needs compute capability >= 9.0 *and* ``torch.version.cuda`` >=
  12.9 ("FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9");
- flash-attn: ``FlashAttentionUtils`` in ``transformer_engine/pytorch/attention/dot_product_attention/utils.py`` uses
  versions 2.1.1 to 2.8.3 (2.7.3 to 2.8.3 on Blackwell, compute capability >= 10.0) and ignores any other
  (``backends.py``: ``is_installed`` only inside that range);
- the attention-backend variables: megatron-core's ``LanguageModule._set_attention_backend``
  (``megatron/core/models/common/language_module/language_module.py``) sets ``NVTE_FLASH_ATTN``,
  ``NVTE_FUSED_ATTN`` and ``NVTE_UNFUSED_ATTN`` from the config's ``attention_backend`` and asserts that any value
  already in the environment is the one it would set.

Imports nothing (no torch): the caller passes what it read.
"""

from __future__ import annotations

from typing import Mapping

TE_VERSION = "2.11"

BLOCKWISE_MIN_CAPABILITY = (9, 0)
BLOCKWISE_MIN_CUDA = (12, 9)


def cuda_version(text: str | None) -> tuple[int, int] | None:
    """``torch.version.cuda`` (``"12.8"``) as (major, minor); None for a CPU build or an unreadable value."""
    try:
        major, minor = (text or "").split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def blockwise_refusal(capability: tuple[int, int] | None, cuda: str | None) -> str | None:
    """Why Transformer Engine 2.11 refuses block-scaled FP8 (``training.fp8_recipe: blockwise``) on a GPU of compute
    ``capability`` (``torch.cuda.get_device_capability()``) with a torch built for CUDA ``cuda``
    (``torch.version.cuda``): the rule part of one line; None when it runs."""
    need = (f"compute capability >= {BLOCKWISE_MIN_CAPABILITY[0]}.{BLOCKWISE_MIN_CAPABILITY[1]} and a torch built "
            f"for CUDA >= {BLOCKWISE_MIN_CUDA[0]}.{BLOCKWISE_MIN_CUDA[1]} (Transformer Engine {TE_VERSION}'s "
            "block-scaled FP8 GEMM)")
    have_cuda = cuda_version(cuda)
    if capability is not None and tuple(capability) < BLOCKWISE_MIN_CAPABILITY:
        return f"needs {need}, but this GPU has compute capability {capability[0]}.{capability[1]}"
    if have_cuda is None or have_cuda < BLOCKWISE_MIN_CUDA:
        return f"needs {need}, but this torch is built for CUDA {cuda or 'none'}"
    return None


BLOCKWISE_FIX = ("use fp8_recipe: tensorwise or delayed, or a torch built for CUDA >= 12.9 (a CUDA 12.9+ wheel index, "
                 "or the NGC container of docs/gpu-path.md)")

FLASH_ATTN_MIN = "2.1.1"
FLASH_ATTN_MIN_BLACKWELL = "2.7.3"
FLASH_ATTN_MAX = "2.8.3"


def flash_attn_range(capability: tuple[int, int] | None = None) -> tuple[str, str]:
    """The flash-attn versions Transformer Engine 2.11 uses on a GPU of compute ``capability`` (None: not Blackwell)."""
    blackwell = capability is not None and tuple(capability) >= (10, 0)
    return (FLASH_ATTN_MIN_BLACKWELL if blackwell else FLASH_ATTN_MIN), FLASH_ATTN_MAX


def flash_attn_used(version: str, capability: tuple[int, int] | None = None) -> bool:
    """Whether Transformer Engine 2.11 uses flash-attn ``version`` (inside ``flash_attn_range``, compared as TE
    compares them: ``packaging`` versions, so ``2.8.3.post1`` is past 2.8.3)."""
    from packaging.version import InvalidVersion, Version

    low, high = flash_attn_range(capability)
    try:
        return Version(low) <= Version(version) <= Version(high)
    except InvalidVersion:
        return False


NVTE_ATTENTION_VARIABLES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
NVTE_BY_ATTENTION = {"auto": ("1", "1", "1"), "unfused": ("0", "0", "1"), "local": ("0", "0", "0"),
                     "flash": ("1", "0", "0"), "fused": ("0", "1", "0")}
"""What megatron-core 0.16.1 sets ``NVTE_FLASH_ATTN``, ``NVTE_FUSED_ATTN``, ``NVTE_UNFUSED_ATTN`` to for each
``AttnBackend`` (the attention of ``hpc_tools/train/megatron/layers.py``'s ``LayerPlan``)."""


def nvte_conflict(attentions: set[str] | frozenset[str], env: Mapping[str, str]) -> tuple[str, str, str] | None:
    """The first ``NVTE_*_ATTN`` variable in ``env`` that megatron-core's attention check asserts on for one of the
    attention backends ``attentions`` (those a rank of this recipe may build): (name, value, what megatron-core
    sets: one value, or ``"0 or 1"`` when the backends differ); None when every one it finds is what it would set."""
    for i, name in enumerate(NVTE_ATTENTION_VARIABLES):
        if name not in env:
            continue
        expected = sorted({NVTE_BY_ATTENTION[a][i] for a in attentions})
        if env[name] != expected[0] or len(expected) > 1:
            return name, env[name], " or ".join(expected)
    return None
