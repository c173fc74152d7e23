"""The recipe's `model:`, `parallel:`, `training:` and `backend.megatron:` sections as Megatron-core configs."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.schema import Recipe

PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def params_dtype(recipe: "Recipe"):
    import torch

    return getattr(torch, PRECISION_DTYPES[recipe.training.precision])


def transformer_config(recipe: "Recipe", layout: "ParallelLayout", device_type: str):
    """TransformerConfig for this recipe and layout.

    The parallel sizes go into the config as well as into parallel_state: without them sequence parallelism refuses
    to start and, with PP=2, the distributed and plain optimizers diverge (docs/megatron-on-cpu.md). Fusions that
    need apex or Transformer Engine stay off on CPU.
    """
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, t = recipe.model, recipe.training
    dtype = params_dtype(recipe)
    on_gpu = device_type == "cuda"
    recompute = None if t.recompute_granularity == "none" else t.recompute_granularity
    interleaved = layout.interleaved
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size, kv_channels=m.head_dim,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout, init_method_std=m.init_method_std,
        layernorm_epsilon=m.norm_epsilon, normalization=m.normalization, add_bias_linear=m.add_bias_linear,
        gated_linear_unit=m.activation == "swiglu", activation_func=F.silu if m.activation == "swiglu" else F.gelu,
        tensor_model_parallel_size=layout.tensor_size, pipeline_model_parallel_size=layout.pipeline_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_size if interleaved else None,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=t.precision == "bf16", fp16=t.precision == "fp16",
        attention_softmax_in_fp32=True,
        recompute_granularity=recompute,
        recompute_method=t.recompute_method if recompute == "full" else None,
        recompute_num_layers=t.recompute_num_layers if recompute == "full" else None,
        use_cpu_initialization=not on_gpu,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        # Interleaved 1F1B with PP=2 and batched p2p gives silently wrong losses on gloo; plain p2p is exact
        # (docs/megatron-on-cpu.md; test_megatron_layouts' PP2xVPP2 case checks it).
        batch_p2p_comm=not (interleaved and layout.pipeline_size == 2),
        deallocate_pipeline_outputs=True,
    )


def ddp_config(recipe: "Recipe"):
    from megatron.core.distributed import DistributedDataParallelConfig

    mg = recipe.backend.megatron
    # check_for_nan_in_grad raises on the rank that sees a NaN; the non-finite guard wants every rank to skip the
    # update together and count it (training.max_nonfinite_steps), so the engine checks the reduced grad buffers
    # itself (engine.Engine._nonfinite) and fp16 keeps Megatron's own found_inf skip.
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=recipe.training.precision != "fp32", overlap_grad_reduce=mg.overlap_grad_reduce,
        overlap_param_gather=mg.overlap_param_gather, align_param_gather=mg.overlap_param_gather,
        use_distributed_optimizer=mg.distributed_optimizer, check_for_nan_in_grad=False, bucket_size=None)


def optimizer_config(recipe: "Recipe"):
    from megatron.core.optimizer import OptimizerConfig

    t, mg = recipe.training, recipe.backend.megatron
    return OptimizerConfig(
        optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=t.precision == "bf16",
        fp16=t.precision == "fp16", params_dtype=params_dtype(recipe),
        use_distributed_optimizer=mg.distributed_optimizer,
        overlap_param_gather=mg.overlap_param_gather, initial_loss_scale=2.0 ** 16, loss_scale_window=1000,
        hysteresis=2, min_loss_scale=1.0)
