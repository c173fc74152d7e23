"""One case per validation rule: the message names the field, the value, the rule and a fix."""

from __future__ import annotations

import pytest

from hpc_tools.errors import RecipeError
from hpc_tools.recipe.load import resolve
from hpc_tools.recipe.rules import RULES

BASE = {
    "name": "t",
    "model": {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 8, "seq_length": 32, "vocab_size": 512},
    "parallel": {"tensor_size": 2, "pipeline_size": 2},
    "training": {"micro_batch_size": 1, "global_batch_size": 8},
    "cluster": {"nodes": 2, "gpus_per_node": 4, "gpu_type": "H100-SXM"},
}

# rule name -> (overrides, message start, fix fragment)
CASES = {
    "layout_fills_world": (["parallel.tensor_size=4", "parallel.pipeline_size=4", "cluster.nodes=3"],
                           "parallel.tensor_size=4 x parallel.pipeline_size=4 must divide the world size",
                           "one of 1, 2, 3, 4, 6, 12"),
    "heads_divisible_by_tensor": (["model.num_attention_heads=6", "model.hidden_size=96", "parallel.tensor_size=4",
                                   "parallel.pipeline_size=1", "training.global_batch_size=2"],
                                  "parallel.tensor_size=4 must divide model.num_attention_heads=6", "try 1, 2, 3, 6"),
    "heads_shape": (["model.num_query_groups=3"], "model.num_query_groups=3 must divide model.num_attention_heads=8",
                    "try 1, 2, 4, 8"),
    "layers_divisible_by_stages": (["model.num_layers=6", "parallel.virtual_pipeline_size=2"],
                                   "model.num_layers=6 must be divisible by parallel.pipeline_size x "
                                   "virtual_pipeline_size=4", "use a multiple of 4 layers"),
    "uneven_pipeline_stages": (["parallel.num_layers_in_first_pipeline_stage=8"],
                               "parallel.num_layers_in_first_pipeline_stage=8 leaves no layer of model.num_layers=8 "
                               "for the 1 middle stage(s)", "leave both null: the stages divide evenly"),
    "interleaving_needs_pipeline": (["parallel.pipeline_size=1", "parallel.virtual_pipeline_size=2"],
                                    "parallel.virtual_pipeline_size=2 needs parallel.pipeline_size > 1",
                                    "set pipeline_size >= 2"),
    "global_batch_divisible": (["training.global_batch_size=5"],
                               "training.global_batch_size=5 must be divisible by micro_batch_size x data_size",
                               "try 4 or 6"),
    "sequence_parallel_needs_tensor": (["parallel.sequence_parallel=true", "parallel.tensor_size=1",
                                        "training.global_batch_size=16"],
                                       "parallel.sequence_parallel=true needs parallel.tensor_size > 1",
                                       "set tensor_size >= 2"),
    "recompute_layers_fit": (["training.recompute_granularity=full", "training.recompute_num_layers=5"],
                             "training.recompute_num_layers=5 exceeds the 4 layers of one pipeline chunk", "use 1..4"),
    "deepspeed_layout": (["backend.kind=deepspeed", "parallel.tensor_size=1", "backend.deepspeed.zero_stage=3",
                          "training.global_batch_size=16"],
                         "backend.deepspeed.zero_stage=3 cannot be combined with DeepSpeed's pipeline",
                         "use zero_stage 0 or 1"),
    "deepspeed_offload": (["backend.kind=deepspeed", "parallel.tensor_size=1", "parallel.pipeline_size=1",
                           "backend.deepspeed.zero_stage=2", "backend.deepspeed.offload_param=cpu"],
                          "backend.deepspeed.offload_param=cpu needs zero_stage 3",
                          "set backend.deepspeed.zero_stage: 3"),
    "deepspeed_model_expressible": (["backend.kind=deepspeed", "parallel.tensor_size=1", "parallel.pipeline_size=1",
                                     "model.num_query_groups=2", "training.global_batch_size=8"],
                                    "model.num_query_groups=2 needs model.family=llama with backend.kind=deepspeed",
                                    "set it null"),
    "megatron_overlap": (["backend.megatron.overlap_param_gather=true"],
                         "backend.megatron.overlap_param_gather=true needs distributed_optimizer: true and "
                         "overlap_grad_reduce: true", "enable both"),
    "precision_on_device": (["cluster.gpu_type=cpu", "training.precision=fp16"],
                            "training.precision=fp16 is not supported on CPU ranks", "use bf16 or fp32"),
    "lr_schedule": (["training.min_lr=0.01", "training.lr=0.001"], "training.min_lr=0.01 exceeds training.lr=0.001",
                    "use a value <= 0.001"),
    "data_sources": (["data.source=files"], "data.paths=[] is empty but data.source=files", "list local files"),
    "checkpoint_local_tier": (["checkpoint.local_interval_iters=5"],
                              "checkpoint.local_interval_iters=5 needs checkpoint.local_dir",
                              "set checkpoint.local_dir (e.g. /tmp/$SLURM_JOB_ID/ckpt) or local_interval_iters: 0"),
    "settings_take_effect": (["training.fp8_recipe=tensorwise"], "training.fp8_recipe=tensorwise is read only with "
                             "training.fp8", "set training.fp8: e4m3 or hybrid, or remove fp8_recipe"),
    "signal_before_limit": (["cluster.time_limit=2", "cluster.signal_delay_s=120"],
                            "cluster.signal_delay_s=120 must be shorter than cluster.time_limit=2 (120 s)",
                            "lower it or raise the time limit"),
    "spares_need_restarts": (["cluster.spare_nodes=1"], "cluster.spare_nodes=1 are only used by in-job restarts, and "
                             "cluster.restarts is 0", "set cluster.restarts (e.g. 2) or spare_nodes: 0"),
    "min_nodes_within_nodes": (["cluster.min_nodes=3", "cluster.restarts=2"], "cluster.min_nodes=3 exceeds "
                               "cluster.nodes=2", "set min_nodes <= 2 (null: off)"),
    "elastic_needs_restarts": (["cluster.min_nodes=1"], "cluster.min_nodes=1 continues on fewer than cluster.nodes=2 "
                               "nodes at an in-job restart, and cluster.restarts is 0", "set cluster.restarts"),
    "elastic_backend": (["cluster.min_nodes=1", "cluster.restarts=2", "backend.kind=deepspeed",
                         "parallel.tensor_size=1", "parallel.pipeline_size=1"],
                        "cluster.min_nodes=1 backend.kind=deepspeed cannot continue on fewer nodes: its ZeRO "
                        "checkpoints", "or use backend.kind megatron or fsdp or horovod"),
    "launcher_backend": (["cluster.launcher=ray"], "cluster.launcher=ray launches backend.kind=fsdp only "
                         "(PyTorch-native: FSDP2, HSDP, DDP), not backend.kind=megatron",
                         "use cluster.launcher: srun, or backend.kind: fsdp"),
    "launcher_container": (["backend.kind=fsdp", "cluster.launcher=ray", "cluster.setup.container.kind=pyxis",
                            "cluster.setup.container.image=img.sqsh"],
                           "cluster.setup.container.kind=pyxis is not started around the Ray nodes",
                           "or use cluster.launcher: srun"),
    "switch_wait_needs_switches": (["cluster.switch_wait_min=30"], "cluster.switch_wait_min=30 is the wait for "
                                   "cluster.switches, which is not set", "set cluster.switches"),
    "profiler_ranks_exist": (["profiling.torch_profiler.enabled=true", "profiling.torch_profiler.ranks=[0, 8]"],
                             "profiling.torch_profiler.ranks=[8] are not ranks of a 8-rank job", "use ranks in 0..7"),
    "trace_ranks_exist": (["profiling.trace_ranks=[0, 8]"],
                          "profiling.trace_ranks=[8] must be ranks of a 8-rank job", "use ranks in 0..7, or auto"),
    # wandb is installed here (environment/requirements-test.txt): the case hides it (HIDDEN_PACKAGES)
    "trackers_installed": (["tracking.wandb.mode=offline"], "tracking.wandb.enabled=true needs the 'wandb' package",
                           "pip install wandb"),
    "liger_needs_llama": (["backend.kind=deepspeed", "parallel.tensor_size=1", "parallel.pipeline_size=1",
                           "backend.deepspeed.liger=true"],
                          "backend.deepspeed.liger=true patches Llama models only, not model.family=gpt",
                          "use family: llama, or backend.deepspeed.liger=false"),
    "fsdp_mesh": (["backend.kind=fsdp", "parallel.tensor_size=1", "parallel.pipeline_size=1",
                   "backend.fsdp.strategy=hybrid_shard", "backend.fsdp.shard_size=3"],
                  "backend.fsdp.shard_size=3 must divide the 8 ranks into 2 or more replica groups",
                  "set backend.fsdp.shard_size to one of 1, 2, 4"),
    "horovod_precision": (["backend.kind=horovod", "parallel.tensor_size=1", "parallel.pipeline_size=1",
                           "training.precision=fp16"],
                          "training.precision=fp16 is not available with backend.kind=horovod (no loss scaler)",
                          "use bf16 (autocast, as DDP) or fp32"),
    "experts_divisible_by_expert_size": (["model.num_experts=6", "parallel.expert_size=4",
                                          "parallel.sequence_parallel=true"],
                                         "parallel.expert_size=4 must divide model.num_experts=6", "try 1, 2, 3, 6"),
    "expert_layout_fits": (["model.num_experts=8", "parallel.expert_size=8", "parallel.sequence_parallel=true"],
                           "parallel.expert_size=8 x parallel.expert_tensor_size=1 must divide tensor x context x "
                           "data = world / pipeline = 4", "try 1, 2, 4"),
    "expert_parallel_needs_experts": (["parallel.expert_size=2"],
                                      "parallel.expert_size=2 needs a model with experts", "set model.num_experts"),
    "moe_routing": (["model.num_experts=4", "model.moe_router_topk=5", "parallel.sequence_parallel=true"],
                    "model.moe_router_topk=5 exceeds model.num_experts=4", "use 1..4"),
    "moe_sequence_parallel": (["model.num_experts=4"], "parallel.sequence_parallel=false must be true for a model "
                              "with experts and parallel.tensor_size=2", "set sequence_parallel: true"),
    "context_parallel_sequence": (["parallel.context_size=2", "parallel.tensor_size=1", "model.seq_length=30"],
                                  "model.seq_length=30 must be divisible by 2 x parallel.context_size = 4",
                                  "use a multiple of 4, e.g. 32"),
    "context_parallel_needs_te": (["parallel.context_size=2", "parallel.tensor_size=1", "cluster.gpu_type=cpu"],
                                  "parallel.context_size=2 needs Transformer Engine attention",
                                  "set context_size: 1 on CPU ranks"),
    "multi_latent_attention_needs_te": (["model.multi_latent_attention=true", "model.position_embedding=rope",
                                         "backend.megatron.transformer_impl=local",
                                         "backend.megatron.use_flash_attention=false"],
                                        "model.multi_latent_attention=true needs Transformer Engine layers on GPUs",
                                        "set transformer_impl: auto or transformer_engine"),
    "attention_environment": (["cluster.setup.env.NVTE_FLASH_ATTN='0'"],
                              "cluster.setup.env.NVTE_FLASH_ATTN=0 makes Megatron-core's attention check assert",
                              "remove NVTE_FLASH_ATTN from cluster.setup.env"),
    "fp8_supported": (["training.fp8=hybrid", "cluster.gpu_type=A100-80GB"],
                      "training.fp8=hybrid needs FP8 tensor cores, which cluster.gpu_type=A100-80GB lacks",
                      "set training.fp8: null"),
    "multi_latent_attention_shape": (["model.multi_latent_attention=true"],
                                     "model.position_embedding=learned_absolute must be rope with "
                                     "model.multi_latent_attention", "set position_embedding: rope"),
    "recompute_modules_apply": (["training.recompute_modules=[mlp]"],
                                "training.recompute_modules=[mlp] is read only with "
                                "training.recompute_granularity=selective, not none",
                                "set recompute_granularity: selective"),
    "moe_comm_overlap": (["model.num_experts=4", "parallel.tensor_size=1", "parallel.expert_size=2",
                          "parallel.overlap_moe_expert_parallel_comm=true"],
                         "parallel.overlap_moe_expert_parallel_comm=true needs parallel.virtual_pipeline_size > 1 "
                         "with pipeline_size=2", "set virtual_pipeline_size"),
    "fp8_recipe_without_fp8": (["training.fp8=null", "training.fp8_recipe=tensorwise"],
                               "training.fp8_recipe=tensorwise is read only with training.fp8, which is null here",
                               "set training.fp8: e4m3 or hybrid, or remove fp8_recipe"),
    "other_backend_options": (["backend.kind=horovod", "parallel.tensor_size=1", "parallel.pipeline_size=1",
                               "backend.deepspeed.zero_stage=3"],
                              "backend.deepspeed.zero_stage=3 is an option of backend.kind=deepspeed, and this recipe "
                              "trains with backend.kind=horovod", "remove backend.deepspeed.zero_stage, or set "
                              "backend.kind: deepspeed"),
    "backend_features": (["backend.kind=deepspeed", "checkpoint.init_from_hf=hf"],
                              "checkpoint.init_from_hf=hf is read by backend.kind=megatron or fsdp or horovod only",
                              "set backend.deepspeed.pretrained_path"),
}


def violations(overrides):
    try:
        resolve(BASE, overrides)
    except RecipeError as exc:
        return [str(v) for v in exc.violations]
    return []


def test_base_recipe_is_valid():
    assert violations([]) == []


def test_every_rule_has_a_case():
    assert {r.name for r in RULES} == set(CASES), "add a case to CASES for each new rule"


# rule name -> packages the case needs missing, as on a machine without them
HIDDEN_PACKAGES = {"trackers_installed": ("wandb",)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_message_names_field_value_and_fix(name, monkeypatch):
    import importlib.util

    hidden, real = HIDDEN_PACKAGES.get(name, ()), importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda pkg, *a: None if pkg in hidden else real(pkg, *a))
    overrides, start, fix = CASES[name]
    found = violations(overrides)
    matching = [m for m in found if m.startswith(start)]
    assert matching, f"no violation starting with {start!r} in {found}"
    assert fix in matching[0] and "\n" not in matching[0]


def test_all_violations_are_reported_at_once():
    found = violations(["parallel.tensor_size=3", "training.min_lr=1", "training.lr=0.5"])
    assert len(found) >= 2
    # tensor_size=3 breaks the world size and the heads: one line, fixed by what both admit (8 ranks, 8 heads, PP2)
    assert [m for m in found if m.startswith("parallel.tensor_size=3")] == [
        "parallel.tensor_size=3 x parallel.pipeline_size=2 must divide the world size cluster.nodes x "
        "cluster.gpus_per_node = 8 and must divide model.num_attention_heads=8 (try 1, 2, 4)"]
    assert any(m.startswith("training.min_lr=1") for m in found)
