"""Recipe -> Megatron-core configuration for experts, multi-latent attention, context parallelism and FP8, built on
CPU (no processes): the TransformerConfig carries every field, the layer specs are the MoE ones, refusals are one line.
"""

from __future__ import annotations

import contextlib

import pytest

from hpc_tools.errors import UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import resolve

pytestmark = pytest.mark.megatron

BASE = {
    "name": "moe_config",
    "model": {"family": "gpt", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
              "vocab_size": 512, "add_bias_linear": False, "num_experts": 8, "moe_router_topk": 2},
    "training": {"micro_batch_size": 1, "global_batch_size": 8, "train_iters": 2, "precision": "bf16"},
    "backend": {"kind": "megatron"},
    "data": {"source": "synthetic"},
    "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu_type": "H100-SXM"},
}


def recipe(*sets: str, cpu: bool = False):
    base = BASE if not cpu else {**BASE, "cluster": {**BASE["cluster"], "gpu_type": "cpu"}}
    return resolve(base, list(sets), source="test")


def config(r, device: str = "cuda", te: bool = True):
    from hpc_tools.train.megatron.config import transformer_config
    from hpc_tools.train.megatron.layers import layer_plan

    return transformer_config(r, ParallelLayout.from_recipe(r), device, layer_plan(r, device, te_available=te))


def test_moe_fields_reach_the_transformer_config():
    r = recipe("model.moe_ffn_hidden_size=96", "model.moe_shared_expert_intermediate_size=128",
               "model.moe_layer_freq=[0,1,1,1]", "model.moe_router_load_balancing_type=seq_aux_loss",
               "model.moe_aux_loss_coeff=0.001", "model.moe_router_score_function=sigmoid",
               "model.moe_router_enable_expert_bias=true", "model.moe_expert_capacity_factor=1.25",
               "parallel.expert_size=4", "parallel.expert_tensor_size=1")
    c = config(r)
    assert (c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size) == (8, 2, 96)
    assert c.moe_shared_expert_intermediate_size == 128 and c.moe_layer_freq == [0, 1, 1, 1]
    assert c.moe_router_load_balancing_type == "seq_aux_loss" and c.moe_aux_loss_coeff == 0.001
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_expert_capacity_factor == 1.25 and c.moe_token_dispatcher_type == "alltoall"
    assert c.expert_model_parallel_size == 4 and c.expert_tensor_parallel_size == 1
    assert c.moe_grouped_gemm  # null = on with Transformer Engine layers
    assert c.moe_router_dtype == "fp32"


def test_dropless_by_default_and_ffn_size_defaults_to_the_dense_one():
    c = config(recipe())
    assert c.moe_expert_capacity_factor is None and c.moe_ffn_hidden_size == c.ffn_hidden_size
    assert c.context_parallel_size == 1 and c.fp8 is None


def test_grouped_gemm_only_with_transformer_engine():
    assert not config(recipe(cpu=True), "cpu").moe_grouped_gemm  # SequentialMLP on the local layers
    assert not config(recipe("backend.megatron.use_flash_attention=false"), "cuda", te=False).moe_grouped_gemm
    with pytest.raises(UserError, match=r"model.moe_grouped_gemm=true needs Transformer Engine.*\(set "):
        config(recipe("model.moe_grouped_gemm=true", cpu=True), "cpu")
    assert not config(recipe("model.moe_grouped_gemm=false")).moe_grouped_gemm


def test_moe_fusions_on_with_transformer_engine_only(monkeypatch):
    """TE's fused token permutation and fused routing: on with TE layers (TE 2.11 here, without importing it), off
    on the local layers (CPU, or a GPU without TE) and where the TE is older than megatron-core binds them for."""
    import dataclasses

    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig

    from hpc_tools.train.megatron import config as mc

    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert {"moe_permute_fusion", "moe_router_fusion"} <= names
    monkeypatch.setattr(mc, "te_version", lambda: "2.11.0")
    # megatron-core checks at build that TE's permutation kernels are bound (they are not without TE): stand-ins
    for name in ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                 "fused_sort_chunks_by_index_with_probs", "fused_unpermute"):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)
    c = config(recipe())
    assert c.moe_permute_fusion and c.moe_router_fusion
    assert not config(recipe(cpu=True), "cpu").moe_permute_fusion
    local = config(recipe("backend.megatron.use_flash_attention=false"), "cuda", te=False)
    assert not local.moe_permute_fusion and not local.moe_router_fusion
    te_plan = mc.layer_plan(recipe(), "cuda", te_available=True)
    assert mc.moe_fusions(te_plan, "2.6.0") == {"moe_permute_fusion": True, "moe_router_fusion": False}
    assert mc.moe_fusions(te_plan, "2.0.1") == {"moe_permute_fusion": False, "moe_router_fusion": False}
    assert mc.moe_fusions(te_plan, "2.7.0.dev0+5b3092a") == {"moe_permute_fusion": True, "moe_router_fusion": True}


def test_a_dense_recipe_gets_no_moe_fields():
    from hpc_tools.train.megatron.config import moe_options

    r = resolve({**BASE, "model": {k: v for k, v in BASE["model"].items() if k not in ("num_experts",
                                                                                        "moe_router_topk")}},
                [], source="test")
    c = config(r)
    assert c.num_moe_experts is None and c.expert_model_parallel_size == 1
    assert moe_options(r, ParallelLayout.from_recipe(r), None) == {}


def test_context_parallelism_goes_to_te_attention_as_a_ring():
    c = config(recipe("parallel.context_size=2"))
    assert c.context_parallel_size == 2 and c.cp_comm_type == "p2p"


@pytest.mark.parametrize("sets, what", [(["parallel.context_size=2"], "parallel.context_size=2 needs Transformer"),
                                        (["training.fp8=e4m3"], "training.fp8=e4m3 needs Transformer Engine")])
def test_cp_and_fp8_without_transformer_engine_are_refused_in_one_line(sets, what):
    """The local layers a GPU node without TE builds (auto, no flash attention; CP with use_flash_attention: false is
    refused earlier, at validate: issue 31 item 1) refuse CP and FP8 at start."""
    from hpc_tools.train.megatron.config import transformer_config
    from hpc_tools.train.megatron.layers import LayerPlan

    r = recipe(*sets)
    with pytest.raises(UserError, match=what) as err:
        transformer_config(r, ParallelLayout.from_recipe(r), "cuda", LayerPlan("local", "local"))
    assert "\n" not in str(err.value) and "(run on" in str(err.value)


@pytest.mark.parametrize("fmt, scaling", [("e4m3", "delayed"), ("hybrid", "tensorwise"), ("e4m3", "mxfp8"),
                                          ("hybrid", "blockwise")])
def test_fp8_format_and_recipe_reach_the_transformer_config(fmt, scaling, monkeypatch):
    # TransformerConfig asks Transformer Engine's version for FP8 with experts (>= 1.7); the GPU extra pins TE 2.9+,
    # which this CPU machine lacks: answer as that TE would.
    from megatron.core.transformer import transformer_config

    monkeypatch.setattr(transformer_config, "is_te_min_version", lambda *a, **k: True)
    gpu = ["cluster.gpu_type=B200"] if scaling == "mxfp8" else []  # MXFP8: Blackwell (a recipe rule)
    c = config(recipe(f"training.fp8={fmt}", f"training.fp8_recipe={scaling}", *gpu))
    assert c.fp8 == fmt and c.fp8_recipe == scaling


def test_multi_latent_attention_builds_an_mla_config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    c = config(recipe("model.family=llama", "model.multi_latent_attention=true", "model.q_lora_rank=32",
                      "model.kv_lora_rank=16", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8",
                      "model.v_head_dim=16"))
    assert isinstance(c, MLATransformerConfig) and c.multi_latent_attention
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (32, 16, 16, 8, 16)
    assert c.rope_type == "rope"


@contextlib.contextmanager
def one_rank_parallel_state():
    """Megatron's parallel state on a 1-rank gloo world (the block spec asks the pipeline group), torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from hpc_tools.runtime.distenv import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ps.initialize_model_parallel()
        yield
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_moe_layer_freq_places_moe_and_dense_layers_in_the_local_block_spec():
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from hpc_tools.train.megatron.model import SequenceParallelNorm, block_spec

    r = recipe("model.moe_layer_freq=[1,0,1,0]", cpu=True)
    with one_rank_parallel_state():
        spec = block_spec(r, config(r, "cpu"), "cpu", None)
    mlps = [layer.submodules.mlp.module for layer in spec.layer_specs]
    assert mlps == [MoELayer, MLP, MoELayer, MLP]
    assert all(layer.submodules.input_layernorm is SequenceParallelNorm for layer in spec.layer_specs)
