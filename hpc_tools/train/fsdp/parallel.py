"""How an FSDP job's model is spread over its ranks (``backend.fsdp.strategy``), on the rank's device.

- ``full_shard``: FSDP2 ``fully_shard`` over a 1-D mesh of every rank; each transformer block is its own unit (its
  parameters all-gathered just before its forward and backward, its gradients reduce-scattered after), the root (the
  embeddings, final norm and output layer) last.
- ``hybrid_shard``: the same over a 2-D mesh ``(replicate, shard)``: sharded inside a group of ``shard_size`` ranks,
  gradients all-reduced across the groups (HSDP).
- ``ddp``: ``DistributedDataParallel``: every rank a full copy, gradients all-reduced in buckets.
- ``parallel.tensor_size`` t > 1 (full_shard, Llama): FSDP x TP on a 2-D mesh ``(shard, tensor)`` with the t ranks of a
  tensor group consecutive (inside a node): each block's attention and MLP split by ``parallelize_module`` (q, k, v,
  gate and up projections column-wise, o and down projections row-wise: one all-reduce after attention and one after
  the MLP in the forward), then ``fully_shard`` over the ``shard`` dimension; embeddings, norms and the output layer
  are not split by TP (sharded by FSDP only).

Precision (``training.precision``): fp32 everywhere, or bf16 as FSDP2 does it (``MixedPrecisionPolicy``: bf16
parameters for compute, fp32 gradient reduction, fp32 sharded master weights and optimizer states); DDP autocasts
its fp32 model to bf16 (``autocast``). Activation checkpointing (``training.recompute_granularity: full``) is Hugging
Face's per-block, non-reentrant checkpoint: each block's input is kept and the block recomputed in the backward.
``backend.fsdp.compile`` compiles each block (``torch.compile``) before it is sharded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from hpc_tools.train.hf_causal_lm.model import blocks
from hpc_tools.train.hf_causal_lm.values import materialize

if TYPE_CHECKING:
    from hpc_tools.recipe.schema import Recipe


@dataclass(frozen=True, slots=True)
class Mesh:
    """The data-parallel shape: ``replicate`` groups of ``shard`` ranks (full_shard: 1 x world; ddp: world x 1)."""

    strategy: str
    replicate: int
    shard: int
    tensor: int = 1  # ranks of one tensor-parallel group (full_shard only)

    def describe(self) -> str:
        if self.strategy == "ddp":
            return f"DDP over {self.replicate} ranks"
        if self.strategy == "hybrid_shard":
            return f"HSDP {self.replicate} replicas x {self.shard}-rank shards"
        tp = f" x TP{self.tensor}" if self.tensor > 1 else ""
        return f"FSDP2 full_shard over {self.shard} ranks{tp}"


def mesh_shape(recipe: "Recipe", world: int) -> Mesh:
    """The mesh of the recipe's strategy over ``world`` ranks (the rules checked that the shard size divides it)."""
    fs = recipe.backend.fsdp
    if fs.strategy == "ddp":
        return Mesh("ddp", world, 1)
    if fs.strategy == "hybrid_shard":
        shard = fs.shard_size or recipe.cluster.gpus_per_node
        return Mesh("hybrid_shard", world // shard, shard)
    t = recipe.parallel.tensor_size
    return Mesh("full_shard", 1, world // t, t)


def parallelize(model, recipe: "Recipe", device, world: int, fill: Callable[[str, tuple], Any]):
    """The model ready to train on ``device``: sharded by ``fully_shard`` or wrapped in DDP (see the module doc).

    ``model`` comes with its parameters on the meta device (``hf_causal_lm.model.build_empty``): they are sharded
    first, then only this rank's shard is allocated on ``device`` (``to_empty``) and filled from ``fill(name,
    shape)``, one full parameter at a time (``hf_causal_lm.values.materialize``). The buffers (RoPE frequencies) are
    kept across ``to_empty``. A model with tied embeddings (GPT-2) is filled whole on the host before sharding
    instead: ``to_empty`` of sharded modules would give the two tied names separate tensors."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    if recipe.training.recompute_granularity == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if recipe.backend.fsdp.compile:
        for block in blocks(model):
            block.compile()  # per block, before sharding: FSDP2's hooks stay outside the compiled graphs
    if getattr(model.config, "tie_word_embeddings", False):
        materialize(model, torch.device("cpu"), fill)  # then fully_shard moves each rank's shard to the device
    shape = mesh_shape(recipe, world)
    if shape.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        materialize(model, device, fill)
        model.to(device)  # a tied model was filled on the host
        # gradients as views into the buckets: no second copy (the planner's 16 bytes/param)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if shape.strategy == "hybrid_shard":
        mesh = init_device_mesh(device.type, (shape.replicate, shape.shard), mesh_dim_names=("replicate", "shard"))
    elif shape.tensor > 1:
        both = init_device_mesh(device.type, (shape.shard, shape.tensor), mesh_dim_names=("shard", "tensor"))
        tensor_parallel(model, both["tensor"])
        mesh = both["shard"]
    else:
        mesh = init_device_mesh(device.type, (shape.shard,), mesh_dim_names=("shard",))
    bf16 = recipe.training.precision == "bf16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    reshard = recipe.backend.fsdp.reshard_after_forward
    for block in blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    # the root's parameters (embeddings, final norm, output layer) are needed again at once by the backward
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    materialize(model, device, fill)
    return model


# The tensor-parallel plan of a Llama block (Hugging Face module names): Megatron's split of attention and MLP.
LLAMA_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                 "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise"}


def tensor_parallel(model, mesh) -> None:
    """Split every block's projections over the 1-D ``mesh`` (``LLAMA_TP_PLAN``); the attention reshapes to its
    local heads (``-1`` heads of ``head_dim``), so each rank runs heads / t query and groups / t key-value heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in blocks(model):
        parallelize_module(block, mesh, {name: styles[style]() for name, style in LLAMA_TP_PLAN.items()})


def is_ddp(model) -> bool:
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def gradient_sync(model, on: bool):
    """A context in which the backward reduces gradients across ranks (``on``) or only accumulates them (DDP's
    ``no_sync`` for all but the last microbatch; FSDP2 reduce-scatters every microbatch so that only sharded
    gradients are ever kept)."""
    if is_ddp(model) and not on:
        return model.no_sync()
    return contextlib.nullcontext()


def compute_context(model, recipe: "Recipe", device) -> Any:
    """bf16 autocast for DDP (FSDP2 casts through its policy); nothing otherwise."""
    import torch

    if is_ddp(model) and recipe.training.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
