"""GPTModel chunks for this rank: the layer spec, one chunk per virtual pipeline stage, Float16Module, megatron DDP."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hpc_tools.train.megatron.layers import layer_plan

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.schema import Recipe

log = logging.getLogger("hpc_tools.megatron")


class SequenceParallelNorm:
    """torch LayerNorm / RMSNorm whose parameters carry ``sequence_parallel``.

    Megatron's WrappedTorchNorm refuses sequence parallelism; the plain norm is exact under it as long as its
    parameters are tagged, so that finalize_model_grads all-reduces their gradients over the tensor-parallel group
    (untagged, the norms of each TP rank see only their share of the sequence and drift apart; see
    docs/megatron-on-cpu.md).
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        import torch

        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm


def block_spec(recipe: "Recipe", config, device_type: str, vp_stage: int | None):
    """The decoder block of one model chunk: TE layers, or Megatron's local layers with SequenceParallelNorm (and,
    on the ``sdpa`` attention path, ``SDPAttention`` as their core attention)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
        get_transformer_layer_offset,
    )

    plan = layer_plan(recipe, device_type)
    te = plan.transformer_engine
    core = _core_attention(plan)
    if config.num_moe_experts:
        bind_router_gemm()
    if config.num_moe_experts or config.multi_latent_attention:
        # Megatron's own block spec: MoE layers where moe_layer_freq says, dense ones elsewhere, this stage's slice.
        if te:
            return specs.get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
        layers = specs.get_gpt_decoder_layer_specs(config, use_transformer_engine=False,
                                                   normalization=config.normalization)
        for layer in {id(spec): spec for spec in layers}.values():
            _local_norms(layer, core)
        pipelined = config.pipeline_model_parallel_size > 1  # (the offset asks the pipeline group)
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage) if pipelined else 0
        count = get_num_layers_to_build(config, vp_stage=vp_stage)
        return TransformerBlockSubmodules(layer_specs=layers[offset:offset + count], layer_norm=SequenceParallelNorm)
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec()
    layer = _local_norms(specs.get_gpt_layer_local_spec(normalization=config.normalization), core)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * count, layer_norm=SequenceParallelNorm)


def bind_router_gemm() -> None:
    """Bind megatron-core's ``moe_utils.te_general_gemm`` to None where Transformer Engine did not import, on every
    device: megatron-core 0.16.1 binds the name only inside its TE import ``try``, and the router's fp32 gating GEMM
    (``router_gating_linear``, which ``moe_router_dtype: fp32`` in ``config.moe_options`` selects) reads it, so
    without TE the first forward raised ``NameError``; None takes its torch ``mm`` path. With TE the name is TE's
    GEMM and stays."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _core_attention(plan):
    """The local layers' core attention class on this plan's attention path: ``SDPAttention`` on ``sdpa``, else None
    (megatron-core's ``DotProductAttention`` stays)."""
    if not plan.sdpa:
        return None
    from hpc_tools.train.megatron.sdpa_attention import SDPAttention

    return SDPAttention


def _local_norms(layer, core_attention=None):
    """A local layer spec with SequenceParallelNorm as its input and pre-MLP norms (and ``core_attention``, when
    given, as its attention core)."""
    layer.submodules.input_layernorm = SequenceParallelNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
    if core_attention is not None:
        layer.submodules.self_attention.submodules.core_attention = core_attention
    return layer


def build_chunks(recipe: "Recipe", layout: "ParallelLayout", config, device_type: str) -> list:
    """This rank's GPTModel chunks (one per virtual stage), cast to bf16/fp16 and wrapped in megatron DDP."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    from hpc_tools.train.megatron.config import ddp_config

    m = recipe.model
    stages = layout.virtual_pipeline_size if layout.interleaved else 1
    chunks = []
    for i in range(stages):
        vp = i if layout.interleaved else None
        model = GPTModel(
            config=config, transformer_layer_spec=block_spec(recipe, config, device_type, vp),
            vocab_size=m.padded_vocab_size(layout.tensor_size), max_sequence_length=m.seq_length,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=not m.untie_embeddings, parallel_output=True,
            position_embedding_type=m.position_embedding, rotary_base=m.rotary_base, vp_stage=vp)
        if device_type == "cuda":
            model.cuda(torch.cuda.current_device())
        if config.bf16 or config.fp16:
            # Before DDP: DDP lays the parameters out in its contiguous buffers with the dtype they have when wrapped,
            # so the 16-bit cast must come first (Megatron-LM wraps in the same order).
            model = Float16Module(config, model)
        chunks.append(model)
    ddp = ddp_config(recipe)
    # Only the first chunk buckets its gradients (Megatron-LM does the same with interleaving).
    wrapped = [DistributedDataParallel(config=config, ddp_config=ddp, module=c, disable_bucketing=i > 0)
               for i, c in enumerate(chunks)]
    for w in wrapped:
        w.broadcast_params()  # identical DP replicas whatever the seed handling did
    return wrapped


def unwrap(chunk):
    """The GPTModel inside DDP (and Float16Module): the module whose state dict keys are layout-independent."""
    from megatron.core.transformer.module import Float16Module

    inner = chunk.module
    return inner.module if isinstance(inner, Float16Module) else inner
