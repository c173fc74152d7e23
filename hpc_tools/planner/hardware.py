"""Hardware table: GPU memory and the bandwidths the planner's step-time model uses, per GPU type.

Keyed by the same ``gpu_type`` names as ``profiling/peaks.py`` (which owns the peak FLOP/s). Every figure can be
overridden by the recipe's ``cluster:`` section (gpu_mem_gb, gpu_peak_tflops, intra_node_bw_gbps, inter_node_bw_gbps).

Units: GB = 1e9 bytes everywhere in the planner (as in the ZeRO paper). Memory is the vendor's nominal capacity, which
NVIDIA quotes in GiB (an "80GB" card holds 80 GiB = 85.9 GB). Bandwidths are *bus* bandwidths per GPU in the
nccl-tests convention (busbw, GB/s): what a large all-reduce achieves, not the link's marketing figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_tools.errors import UserError

if TYPE_CHECKING:
    from hpc_tools.recipe.cluster import ClusterConfig

GIB = 2**30
GB = 1e9


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Defaults for one GPU type (a node of 8 of them with one NIC per GPU unless noted)."""

    mem_gib: float
    """Nominal memory in GiB."""
    intra_node_bw_gbps: float
    """Achievable all-reduce busbw inside a node (NVLink/NVSwitch, Infinity Fabric), GB/s."""
    inter_node_bw_gbps: float
    """Achievable busbw per GPU across nodes (one NIC per GPU), GB/s."""
    host_bw_gbps: float
    """Host <-> GPU copy bandwidth (PCIe), GB/s: ZeRO-Offload traffic."""
    note: str


# Bandwidths: NVLink 3 (A100) 300 GB/s per direction -> ~230 GB/s all-reduce busbw in nccl-tests on DGX A100; NVLink 4
# (H100/H200) 450 -> ~360; NVLink 5 (B200) 900 -> ~720. Inter-node: HDR 200 Gb/s per GPU (25 GB/s) -> ~22, NDR
# 400 Gb/s (50 GB/s) -> ~45. These are round planning figures: measure yours (recipes/comm_check.yaml) and override.
GPUS: dict[str, GpuSpec] = {
    "A100-40GB": GpuSpec(40, 230, 22, 25, "DGX A100: NVLink 3 + NVSwitch, 8x HDR 200 Gb/s"),
    "A100-80GB": GpuSpec(80, 230, 22, 25, "DGX A100: NVLink 3 + NVSwitch, 8x HDR 200 Gb/s"),
    "H100-SXM": GpuSpec(80, 360, 45, 50, "DGX H100: NVLink 4 + NVSwitch, 8x NDR 400 Gb/s"),
    "H100-PCIe": GpuSpec(80, 40, 22, 50, "PCIe Gen5 between GPUs (no NVSwitch), 200 Gb/s per GPU"),
    "H100-NVL": GpuSpec(94, 100, 22, 50, "NVLink bridges in pairs only, PCIe Gen5 otherwise, 200 Gb/s per GPU"),
    "H200": GpuSpec(141, 360, 45, 50, "HGX H200: NVLink 4 + NVSwitch, 8x NDR 400 Gb/s"),
    "H200-NVL": GpuSpec(141, 100, 22, 50, "NVLink bridges (2 or 4 GPUs), PCIe Gen5 otherwise, 200 Gb/s per GPU"),
    "GH200": GpuSpec(96, 360, 45, 50, "Grace Hopper superchip, NVLink 4 between GPUs, 400 Gb/s per GPU"),
    "B200": GpuSpec(180, 720, 45, 50, "HGX B200: NVLink 5 + NVSwitch, 8x 400 Gb/s"),
    "MI300X": GpuSpec(192, 300, 45, 50, "8x MI300X: Infinity Fabric mesh, 8x 400 Gb/s"),
    "MI325X": GpuSpec(256, 300, 45, 50, "8x MI325X: Infinity Fabric mesh, 8x 400 Gb/s"),
    "L40S": GpuSpec(48, 20, 12, 25, "PCIe Gen4 between GPUs, 100 Gb/s per GPU"),
    "L4": GpuSpec(24, 20, 6, 25, "PCIe Gen4 between GPUs, 50 Gb/s per GPU"),
    "A10": GpuSpec(24, 20, 6, 25, "PCIe Gen4 between GPUs, 50 Gb/s per GPU"),
    "A40": GpuSpec(48, 20, 12, 25, "PCIe Gen4 between GPUs, 100 Gb/s per GPU"),
    "V100-SXM": GpuSpec(32, 120, 10, 12, "DGX-1/2 V100: NVLink 2, 100 Gb/s per GPU"),
    "V100-PCIe": GpuSpec(32, 10, 10, 12, "PCIe Gen3 between GPUs, 100 Gb/s per GPU"),
}


def known_gpus() -> list[str]:
    return list(GPUS)


def lookup(gpu_type: str) -> GpuSpec | None:
    """The table entry for ``gpu_type``, resolved with profiling.peaks' name matching (``H100`` -> H100-SXM)."""
    from profiling.peaks import canonical_gpu

    return GPUS.get(canonical_gpu(gpu_type) or "")


@dataclass(frozen=True, slots=True)
class Hardware:
    """What one planned job runs on, after the recipe's overrides. ``None`` = unknown (no GPU or not in the table)."""

    gpu_type: str
    gpus_per_node: int
    mem_bytes: float | None
    peak_flops: float | None
    intra_node_bw: float  # bytes/s
    inter_node_bw: float  # bytes/s
    host_bw: float  # bytes/s
    sources: dict[str, str]  # field -> "table", "recipe" or "profiling.peaks"
    peak_flops_fp8: float | None = None  # FP8 dense peak (FP8 runs only; None: not asked for or no FP8)

    @property
    def is_gpu(self) -> bool:
        return self.gpu_type.lower() != "cpu"

    def link_bw(self, spans_nodes: bool) -> float:
        """busbw of a collective whose group stays inside a node (NVLink) or crosses nodes (network)."""
        return self.inter_node_bw if spans_nodes else self.intra_node_bw


def peak_flops_from_profiling(gpu_type: str, precision: str) -> float | None:
    """Dense peak FLOP/s from profiling.peaks (its owner), or None when unknown."""
    from profiling.peaks import PRECISION_DTYPE, peak_tflops

    value = peak_tflops(gpu_type, PRECISION_DTYPE.get(precision, precision))
    return None if value is None else value * 1e12


# CPU "hardware" for local runs: no GPU memory to check; shared-memory gloo bandwidth is a rough placeholder.
_CPU = GpuSpec(0, 5, 1, 5, "CPU ranks (gloo over shared memory / TCP)")


def hardware_for(cluster: "ClusterConfig", precision: str = "bf16", strict: bool = False,
                 need_peak: bool = True, fp8: bool = False) -> Hardware:
    """Resolve the table entry for ``cluster.gpu_type`` and apply the recipe's overrides.

    With ``strict`` an unknown GPU type without a ``gpu_mem_gb`` override is a UserError naming the known types.
    ``need_peak=False`` skips the peak FLOP/s lookup (the memory check needs none, and it warns for unknown GPUs).
    ``fp8``: also the FP8 peak (profiling.peaks; with ``cluster.gpu_peak_tflops`` set, twice it, as on every GPU
    in the table).
    """
    spec = _CPU if not cluster.uses_gpus else lookup(cluster.gpu_type)
    if spec is None and strict and cluster.gpu_mem_gb is None:
        raise UserError(f"cluster.gpu_type={cluster.gpu_type} is not in the planner's hardware table "
                        f"(use one of {', '.join(GPUS)}, or set cluster.gpu_mem_gb and the bandwidth fields)")
    base = spec or GpuSpec(0, 100, 12.5, 25, "unknown GPU: placeholder bandwidths")
    sources = {}

    def pick(name: str, override: float | None, default: float | None) -> float | None:
        sources[name] = "recipe" if override is not None else ("table" if spec is not None else "assumed")
        return override if override is not None else default

    mem_gb = pick("gpu_mem_gb", cluster.gpu_mem_gb, base.mem_gib * GIB / GB if spec and cluster.uses_gpus else None)
    peak = (cluster.gpu_peak_tflops * 1e12 if cluster.gpu_peak_tflops else
            peak_flops_from_profiling(cluster.gpu_type, precision) if need_peak else None)
    sources["gpu_peak_tflops"] = "recipe" if cluster.gpu_peak_tflops else ("profiling.peaks" if peak else "unknown")
    intra = pick("intra_node_bw_gbps", cluster.intra_node_bw_gbps, base.intra_node_bw_gbps)
    inter = pick("inter_node_bw_gbps", cluster.inter_node_bw_gbps, base.inter_node_bw_gbps)
    peak_fp8 = None
    if fp8 and need_peak and cluster.uses_gpus:
        peak_fp8 = 2 * peak if cluster.gpu_peak_tflops and peak else peak_flops_from_profiling(cluster.gpu_type, "fp8")
        sources["gpu_peak_tflops_fp8"] = ("2 x cluster.gpu_peak_tflops" if cluster.gpu_peak_tflops else
                                          "profiling.peaks" if peak_fp8 else "unknown")
    return Hardware(gpu_type=cluster.gpu_type, gpus_per_node=cluster.gpus_per_node,
                    mem_bytes=None if mem_gb is None else mem_gb * GB, peak_flops=peak,
                    intra_node_bw=intra * GB, inter_node_bw=inter * GB, host_bw=base.host_bw_gbps * GB,
                    sources=sources, peak_flops_fp8=peak_fp8)


# Default headroom: PyTorch's caching allocator typically leaves 5-10 % of reserved memory fragmented, and NCCL
# allocates buffers per communicator and channel beyond the 0.5 GB the plan counts (docs/formulas.md, "Headroom").
HEADROOM_FRACTION = 0.05


HEADROOM_FIXED_BYTES = 1.0 * GB


def headroom_bytes(cluster: "ClusterConfig", mem_bytes: float | None) -> float:
    """Bytes of GPU memory the fit check and the search keep free: ``cluster.memory_headroom_gb`` when set, else
    5 % of the GPU memory + 1 GB; 0 when there is no GPU memory to check."""
    if mem_bytes is None:
        return 0.0
    if cluster.memory_headroom_gb is not None:
        return cluster.memory_headroom_gb * GB
    return HEADROOM_FRACTION * mem_bytes + HEADROOM_FIXED_BYTES


def headroom_note(cluster: "ClusterConfig", mem_bytes: float | None) -> str:
    """Where the headroom comes from, in words (for ``plan``)."""
    if cluster.memory_headroom_gb is not None:
        return f"cluster.memory_headroom_gb={cluster.memory_headroom_gb:g}"
    return f"default: {HEADROOM_FRACTION:.0%} of {(mem_bytes or 0) / GB:.1f} GB + {HEADROOM_FIXED_BYTES / GB:g} GB"
