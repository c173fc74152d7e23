"""Experts, context parallelism, FP8 and multi-latent attention: the layout's two decompositions and every rule that
guards them (one line each, naming the field, the value and a fix)."""

from __future__ import annotations

import pytest

from hpc_tools.errors import RecipeError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import resolve
from hpc_tools.recipe.rules import gpu_has_fp8, gpu_has_mxfp8

MOE = {
    "name": "t",
    "model": {"family": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
              "vocab_size": 512, "num_experts": 8, "moe_router_topk": 2},
    "parallel": {"tensor_size": 2, "pipeline_size": 2, "expert_size": 4, "sequence_parallel": True},
    "training": {"micro_batch_size": 1, "global_batch_size": 16},
    "cluster": {"nodes": 4, "gpus_per_node": 8, "gpu_type": "H100-SXM"},
}


def violations(raw, overrides=()):
    try:
        resolve(raw, list(overrides))
    except RecipeError as exc:
        return [str(v) for v in exc.violations]
    return []


def lay(raw, overrides=()) -> ParallelLayout:
    return ParallelLayout.from_recipe(resolve(raw, list(overrides), check=False))


def test_both_decompositions_cover_the_world():
    """Dense: world = PP x TP x CP x DP; experts: world = PP x ETP x EP x EDP (ETP defaults to 1 with experts)."""
    x = lay(MOE, ["parallel.context_size=2"])
    assert x.world_size == 32 and (x.pipeline_size, x.tensor_size, x.context_size, x.data_size) == (2, 2, 2, 4)
    assert x.layout_size == x.world_size and x.dense_grad_size == 8
    assert (x.expert_tensor_size, x.expert_size, x.expert_data_size) == (1, 4, 4)
    assert x.pipeline_size * x.expert_tensor_size * x.expert_size * x.expert_data_size == x.world_size
    assert x.megatron_sizes() == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                                  "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 2,
                                  "expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1}
    assert "CP2" in x.describe() and "EP4xETP1xEDP4" in x.describe()
    # microbatches count data-parallel replicas only: the CP ranks of a replica share one sequence
    assert x.num_microbatches == 16 // (1 * 4)


def test_expert_tensor_size_defaults_to_tensor_size_without_experts():
    dense = {**MOE, "model": {k: v for k, v in MOE["model"].items() if k not in ("num_experts", "moe_router_topk")},
             "parallel": {"tensor_size": 2, "pipeline_size": 2}}
    x = lay(dense)
    assert x.expert_tensor_size == 2 and x.expert_data_size == x.data_size == 8
    assert lay(MOE, ["parallel.expert_tensor_size=2"]).expert_data_size == 32 // (2 * 2 * 4)


def test_moe_recipe_is_valid():
    assert violations(MOE) == []


@pytest.mark.parametrize("overrides, start, fix", [
    (["parallel.expert_size=3"], "parallel.expert_size=3 must divide model.num_experts=8", "try 1, 2, 4, 8"),
    (["parallel.expert_size=8", "parallel.expert_tensor_size=4"],
     "parallel.expert_size=8 x parallel.expert_tensor_size=4 must divide tensor x context x data", "for expert_size"),
    (["model.add_bias_linear=true", "parallel.expert_tensor_size=2"],
     "parallel.expert_tensor_size=2 must be 1 when the experts have biases", "set expert_tensor_size: 1"),
    (["model.add_bias_linear=true", "model.moe_shared_expert_intermediate_size=64"],
     "model.moe_shared_expert_intermediate_size=64 cannot be combined with model.add_bias_linear", "no shared expert"),
    (["model.moe_router_topk=9"], "model.moe_router_topk=9 exceeds model.num_experts=8", "use 1..8"),
    (["model.moe_layer_freq=[0, 1, 1]"], "model.moe_layer_freq=[0, 1, 1] has 3 entries, not one 0/1 per layer",
     "give 4 entries"),
    (["model.moe_layer_freq=5"], "model.moe_layer_freq=5 exceeds model.num_layers=4", "use 1..4"),
    (["model.moe_router_enable_expert_bias=true"],
     "model.moe_router_enable_expert_bias=true needs model.moe_router_score_function=sigmoid", "sigmoid"),
    (["parallel.sequence_parallel=false"], "parallel.sequence_parallel=false must be true for a model with experts",
     "set sequence_parallel: true"),
    (["parallel.context_size=4", "model.seq_length=40"],
     "model.seq_length=40 must be divisible by 2 x parallel.context_size x tensor_size (sequence parallel) = 16",
     "e.g. 48"),
    (["parallel.context_size=2", "backend.megatron.transformer_impl=local"],
     "parallel.context_size=2 needs Transformer Engine attention, not backend.megatron.transformer_impl=local",
     "transformer_impl: auto"),
    (["training.fp8=e4m3", "cluster.gpu_type=cpu", "cluster.nodes=1", "cluster.gpus_per_node=32"],
     "training.fp8=e4m3 needs GPUs with FP8 tensor cores; CPU ranks have none", "training.fp8: null"),
    (["training.fp8=e4m3", "training.fp8_recipe=mxfp8"],
     "training.fp8_recipe=mxfp8 needs Blackwell GPUs, not cluster.gpu_type=H100-SXM", "fp8_recipe: delayed"),
    (["training.fp8=e4m3", "training.precision=fp32"], "training.precision=fp32 cannot be combined with training.fp8",
     "precision: bf16"),
    (["training.fp8=e4m3", "model.hidden_size=72", "model.num_attention_heads=4", "model.ffn_hidden_size=256"],
     "model.hidden_size=72 gives a GEMM dimension of 72, not a multiple of 16", "use a multiple of 16"),
    (["training.fp8=e4m3", "model.moe_ffn_hidden_size=40"],
     "model.moe_ffn_hidden_size=40 gives a GEMM dimension per GPU of 40", "or training.fp8: null"),
    (["model.q_lora_rank=32"], "model.q_lora_rank=32 is read only with model.multi_latent_attention=true",
     "set multi_latent_attention: true"),
    (["model.multi_latent_attention=true", "model.num_query_groups=2"],
     "model.num_query_groups=2 has no meaning with model.multi_latent_attention", "num_query_groups: null"),
])
def test_every_branch_is_one_line_with_a_fix(overrides, start, fix):
    found = violations(MOE, overrides)
    matching = [m for m in found if m.startswith(start)]
    assert matching, f"no violation starting with {start!r} in {found}"
    assert fix in matching[0] and "\n" not in matching[0]


def test_expert_options_without_experts_are_refused():
    dense = {**MOE, "model": {k: v for k, v in MOE["model"].items() if k not in ("num_experts",)},
             "parallel": {"tensor_size": 2, "pipeline_size": 2}}
    assert any(v.startswith("parallel.expert_tensor_size=2 needs a model with experts")
               for v in violations(dense, ["parallel.expert_tensor_size=2"]))
    assert any(v.startswith("model.moe_shared_expert_intermediate_size=64 needs model.num_experts")
               for v in violations(dense, ["model.moe_shared_expert_intermediate_size=64"]))


@pytest.mark.parametrize("kind", ["deepspeed", "fsdp"])
@pytest.mark.parametrize("overrides, start", [
    (["parallel.expert_size=1"], "model.num_experts=8 is not available with backend.kind={kind}"),
    (["model.num_experts=null", "parallel.expert_size=1", "parallel.context_size=2"],
     "parallel.context_size=2 must be 1 with backend.kind={kind}"),
    (["parallel.expert_size=2"], "parallel.expert_size=2 must be 1 with backend.kind={kind}"),
    (["model.num_experts=null", "parallel.expert_size=1", "training.fp8=e4m3"],
     "training.fp8=e4m3 is not available with backend.kind={kind}"),
    (["model.num_experts=null", "parallel.expert_size=1", "model.multi_latent_attention=true"],
     "model.multi_latent_attention=true is not available with backend.kind={kind}"),
])
def test_other_backends_refuse_experts_cp_fp8_naming_megatron(kind, overrides, start):
    """Not silently ignored: one line naming the Megatron backend as the fix."""
    base = ["parallel.tensor_size=1", "parallel.pipeline_size=1", "parallel.sequence_parallel=false",
            f"backend.kind={kind}"]
    found = violations(MOE, base + overrides)
    matching = [m for m in found if m.startswith(start.format(kind=kind))]
    assert matching and "backend.kind: megatron" in matching[0], found


def test_fp8_capability_matches_the_peaks_table():
    """One fact, two readers: the rule refuses FP8 exactly on the GPUs profiling/peaks.py lists no fp8 peak for."""
    from profiling.peaks import PEAK_TFLOPS

    for gpu, peaks in PEAK_TFLOPS.items():
        assert gpu_has_fp8(gpu) == ("fp8" in peaks), gpu
    assert [g for g in PEAK_TFLOPS if gpu_has_mxfp8(g)] == ["B200", "GB200"]
    assert not gpu_has_fp8("A100") and not gpu_has_fp8("a10g") and gpu_has_fp8("H100")
