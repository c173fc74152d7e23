"""Recipe -> Megatron-core configuration, the learning-rate schedule and the resharding rule (no processes)."""

from __future__ import annotations

import math

import pytest

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.load import load_recipe
from hpc_tools.train.schedule import lr_at
from tests.helpers import REPO

pytestmark = pytest.mark.megatron


def recipe(*sets: str, name: str = "gpt_3d.yaml", profile: str | None = None):
    return load_recipe(REPO / "recipes" / name, overrides=list(sets), profile=profile)


def test_lr_warmup_then_cosine_to_min():
    t = recipe("training.train_iters=100", "training.lr_warmup_iters=10", "training.lr=1.0",
               "training.min_lr=0.1").training
    assert lr_at(t, 1) == pytest.approx(0.1) and lr_at(t, 10) == pytest.approx(1.0)
    assert lr_at(t, 55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(t, 100) == pytest.approx(0.1) and lr_at(t, 150) == pytest.approx(0.1)
    values = [lr_at(t, s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:])), "cosine decay must not rise"


@pytest.mark.parametrize("style,mid", [("linear", 0.55), ("constant", 1.0)])
def test_lr_other_decays(style, mid):
    t = recipe("training.train_iters=100", "training.lr_warmup_iters=0", "training.lr=1.0", "training.min_lr=0.1",
               f"training.lr_decay_style={style}").training
    assert lr_at(t, 50) == pytest.approx(mid)


def test_transformer_config_carries_the_layout():
    from hpc_tools.train.megatron.config import transformer_config

    r = recipe()  # the 2 x 8 H100 recipe: TP2 x PP2 x VPP2, SP, selective recompute, bf16
    lay = ParallelLayout.from_recipe(r)
    c = transformer_config(r, lay, "cpu")
    assert (c.tensor_model_parallel_size, c.pipeline_model_parallel_size,
            c.virtual_pipeline_model_parallel_size) == (2, 2, 2)
    assert c.sequence_parallel and c.bf16 and not c.fp16 and c.recompute_granularity == "selective"
    assert c.batch_p2p_comm is False, "interleaved PP=2 must not batch p2p on gloo (silently wrong losses)"
    assert (c.num_layers, c.hidden_size, c.num_attention_heads) == (24, 2048, 16)
    assert not c.gated_linear_unit and c.normalization == "LayerNorm"


def test_transformer_config_llama_and_full_recompute():
    from hpc_tools.train.megatron.config import transformer_config

    r = recipe("backend.kind=megatron", "training.recompute_granularity=full", "training.recompute_num_layers=2",
               "training.recompute_method=block", name="gpt_zero.yaml", profile="local")
    c = transformer_config(r, ParallelLayout.from_recipe(r), "cpu")
    assert c.gated_linear_unit and c.normalization == "RMSNorm" and not c.add_bias_linear
    assert (c.num_query_groups, c.ffn_hidden_size) == (2, 176)
    assert (c.recompute_granularity, c.recompute_method, c.recompute_num_layers) == ("full", "block", 2)
    assert c.batch_p2p_comm is True


def test_vocab_padding_mismatch_is_a_one_line_user_error(tmp_path):
    from hpc_tools.errors import UserError
    from hpc_tools.train.megatron.checkpoint import check_vocab

    saved = {"tensor_size": 1, "padded_vocab_size": 50304}
    check_vocab(tmp_path, saved, {"tensor_size": 1, "padded_vocab_size": 50304}, 50257)
    with pytest.raises(UserError) as err:
        check_vocab(tmp_path, saved, {"tensor_size": 2, "padded_vocab_size": 50432}, 50257)
    message = str(err.value)
    assert "\n" not in message and "model.vocab_size=50257" in message and "multiple of 256" in message


def test_overlap_and_recompute_modules_reach_the_transformer_config():
    """parallel.overlap_moe_expert_parallel_comm, parallel.moe_shared_expert_overlap and training.recompute_modules
    reach Megatron-core's TransformerConfig, which accepts them (its own __post_init__ checks pass). The first is
    refused by the rules until the engine builds the combined 1F1B schedule plan (issue 46 item 1)."""
    from hpc_tools.recipe.rules import check_recipe
    from hpc_tools.train.megatron.config import transformer_config

    r = load_recipe(REPO / "recipes/gpt_moe.yaml", ["parallel.overlap_moe_expert_parallel_comm=true",
                    "training.recompute_granularity=selective", "training.recompute_modules=[core_attn,moe]"],
                    check=False)
    assert [v.path for v in check_recipe(r)] == ["parallel.overlap_moe_expert_parallel_comm"]
    c = transformer_config(r, ParallelLayout.from_recipe(r), "cpu")  # local layers: explicit attention, kept
    assert c.overlap_moe_expert_parallel_comm and not c.moe_shared_expert_overlap
    assert (c.recompute_granularity, c.recompute_modules) == ("selective", ["core_attn", "moe"])
    assert c.recompute_method is None and c.recompute_num_layers is None

    # the GPU config (Transformer Engine layers, built without CUDA): core_attn left out under fused attention
    from hpc_tools.train.megatron.layers import layer_plan

    r = recipe("training.recompute_granularity=selective", "training.recompute_modules=[core_attn,layernorm,moe_act]",
               "model.position_embedding=learned_absolute", name="gpt_moe.yaml")  # (no TE RoPE fusion on CPU)
    assert check_recipe(r) == []
    plan = layer_plan(r, "cuda", te_available=True)
    c = transformer_config(r, ParallelLayout.from_recipe(r), "cuda", plan)
    assert plan.flash_style and c.moe_grouped_gemm
    assert (c.recompute_granularity, c.recompute_modules) == ("selective", ["layernorm", "moe_act"])

    r = recipe("model.moe_shared_expert_intermediate_size=14336", "parallel.moe_shared_expert_overlap=true",
               "training.recompute_granularity=selective", "training.recompute_modules=[mlp]",
               "model.moe_layer_freq=2", name="gpt_moe.yaml")
    assert check_recipe(r) == []
    c = transformer_config(r, ParallelLayout.from_recipe(r), "cpu")
    assert c.moe_shared_expert_overlap and not c.overlap_moe_expert_parallel_comm
    assert c.recompute_modules == ["mlp"]

    r = recipe(name="gpt_moe.yaml")  # the defaults: neither overlap, no recomputation
    c = transformer_config(r, ParallelLayout.from_recipe(r), "cpu")
    assert not c.overlap_moe_expert_parallel_comm and not c.moe_shared_expert_overlap
    assert c.recompute_granularity is None
