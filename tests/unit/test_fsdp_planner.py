"""backend.kind: fsdp in the control plane: its rules, the planner's FSDP2 / HSDP / DDP memory and step-time
model (sharding="fsdp" in the backend table, no kind compared) and the search over the strategies."""

from __future__ import annotations

import pytest

from hpc_tools.errors import RecipeError
from hpc_tools.planner import plan_recipe, search
from hpc_tools.planner.arch import arch_for, total_parameters
from hpc_tools.planner.knobs import Knobs, apply_knobs
from hpc_tools.planner.memory import GRADIENTS, OPTIMIZER, PARAMETERS, estimate_memory
from hpc_tools.planner.sharding import UNSHARDED, shard_group
from hpc_tools.planner.steptime import DP_COMM
from hpc_tools.recipe.load import resolve
from hpc_tools.recipe.rules import check_recipe

LLAMA_8B = {"family": "llama", "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_query_groups": 8, "ffn_hidden_size": 14336, "seq_length": 8192, "vocab_size": 128256}
BASE = {"name": "f", "model": LLAMA_8B,
        "training": {"micro_batch_size": 1, "global_batch_size": 64, "precision": "bf16",
                     "recompute_granularity": "full"},
        "backend": {"kind": "fsdp"},
        "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "H100-SXM"}}


def recipe(*overrides: str, check: bool = True):
    return resolve(BASE, list(overrides)) if check else resolve(BASE, list(overrides), check=False)


def errors(*overrides: str) -> list[str]:
    try:
        recipe(*overrides)
    except RecipeError as exc:
        return [str(v) for v in exc.violations]
    return []


def test_rules_name_the_field_and_the_fix():
    assert errors() == [] and errors("backend.fsdp.strategy=hybrid_shard") == []  # 2 nodes: 2 replicas of 8
    one_node = errors("backend.fsdp.strategy=hybrid_shard", "cluster.nodes=1")
    assert one_node and one_node[0].startswith("cluster.gpus_per_node (the default shard_size)=8 must divide the 8 "
                                               "ranks into 2 or more replica groups") and "shard_size" in one_node[0]
    assert errors("backend.fsdp.strategy=hybrid_shard", "cluster.nodes=1", "backend.fsdp.shard_size=4") == []
    assert any(e.startswith("parallel.pipeline_size=2 must be 1 with backend.kind=fsdp")
               for e in errors("parallel.pipeline_size=2"))
    # FSDP x TP: full_shard, a Llama, TP dividing the heads, the query groups and the GPUs of a node; no SP
    assert errors("parallel.tensor_size=2") == [] and errors("parallel.tensor_size=8") == []
    assert any(e.startswith("parallel.tensor_size=16 must divide model.num_query_groups=8")
               for e in errors("parallel.tensor_size=16"))
    assert any(e.startswith("parallel.tensor_size=4 must divide cluster.gpus_per_node=6 (tensor parallelism stays "
                            "inside a node)") for e in errors("parallel.tensor_size=4", "cluster.gpus_per_node=6",
                                                              "training.global_batch_size=48"))
    assert any(e.startswith("backend.fsdp.strategy=ddp cannot be combined with tensor parallelism")
               and "full_shard" in e for e in errors("parallel.tensor_size=2", "backend.fsdp.strategy=ddp"))
    assert any(e.startswith("model.family=gpt has no tensor-parallel plan with backend.kind=fsdp")
               for e in errors("parallel.tensor_size=2", "model.family=gpt", "model.num_query_groups=null",
                               "model.normalization=LayerNorm", "model.activation=gelu",
                               "model.position_embedding=learned_absolute"))
    assert any(e.startswith("parallel.sequence_parallel=true is not available with backend.kind=fsdp")
               and "backend.kind: megatron" in e
               for e in errors("parallel.tensor_size=2", "parallel.sequence_parallel=true"))
    assert any(e.startswith("backend.fsdp.shard_size=4 is read by strategy hybrid_shard only")
               for e in errors("backend.fsdp.shard_size=4"))
    assert any(e.startswith("training.precision=fp16 is not available with backend.kind=fsdp")
               for e in errors("training.precision=fp16"))
    assert errors("checkpoint.async_save=true") == []
    assert any(e.startswith("checkpoint.async_save=true is not available with backend.kind=deepspeed (DeepSpeed")
               and "backend.kind: megatron or fsdp" in e
               for e in errors("checkpoint.async_save=true", "backend.kind=deepspeed"))
    assert any(e.startswith("model.hidden_dropout=0.1 is not available for model.family=llama with backend.kind=fsdp")
               for e in errors("model.hidden_dropout=0.1"))


@pytest.mark.parametrize("strategy,shard", [("full_shard", 16), ("hybrid_shard", 8), ("ddp", 1)])
def test_model_states_are_16_bytes_per_param_over_the_shard_group(strategy, shard):
    r = recipe(f"backend.fsdp.strategy={strategy}", check=False)
    k = Knobs.from_recipe(r)
    assert shard_group(k) == shard
    n = total_parameters(arch_for(r))
    terms = estimate_memory(arch_for(r), k).peak.terms
    assert terms[PARAMETERS] + terms[GRADIENTS] + terms[OPTIMIZER] == pytest.approx(16 * n / shard)


def test_unsharded_working_set_follows_reshard_after_forward():
    arch = arch_for(recipe())
    resharded = estimate_memory(arch, Knobs.from_recipe(recipe())).peak.terms[UNSHARDED]
    kept = estimate_memory(arch, Knobs.from_recipe(recipe("backend.fsdp.reshard_after_forward=false"))).peak
    from hpc_tools.planner.arch import pieces

    # every one of the 32 blocks' bf16 parameters kept from forward to backward, not two
    assert kept.terms[UNSHARDED] - resharded == pytest.approx(2 * 30 * pieces(arch, 1).layer)


def test_hsdp_moves_the_gathers_off_the_network():
    """2 nodes: full_shard all-gathers across the network every block; HSDP inside the node (NVLink) plus one
    all-reduce of a 1/8 gradient shard across nodes."""
    full = plan_recipe(recipe(), use_calibration=False).time.terms[DP_COMM]
    hybrid = plan_recipe(recipe("backend.fsdp.strategy=hybrid_shard"), use_calibration=False).time.terms[DP_COMM]
    assert hybrid < full
    no_reshard = plan_recipe(recipe("backend.fsdp.reshard_after_forward=false"), use_calibration=False)
    assert no_reshard.time.terms[DP_COMM] <= full


def test_ddp_of_8b_does_not_fit_an_h100():
    plan = plan_recipe(recipe("backend.fsdp.strategy=ddp"), use_calibration=False)
    assert plan.fits is False and plan.memory.total > 16 * 8e9


def test_search_covers_the_strategies_and_its_choice_applies():
    r = recipe("model.num_layers=8", "model.hidden_size=1024", "model.num_attention_heads=8",
               "model.num_query_groups=8", "model.ffn_hidden_size=2816", "model.seq_length=2048")
    res = search(r, top=20, losers=400, use_calibration=False)
    seen = {c.knobs.sharding.strategy for c in res.ranked}
    assert seen == {"full_shard", "hybrid_shard", "ddp"}, seen
    assert all(c.knobs.layout.pipeline_size == 1 for c in res.ranked)
    tp = [c.knobs for c in res.ranked if c.knobs.layout.tensor_size > 1]  # FSDP x TP: full_shard inside a node, no SP
    assert tp and {k.layout.tensor_size for k in tp} <= {2, 4, 8}
    assert all(k.sharding.strategy == "full_shard" and not k.layout.sequence_parallel for k in tp)
    best = res.best.knobs
    applied = resolve(BASE | {"model": r.model.model_dump()}, best.overrides())
    assert check_recipe(applied) == [] and apply_knobs(r, best).backend.fsdp == applied.backend.fsdp
    assert Knobs.from_recipe(applied).describe() == best.describe()


def test_fsdp_tensor_parallel_splits_the_blocks_only():
    """FSDP x TP: per rank the blocks' parameters / t and the root's whole, then sharded over d = world / t ranks; the
    unsharded working set holds a block's TP share."""
    from hpc_tools.planner.arch import fsdp_parameters, pieces

    r1, r2 = recipe(), recipe("parallel.tensor_size=2")
    arch = arch_for(r1)
    one, two = (estimate_memory(arch, Knobs.from_recipe(r)).peak.terms for r in (r1, r2))
    whole, half = pieces(arch, 1), pieces(arch, 2)
    assert fsdp_parameters(arch, 1) == total_parameters(arch)
    assert fsdp_parameters(arch, 1) - fsdp_parameters(arch, 2) == arch.layers * (whole.layer - half.layer)
    assert one[PARAMETERS] == pytest.approx(4 * fsdp_parameters(arch, 1) / 16)
    assert two[PARAMETERS] == pytest.approx(4 * fsdp_parameters(arch, 2) / 8)  # d = 8 under TP2
    assert one[UNSHARDED] - two[UNSHARDED] == pytest.approx((2 * 2 + 4 + 2) * (whole.layer - half.layer))
