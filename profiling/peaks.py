"""Dense peak TFLOP/s per GPU model and data type, detection from device names, and MFU/HFU.

Figures are vendor datasheet numbers WITHOUT structured sparsity (the "with sparsity" column is twice these and must
never be used for MFU). Unknown GPUs or a data type the GPU lacks give ``None`` and one warning: a wrong peak is worse
than none (torchtitan once fell back to the A100 figure on other GPUs and reported ~152 % MFU).
``cluster.gpu_peak_tflops`` in the recipe overrides the table.
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe

DTYPES = ("bf16", "fp16", "fp8", "tf32", "fp32")

# Dense TFLOP/s per GPU. Sources: NVIDIA A100/H100/H200/B200/L40S/L4/A10/A40/V100 datasheets, AMD MI300X/MI325X
# datasheets (matrix cores). A missing dtype means the GPU has no tensor-core path for it (e.g. no fp8 on A100).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "A100-40GB": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A100-80GB": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "H100-SXM": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
    "H100-PCIe": {"bf16": 756.0, "fp16": 756.0, "fp8": 1513.0, "tf32": 378.0, "fp32": 51.2},
    "H100-NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
    "H200-NVL": {"bf16": 835.5, "fp16": 835.5, "fp8": 1670.5, "tf32": 417.5, "fp32": 60.0},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "tf32": 1100.0},
    # GB200 NVL72 datasheet: 180 PF dense FP16/BF16 for 72 GPUs; the B200 of an HGX board is clocked lower.
    "GB200": {"bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0, "tf32": 1250.0},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4},
    "MI325X": {"bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9, "tf32": 653.7, "fp32": 163.4},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "tf32": 60.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "A40": {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4},
    "V100-SXM": {"fp16": 125.0, "fp32": 15.7},
    "V100-PCIe": {"fp16": 112.0, "fp32": 14.0},
}

# Device-name patterns (torch.cuda.get_device_name / nvidia-smi / rocm) -> table key; first match wins, so the
# more specific patterns come first. Matched case-insensitively against the name with spaces and '_' as '-'.
_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"gh200", "GH200"),
    (r"h200.*nvl", "H200-NVL"),
    (r"h200", "H200"),
    (r"h100.*nvl", "H100-NVL"),
    (r"h100.*pcie", "H100-PCIe"),
    (r"h100", "H100-SXM"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"a100.*40", "A100-40GB"),
    (r"a100", "A100-80GB"),
    (r"gb200", "GB200"),  # before b200, which it contains
    (r"b200", "B200"),
    (r"mi300x", "MI300X"),
    (r"mi325x", "MI325X"),
    (r"l40s", "L40S"),
    (r"(^|[^a-z0-9])l4($|[^0-9a-z])", "L4"),
    (r"(^|[^a-z0-9])a10($|[^0-9a-z])", "A10"),
    (r"(^|[^a-z0-9])a40($|[^0-9a-z])", "A40"),
    (r"v100.*pcie", "V100-PCIe"),
    (r"v100", "V100-SXM"),
)
PRECISION_DTYPE = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
_warned: set[tuple[str, str]] = set()


# A MIG slice ("NVIDIA A100-SXM4-40GB MIG 3g.20gb") has a fraction of the parent's SMs: its peak is not in the table.
_MIG = re.compile(r"(^|[^a-z0-9])mig([^a-z0-9]|$)")


def canonical_gpu(name: str) -> str | None:
    """Table key for a recipe ``gpu_type`` or a device name (``NVIDIA H100 80GB HBM3`` -> ``H100-SXM``);
    None if unknown.

    A MIG slice is unknown (None): the full GPU's peak would overstate its MFU by up to 7x.
    """
    if name in PEAK_TFLOPS:
        return name
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    if _MIG.search(key):
        return None
    for known in PEAK_TFLOPS:
        if key == known.lower():
            return known
    for pattern, known in _NAME_PATTERNS:
        if re.search(pattern, key):
            return known
    return None


def peak_tflops(gpu_type: str, dtype: str) -> float | None:
    """Dense peak TFLOP/s of one GPU at ``dtype``; None (with one warning) for an unknown GPU or unsupported dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    if gpu_type.strip().lower() == "cpu":
        return None  # CPU ranks: no meaningful peak, and nothing to warn about
    key = canonical_gpu(gpu_type)
    value = PEAK_TFLOPS.get(key, {}).get(dtype) if key else None
    if value is None and (gpu_type, dtype) not in _warned:
        _warned.add((gpu_type, dtype))
        if key:
            why = f"{key} has no dense {dtype} figure"
        elif _MIG.search(gpu_type.lower()):
            why = f"{gpu_type!r} is a MIG slice, whose peak is a fraction of the full GPU's"
        else:
            why = f"GPU {gpu_type!r} is not in profiling.peaks.PEAK_TFLOPS"
        warnings.warn(f"{why}: MFU/HFU left empty; set cluster.gpu_peak_tflops in the recipe to the dense "
                      f"{dtype} TFLOP/s of this GPU", stacklevel=2)
    return value


def detect_device_name() -> str | None:
    """Name of the current CUDA/ROCm device, or None without one (imports torch only when it is loaded already)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def peak_for_recipe(recipe: "Recipe", device_name: str | None = None, dtype: str | None = None) -> float | None:
    """Peak TFLOP/s for a run: ``cluster.gpu_peak_tflops`` if set, else the detected device, else ``cluster.gpu_type``.

    The detected device wins over the recipe's gpu_type because the job may have landed on other hardware.
    """
    if recipe.cluster.gpu_peak_tflops is not None:
        return float(recipe.cluster.gpu_peak_tflops)
    dtype = dtype or PRECISION_DTYPE[recipe.training.precision]
    name = device_name or recipe.cluster.gpu_type
    return peak_tflops(name, dtype)


def mfu(model_flops: float, step_time_s: float, num_gpus: int, peak_tflops_per_gpu: float | None) -> float | None:
    """Model FLOPs utilisation (0-1) of one step; None when the peak is unknown (never a guess)."""
    if peak_tflops_per_gpu is None or peak_tflops_per_gpu <= 0 or step_time_s <= 0 or num_gpus <= 0:
        return None
    return model_flops / step_time_s / num_gpus / (peak_tflops_per_gpu * 1e12)


def hfu(hardware_flops: float, step_time_s: float, num_gpus: int, peak_tflops_per_gpu: float | None) -> float | None:
    """Hardware FLOPs utilisation (0-1): like ``mfu`` but with the FLOPs that recomputation adds."""
    return mfu(hardware_flops, step_time_s, num_gpus, peak_tflops_per_gpu)
