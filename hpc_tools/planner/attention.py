"""What the attention core keeps for backward, by attention path (``Knobs.attention``: ``te``, ``te-unfused``,
``sdpa``, ``unfused``; ``hpc_tools/backends.py`` ``attention_path``): which of torch's scaled_dot_product_attention
kernels Megatron's ``sdpa`` path runs, and the words the activation note uses. The terms themselves are
``memory.megatron_layer_terms``'."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tools.planner.arch import Arch
    from hpc_tools.planner.knobs import Knobs


def sdpa_kernel(arch: "Arch", k: "Knobs") -> str | None:
    """Which of torch's scaled_dot_product_attention kernels the Megatron ``sdpa`` path runs, for its activation
    terms: ``flash`` on a GPU in 16-bit (flash, cuDNN or memory-efficient: no s^2 tensor; in fp32 the path is planned
    with Megatron's explicit terms, an upper bound, as ``layer_plan``'s ``flash_style`` is) and on CPU without
    attention dropout (torch's flash kernel for CPU); ``math`` on CPU with attention dropout (the CPU flash kernel
    has no dropout); None off the ``sdpa`` path, and on a GPU in fp32."""
    if k.attention != "sdpa":
        return None
    if k.on_gpu:
        return "flash" if k.precision != "fp32" else None
    return "math" if arch.attention_dropout else "flash"


def attention_note(arch: "Arch", k: "Knobs", code) -> str:
    """What the attention core keeps, named by its path (``Knobs.attention``) and, for SDPA, torch's kernel;
    ``code``: the layer code (``memory.LayerCode``: its ``name`` and ``explicit_attention``)."""
    kernel = sdpa_kernel(arch, k) if code.name == "megatron" else None
    head = f"attention {k.attention}" + (f" ({kernel} kernel)" if kernel else "") + ": "
    if k.recompute == "selective" and not k.flash:
        return head + "selective recompute: s^2 terms recomputed"
    if kernel == "math":
        return head + "torch's math kernel (CPU, attention dropout): fp32 Q, K, V and three fp32 s^2 tensors stored"
    if k.flash or kernel == "flash":
        return head + "fused/flash attention: no s^2 terms" + (", fp32 log-sum-exp per head and token" if kernel
                                                              else "")
    return head + "explicit attention: softmax (and dropout) s^2 terms stored" + code.explicit_attention
