"""``backend:`` — which training program runs on every rank, and its own options."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from hpc_tools.backends import KINDS
from hpc_tools.recipe.base import Section

BackendKind = Literal[KINDS]  # the backend table's kinds (hpc_tools/backends.py)


class MegatronOptions(Section):
    distributed_optimizer: bool = True
    """Shard optimizer states across the data-parallel group (Megatron's ZeRO-1)."""
    overlap_grad_reduce: bool = False
    """Overlap the data-parallel gradient reduce with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the forward pass."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: Transformer Engine when importable on a GPU (auto), or Megatron's local layers."""
    use_flash_attention: bool = True
    """Fused attention on GPU (changes the activation-memory plan: no s^2 terms stored)."""


class DeepSpeedOptions(Section):
    zero_stage: Literal[0, 1, 2, 3] = 1
    """ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters sharded across data-parallel ranks."""
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    """Where optimizer states live (ZeRO-Offload / ZeRO-Infinity); needs zero_stage >= 1."""
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    """Where parameters live between uses; needs zero_stage 3."""
    nvme_path: str | None = None
    """Local NVMe folder for nvme offload."""
    pretrained_path: str | None = None
    """Local Hugging Face model folder to start from instead of building from `model:` (never downloaded)."""
    config_overrides: dict[str, Any] = Field(default_factory=dict)
    """Keys merged last into the generated ds_config.json (escape hatch; the batch triple cannot be overridden)."""
    liger: bool = False
    """Liger Kernel's Triton kernels for a Llama model on GPU: RMSNorm, SwiGLU, RoPE and the fused linear cross
    entropy (the logits are never materialised: the largest activation of a small model). Needs the liger-kernel
    package (environment/requirements-gpu.txt); on CPU ranks it does not apply: one note in the rank log, plain
    layers."""


class FSDPOptions(Section):
    strategy: Literal["full_shard", "hybrid_shard", "ddp"] = "full_shard"
    """How data-parallel ranks hold the model: `full_shard` (FSDP2: parameters, gradients and optimizer states
    sharded over all ranks, each transformer block its own unit, the root last), `hybrid_shard` (HSDP: sharded inside
    a group of shard_size ranks, replicated across the groups; a 2-D device mesh) or `ddp` (every rank a full copy,
    gradients all-reduced: DistributedDataParallel)."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward and gather them again for the backward (ZeRO-3-like,
    least memory); false keeps them from forward to backward (ZeRO-2-like, one all-gather per step fewer)."""
    shard_size: int | None = Field(default=None, gt=0, le=1 << 20)
    """hybrid_shard only: ranks in one shard group (the mesh's inner dimension); null = cluster.gpus_per_node, so
    parameters are sharded inside a node and replicated across nodes."""
    compile: bool = False
    """Compile each transformer block with torch.compile before sharding it (the first steps pay the compilation:
    minutes on CPU ranks, where it is rarely worth it)."""
    liger: bool = False
    """Liger Kernel's Triton kernels for a Llama model on GPU: RMSNorm, SwiGLU, RoPE and the fused linear cross
    entropy (the logits are never materialised: the largest activation of a small model). Needs the liger-kernel
    package (environment/requirements-gpu.txt); on CPU ranks it does not apply: one note in the rank log, plain
    layers."""


class HorovodOptions(Section):
    compression: Literal["none", "fp16"] = "none"
    """Gradients on the wire: `none` (fp32, as the backward computed them) or `fp16` (Horovod's Compression.fp16:
    half the all-reduce bytes; the sum is taken in fp16, so the losses drift from DDP's)."""
    fusion_threshold_mb: int = Field(default=128, ge=0, le=1 << 16)
    """Horovod's tensor fusion buffer in MiB (HOROVOD_FUSION_THRESHOLD, which is in bytes): gradients ready in the
    same cycle are all-reduced together, up to this size; 0 turns fusion off. 128 is Horovod's own default."""
    liger: bool = False
    """Liger Kernel's Triton kernels for a Llama model on GPU: RMSNorm, SwiGLU, RoPE and the fused linear cross
    entropy (the logits are never materialised: the largest activation of a small model). Needs the liger-kernel
    package (environment/requirements-gpu.txt); on CPU ranks it does not apply: one note in the rank log, plain
    layers."""


class BackendConfig(Section):
    kind: BackendKind = "megatron"
    """Training program: `megatron` (Megatron-core GPT, 3D parallel), `deepspeed` (Hugging Face causal LM under ZeRO),
    `fsdp` (Hugging Face causal LM under PyTorch FSDP2 or DDP), `horovod` (the same model under Horovod's
    DistributedOptimizer; needs `bash environment/install-horovod.sh`), or `comm_check` (no model: every rank joins
    the process group and times all-reduces; a cluster smoke test)."""
    megatron: MegatronOptions = Field(default_factory=MegatronOptions)
    """Options for kind: megatron."""
    deepspeed: DeepSpeedOptions = Field(default_factory=DeepSpeedOptions)
    """Options for kind: deepspeed."""
    fsdp: FSDPOptions = Field(default_factory=FSDPOptions)
    """Options for kind: fsdp."""
    horovod: HorovodOptions = Field(default_factory=HorovodOptions)
    """Options for kind: horovod."""
