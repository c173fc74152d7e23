"""Recipes the planner tests own, so that editing a shipped recipe (recipes/*.yaml) breaks no expectation here.

They have the shapes of the shipped production recipes (a 1.3B GPT under Megatron 3D parallelism on 2 x 8 H100, a
1.1B LLaMA under ZeRO-3 on 2 x 8 A100-80GB); the tests that read them state their numbers against these dicts.
"""

from __future__ import annotations

from hpc_tools.recipe.load import resolve
from hpc_tools.recipe.schema import Recipe

GPT_3D = {
    "name": "gpt_3d_inline",
    "model": {"family": "gpt", "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "seq_length": 2048,
              "vocab_size": 50257},
    "parallel": {"tensor_size": 2, "pipeline_size": 2, "virtual_pipeline_size": 2, "data_size": -1,
                 "sequence_parallel": True},
    "training": {"micro_batch_size": 2, "global_batch_size": 256, "precision": "bf16",
                 "recompute_granularity": "selective"},
    "backend": {"kind": "megatron", "megatron": {"distributed_optimizer": True, "overlap_grad_reduce": True,
                                                 "overlap_param_gather": True}},
    "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "H100-SXM", "time_limit": "04:00:00",
                "signal_delay_s": 180},
}

# A small dense model on 2 x 8 H100 with no backend: the sharding-scheme tests add each backend kind to it.
SMALL_DENSE = {
    "name": "schemes",
    "model": {"num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 2048,
              "vocab_size": 32000},
    "training": {"micro_batch_size": 1, "global_batch_size": 64, "precision": "bf16"},
    "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "H100-SXM"},
}

LLAMA_ZERO = {
    "name": "gpt_zero_inline",
    "model": {"family": "llama", "num_layers": 22, "hidden_size": 2048, "num_attention_heads": 32,
              "num_query_groups": 4, "ffn_hidden_size": 5632, "seq_length": 2048, "vocab_size": 32000},
    "training": {"micro_batch_size": 4, "global_batch_size": 512, "precision": "bf16"},
    "backend": {"kind": "deepspeed", "deepspeed": {"zero_stage": 3}},
    "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "A100-80GB"},
}

# Mixtral 8x7B's published config (mistralai/Mixtral-8x7B-v0.1 config.json): 32 layers, hidden 4096, 32 heads, 8 KV
# heads, intermediate 14336, vocab 32000, 8 local experts, 2 per token, RMSNorm, SwiGLU, RoPE theta 1e6, untied.
# Published: 46.7 B parameters, 12.9 B active per token.
MIXTRAL_8X7B = {
    "name": "mixtral_8x7b",
    "model": {"family": "llama", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_query_groups": 8, "ffn_hidden_size": 14336, "seq_length": 4096, "vocab_size": 32000,
              "rotary_base": 1000000, "num_experts": 8, "moe_router_topk": 2},
    "parallel": {"tensor_size": 1, "pipeline_size": 4, "expert_size": 8},
    "training": {"micro_batch_size": 1, "global_batch_size": 256, "precision": "bf16",
                 "recompute_granularity": "full"},
    "backend": {"kind": "megatron", "megatron": {"distributed_optimizer": True}},
    "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu_type": "H100-SXM"},
}

# DeepSeek-V3's published config (deepseek-ai/DeepSeek-V3 config.json): 61 layers (the first 3 dense,
# first_k_dense_replace), hidden 7168, dense intermediate 18432, 256 routed experts of 2048 and 1 shared expert of
# 2048, 8 per token, sigmoid scores with the aux-loss-free expert bias, multi-latent attention (128 heads, q_lora_rank
# 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128), vocab 129280, untied. Its
# multi-token-prediction module (num_nextn_predict_layers 1) is not part of the count. Published: 671 B parameters,
# 37 B activated (36.6 B without the input embedding).
DEEPSEEK_V3 = {
    "name": "deepseek_v3",
    "model": {"family": "llama", "num_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
              "ffn_hidden_size": 18432, "seq_length": 4096, "vocab_size": 129280, "rotary_base": 10000,
              "num_experts": 256, "moe_router_topk": 8, "moe_ffn_hidden_size": 2048,
              "moe_shared_expert_intermediate_size": 2048, "moe_layer_freq": [0] * 3 + [1] * 58,
              "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
              "moe_router_load_balancing_type": "seq_aux_loss", "moe_aux_loss_coeff": 0.0001,
              "multi_latent_attention": True, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_head_dim": 128,
              "qk_pos_emb_head_dim": 64, "v_head_dim": 128},
    "parallel": {"tensor_size": 1, "pipeline_size": 1, "expert_size": 64},
    "training": {"micro_batch_size": 1, "global_batch_size": 1024, "precision": "bf16", "fp8": "e4m3",
                 "fp8_recipe": "blockwise", "recompute_granularity": "full"},
    "backend": {"kind": "megatron", "megatron": {"distributed_optimizer": True}},
    "cluster": {"nodes": 128, "gpus_per_node": 8, "gpu_type": "H100-SXM"},
}

# A Llama-3-8B shape at 32k tokens with context parallelism (CP4 x TP2 + SP x DP2 on 2 x 8 H100).
LLAMA_LONG = {
    "name": "llama_long_inline",
    "model": {"family": "llama", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_query_groups": 8, "ffn_hidden_size": 14336, "seq_length": 32768, "vocab_size": 128256,
              "rotary_base": 500000},
    "parallel": {"tensor_size": 2, "pipeline_size": 1, "context_size": 4, "sequence_parallel": True},
    "training": {"micro_batch_size": 1, "global_batch_size": 32, "precision": "bf16",
                 "recompute_granularity": "selective"},
    "backend": {"kind": "megatron", "megatron": {"distributed_optimizer": True}},
    "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "H100-SXM"},
}

INLINE = {"gpt_3d": GPT_3D, "gpt_zero": LLAMA_ZERO, "mixtral_8x7b": MIXTRAL_8X7B, "deepseek_v3": DEEPSEEK_V3,
          "llama_long": LLAMA_LONG}


def inline_recipe(name: str, *overrides: str, check: bool = True) -> Recipe:
    """One of the recipes above (a key of ``INLINE``), with ``--set``-style overrides."""
    return resolve(INLINE[name], list(overrides), source=f"{name} (inline)", check=check)
