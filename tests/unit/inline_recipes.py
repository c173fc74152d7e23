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

LLAMA_ZERO = {
    "name": "gpt_zero_inline",
    "model": {"family": "llama", "num_layers": 22, "hidden_size": 2048, "num_attention_heads": 32,
              "num_query_groups": 4, "ffn_hidden_size": 5632, "seq_length": 2048, "vocab_size": 32000},
    "training": {"micro_batch_size": 4, "global_batch_size": 512, "precision": "bf16"},
    "backend": {"kind": "deepspeed", "deepspeed": {"zero_stage": 3}},
    "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "A100-80GB"},
}

INLINE = {"gpt_3d": GPT_3D, "gpt_zero": LLAMA_ZERO}


def inline_recipe(name: str, *overrides: str, check: bool = True) -> Recipe:
    """One of the recipes above (``gpt_3d`` or ``gpt_zero``), with ``--set``-style overrides."""
    return resolve(INLINE[name], list(overrides), source=f"{name} (inline)", check=check)
