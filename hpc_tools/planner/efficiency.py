"""The compute efficiency a plan assumes (the fraction of the dense 16-bit peak its GEMM-bound compute reaches): a
stored calibration per cluster (GPU type and partition) and backend kind, in a JSON file ($HPC_TOOLS_CALIBRATION,
else ~/.config/hpc_tools/calibration.json) that ``calibrate.calibrate`` writes and every plan and search reads
(``resolve_efficiency``), else the default of the layers the backend runs (``default_efficiency``).

A calibration is keyed by the backend kind as well as the cluster: Megatron-core's fused Transformer Engine layers and
Hugging Face's eager PyTorch layers reach different shares of the peak on the same GPUs, so a factor fitted on FSDP
runs never prices Megatron, nor the reverse. Files of version 1 (keyed by the cluster alone) do not say which backend
their runs used; their factors are not read (``plan --calibrate`` the runs again).

The uncalibrated defaults, each from a published measurement (``tests/unit/test_efficiency_defaults.py`` re-plans
torchtitan's measured configuration with the Hugging Face ones):

- Megatron-core layers (Transformer Engine, fused kernels): 0.6. Narayanan et al., "Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM" (SC'21, arXiv 2104.04473): 44-52 % of the A100 peak end to end
  from 1.7 B to 1 T parameters, with the pipeline bubble and communication included; NVIDIA's Megatron-LM README
  (https://github.com/NVIDIA/Megatron-LM, "Training speed and scalability") 41-48 % MFU on H100 from 2 B to 462 B.
  The planner adds its bubble and exposed communication to compute at 0.6 of the peak, which lands in that range.
- Hugging Face eager layers (FSDP2 and DeepSpeed run the same ``transformers`` modules): 0.30; with
  ``backend.fsdp.compile`` (torch.compile per block): 0.35. torchtitan (Liang et al., "TorchTitan: One-stop PyTorch
  native solution for production ready LLM pre-training", arXiv 2410.06511; numbers of
  https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md, Table 1): Llama 3.1
  8B under FSDP2 on 8 H100, local batch 2, sequence 8192, bf16: 5,762 tokens/s per GPU eager, 6,667 with
  torch.compile, which torchtitan reports as 33 % and 39 % MFU against the H100 SXM peak (989 TFLOP/s). The factors
  are what makes this planner predict those two throughputs for that configuration (compute at the factor, its
  exposed FSDP communication added). torchtitan's GPUs ran at 500 W with HBM2e, below the SXM part's peak, so the
  factors are conservative for H100 SXM at 700 W; calibrate to replace them.

Megatron's figure depends on the attention path the recipe is planned for (``backends.py`` ``attention_path``; the
rank names the one it gets, ``layers.layer_plan``), since the layers without Transformer Engine run their norms,
activation, attention softmax and cross-entropy as separate kernels (``MEGATRON_BY_PATH``):

- ``te`` (TE layers, flash or cuDNN fused attention): 0.6, the published figures above.
- ``unfused`` (Megatron-core's local layers, unfused O(s^2) attention): 0.229, **measured** on one NVIDIA H200
  (2026-11-28, torch 2.11.0+cu130, no TE, no apex): ``benchmarks/gpu_mfu.py --size 1.3b --layers local`` (GPT 1.3B,
  seq 2048, micro 4 x 8, bf16, TP1) ran 2.452 s per step, 22.9 % MFU of 989.4 TFLOP/s (2.461 s, 22.8 % the day
  before); at 0.229 the planner predicts 2.450 s for that step (at 0.6 it predicted 0.935 s, 2.6x optimistic).
- ``sdpa`` (local layers, torch's scaled_dot_product_attention): 0.35, an **estimate, not a measurement**: above the
  measured unfused figure by the s^2 score, softmax and mask passes the flash kernel removes, below TE's because the
  norms, the activation and the cross-entropy stay separate kernels. Replace it by the first measurement
  (``gpu_mfu.py --layers local`` with ``use_flash_attention: true``, then ``plan --calibrate``).
- ``te-unfused`` (TE layers, TE's unfused attention: ``use_flash_attention: false``, or fp32): 0.45, an
  **estimate**: TE's fused norms and linears with the s^2 attention.

A calibration is stored per attention path as well (``efficiency_key``: ``megatron`` for ``te``, ``megatron+sdpa``,
``megatron+unfused``, ``megatron+te-unfused``): a factor fitted on TE runs never prices a node without TE.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_tools import backends
from hpc_tools.errors import UserError

if TYPE_CHECKING:
    from hpc_tools.recipe.cluster import ClusterConfig
    from hpc_tools.recipe.schema import Recipe


CALIBRATION_VERSION = 2  # 2: keys name the backend kind ("H100-SXM@gpu/fsdp"); 1: the cluster alone (not read)

MEGATRON_EFFICIENCY = 0.6  # Megatron-core layers (Narayanan et al. 2021; Megatron-LM README): see the module doc
MEGATRON_BY_PATH: dict[str, tuple[float, str]] = {
    "te": (MEGATRON_EFFICIENCY, "default for Megatron-core TE layers (Narayanan et al. 2021)"),
    "unfused": (0.229, "measured: Megatron-core local layers, unfused attention, H200, 2026-11-28 "
                       "(gpu_mfu.py --size 1.3b --layers local: 22.9 % MFU)"),
    "sdpa": (0.35, "estimate, not measured: Megatron-core local layers with SDPA attention (between the measured "
                   "unfused 0.229 and TE's 0.6)"),
    "te-unfused": (0.45, "estimate, not measured: Megatron-core TE layers with TE's unfused attention"),
}
"""Megatron's default efficiency per attention path (``backends.py`` ``attention_path``): (factor, its source)."""
HF_EAGER_EFFICIENCY = 0.30  # Hugging Face eager layers (torchtitan's FSDP2 Llama 3.1 8B, eager): see the module doc
HF_COMPILED_EFFICIENCY = 0.35  # the same with torch.compile per block (backend.fsdp.compile)


def default_efficiency(recipe: "Recipe") -> tuple[float, str]:
    """(efficiency, its source) for a recipe without a calibration: the default of the layers its backend runs."""
    row = backends.of(recipe)
    if row.layers == "megatron":
        return MEGATRON_BY_PATH[row.attention_path(recipe)]
    if row.compiled(recipe):
        return HF_COMPILED_EFFICIENCY, "default for compiled PyTorch layers (torchtitan FSDP2 + torch.compile)"
    return HF_EAGER_EFFICIENCY, "default for Hugging Face eager layers (torchtitan FSDP2, eager)"


def default_path() -> Path:
    """$HPC_TOOLS_CALIBRATION, else ~/.config/hpc_tools/calibration.json."""
    env = os.environ.get("HPC_TOOLS_CALIBRATION")
    return Path(env) if env else Path.home() / ".config" / "hpc_tools" / "calibration.json"


def cluster_key(cluster: "ClusterConfig") -> str:
    """``H100-SXM`` or ``H100-SXM@partition``: what one efficiency factor is valid for."""
    return cluster.gpu_type + (f"@{cluster.partition}" if cluster.partition else "")


def load_store(path: Path | None = None) -> dict[str, Any]:
    path = path or default_path()
    if not path.is_file():
        return {"version": CALIBRATION_VERSION, "clusters": {}}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"calibration file {path} is not valid JSON ({exc.msg}; delete it or fix it)") from None
    data.setdefault("clusters", {})
    return data


def calibration_key(cluster: "ClusterConfig", kind: str) -> str:
    """``H100-SXM@partition/fsdp``: what one stored efficiency factor is valid for (cluster and backend kind)."""
    return f"{cluster_key(cluster)}/{kind}"


def efficiency_key(recipe: "Recipe") -> str:
    """What a stored efficiency is kept under besides the cluster: the backend kind, and for Megatron the attention
    path when it is not TE's (``megatron+sdpa``, ``megatron+unfused``, ``megatron+te-unfused``; ``megatron`` alone for
    TE layers, as files written before the paths were told apart hold)."""
    row = backends.of(recipe)
    if row.layers != "megatron":
        return recipe.backend.kind
    path = row.attention_path(recipe)
    return recipe.backend.kind if path == "te" else f"{recipe.backend.kind}+{path}"


def efficiency_for(cluster: "ClusterConfig", kind: str, path: Path | None = None) -> tuple[float, str] | None:
    """(efficiency, source) stored for this cluster and backend kind (exact key, else the GPU type alone with that
    kind), or None. Keys without a kind (files of version 1) are not read: their backend is unknown."""
    clusters = load_store(path)["clusters"]
    for key in (calibration_key(cluster, kind), f"{cluster.gpu_type}/{kind}"):
        if key in clusters:
            return float(clusters[key]["efficiency"]), f"calibrated {key}, {len(clusters[key].get('runs', []))} run(s)"
    return None


def resolve_efficiency(recipe: "Recipe", efficiency: float | None = None,
                       calibration: Path | None = None, use_calibration: bool = True) -> tuple[float, str]:
    """(efficiency, where it came from): an explicit value, else the stored calibration for the recipe's cluster,
    backend kind and attention path (``efficiency_key``), else the default of the layers and attention path the
    recipe's backend runs (``default_efficiency``)."""
    if efficiency is not None:
        return efficiency, "--efficiency"
    if use_calibration:
        found = efficiency_for(recipe.cluster, efficiency_key(recipe), calibration)
        if found:
            return found
    return default_efficiency(recipe)
