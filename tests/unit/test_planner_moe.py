"""The planner in five dimensions: published parameter counts (Mixtral 8x7B, DeepSeek-V3), experts sharded by EP/ETP
with their optimizer states over the expert-data-parallel group, routed-token activations, CP dividing activations,
the all-to-all, CP exchange and FP8 terms of the step time, and the search over EP, ETP and CP."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hpc_tools.planner import plan_recipe, search
from hpc_tools.planner.arch import arch_for, pieces, stage_split, total_parameters
from hpc_tools.planner.hardware import hardware_for
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.memory import (
    MOE_DISPATCHED,
    MOE_EXPERTS,
    OPTIMIZER,
    PARAMETERS,
    estimate_memory,
    layer_bytes,
    moe_mlp_terms,
)
from hpc_tools.planner.steptime import COMPUTE, CP_COMM, EP_COMM, FP8_EFFICIENCY_RATIO, estimate_step_time, step_flops
from profiling.flops import active_parameters, hardware_flops_parts, hardware_flops_per_step, num_parameters
from tests.helpers import REPO, run_cli
from tests.unit.inline_recipes import inline_recipe


def plan(name, *overrides):
    return plan_recipe(inline_recipe(name, *overrides, check=False), use_calibration=False)


def test_mixtral_8x7b_counts_exactly_as_published():
    """46.7 B total, 12.9 B active (two of eight experts; the input embedding counted, as Mistral does)."""
    p = plan("mixtral_8x7b")
    # 32 x (attention 41,943,040 + 8 experts x 176,160,768 + router 32,768 + norms 8,192) + 2 x 131,072,000 + 4,096
    assert p.parameters == 46_702_792_704 and round(p.parameters / 1e9, 1) == 46.7
    assert p.parameters_active == 12_879_925_248 and round(p.parameters_active / 1e9, 1) == 12.9
    assert p.parameters_active_without_input_embedding == 12_879_925_248 - 32000 * 4096


def test_deepseek_v3_counts_exactly_as_published():
    """671 B total, 37 B active, 36.6 B active without the input embedding (multi-token prediction excluded)."""
    p = plan("deepseek_v3")
    assert p.parameters == 671_026_404_352 and round(p.parameters / 1e9) == 671
    assert p.parameters_active == 37_552_282_624 and int(p.parameters_active / 1e9) == 37
    assert p.parameters_active_without_input_embedding == 36_625_603_584
    assert round(p.parameters_active_without_input_embedding / 1e9, 1) == 36.6


@pytest.mark.parametrize("name, tensor, ep, etp, pp", [
    ("mixtral_8x7b", 1, 8, 1, 1), ("mixtral_8x7b", 2, 4, 2, 1), ("mixtral_8x7b", 1, 2, 1, 4),
    ("deepseek_v3", 1, 64, 1, 1), ("deepseek_v3", 2, 8, 2, 1), ("deepseek_v3", 1, 256, 1, 61)])
def test_pieces_split_the_same_count_across_tp_ep_etp_pp(name, tensor, ep, etp, pp):
    """The planner's per-GPU pieces add up to profiling.flops' count: every stage's dense part x TP (replicated norms
    aside) and expert part x EP x ETP."""
    r = inline_recipe(name, check=False)
    arch = arch_for(r)
    assert total_parameters(arch) == num_parameters(r.model, vocab_size=arch.padded_vocab(1))
    # DeepSeek-V3 on 61 stages: the first three hold a dense layer, the rest an MoE layer each
    experts = sum(stage_split(arch, tensor, pp, s, ep * etp)[1] for s in range(pp))
    assert experts * ep * etp == arch.moe_layers * pieces(arch, 1).experts


def test_dense_counts_are_unchanged_and_active_equals_total():
    r = inline_recipe("gpt_3d")
    assert active_parameters(r.model) == num_parameters(r.model)
    assert plan("gpt_3d").parameters_active == plan("gpt_3d").parameters


def test_expert_states_shard_over_ep_and_the_expert_data_parallel_group():
    r = inline_recipe("mixtral_8x7b", check=False)
    arch, k = arch_for(r), Knobs.from_recipe(r)
    lay = k.layout
    assert (lay.pipeline_size, lay.expert_size, lay.expert_tensor_size, lay.expert_data_size) == (4, 8, 1, 1)
    dense, expert = stage_split(arch, 1, 4, 0, 8)
    mem = estimate_memory(arch, k).stages[0]
    # 16-bit params of both; the optimizer's 12 bytes of dense params over DP = 8, of expert params over EDP = 1
    assert mem.terms[PARAMETERS] == 2 * (dense + expert)
    assert mem.terms[OPTIMIZER] == pytest.approx(12 * dense / 8 + 12 * expert / 1)
    # EP 8 -> 4 on the same 32 GPUs: twice the experts per GPU, EDP 2 shards their optimizer states
    k4 = replace(k, layout=replace(lay, expert_size=4))
    assert k4.layout.expert_data_size == 2
    _, expert4 = stage_split(arch, 1, 4, 0, 4)
    assert expert4 == 2 * expert
    assert estimate_memory(arch, k4).stages[0].terms[OPTIMIZER] == pytest.approx(12 * dense / 8 + 12 * expert4 / 2)


def test_routed_activations_scale_with_top_k():
    r = inline_recipe("mixtral_8x7b", check=False)
    k = Knobs.from_recipe(r)
    one, two = (moe_mlp_terms(replace(arch_for(r), topk=n), k, 4096) for n in (1, 2))
    assert two[MOE_DISPATCHED] == 2 * one[MOE_DISPATCHED] and two[MOE_EXPERTS] == 2 * one[MOE_EXPERTS]
    # b s tokens x top-2 x moe_ffn x 5 (SwiGLU: fc1's 2f, silu, Megatron's offset copy, product), 16-bit
    assert two[MOE_EXPERTS] == 2 * 4096 * 2 * 14336 * 5


def test_context_parallelism_divides_the_activations():
    """Every per-token term is over s / CP tokens (fused attention: no s^2 terms), so CP2 halves a layer exactly."""
    r = inline_recipe("llama_long", check=False)
    arch, k = arch_for(r), Knobs.from_recipe(r)
    cp = {c: layer_bytes(arch, replace(k, layout=replace(k.layout, context_size=c)), "selective") for c in (1, 2, 4)}
    assert cp[1] == pytest.approx(2 * cp[2]) and cp[1] == pytest.approx(4 * cp[4])
    assert k.layout.dense_grad_size == 8  # the distributed optimizer shards over DP x CP


def _time(r, k, hw=None):
    hw = hw or hardware_for(r.cluster, r.training.precision, fp8=k.fp8 is not None)
    return estimate_step_time(arch_for(r), k, hw, step_flops(r.model, k, "megatron"), 0.5)


def test_all_to_all_inside_a_node_is_faster_than_across_nodes():
    r = inline_recipe("mixtral_8x7b", check=False)
    k = Knobs.from_recipe(r)
    inside = _time(r, k).terms[EP_COMM]
    across = _time(r, k, hardware_for(r.cluster.model_copy(update={"gpus_per_node": 4}))).terms[EP_COMM]
    hw = hardware_for(r.cluster)
    assert inside > 0 and across == pytest.approx(inside * hw.intra_node_bw / hw.inter_node_bw)
    # 4 all-to-alls per MoE layer and microbatch (6 with full recompute), b s h x top-k 16-bit, 7/8 of it leaving
    per = 2 * 4096 * 2 * 4096 * 7 / 8 / hw.intra_node_bw
    assert inside == pytest.approx(6 * per * (32 // 4) * (256 // 8))  # 8 MoE layers a stage, 32 microbatches
    assert _time(r, replace(k, layout=replace(k.layout, expert_size=1))).terms[EP_COMM] == 0.0


def test_context_parallel_exchange_is_a_term_only_with_cp():
    r = inline_recipe("llama_long", check=False)
    k = Knobs.from_recipe(r)
    assert _time(r, k).terms[CP_COMM] > 0
    assert CP_COMM not in _time(r, replace(k, layout=replace(k.layout, context_size=1, data_size=8))).terms


def test_fp8_runs_gemms_at_the_fp8_peak_and_names_both_mfus():
    r = inline_recipe("llama_long", check=False)
    k = Knobs.from_recipe(r)
    bf16 = _time(r, k)
    k8 = replace(k, fp8="hybrid")
    fp8 = _time(r, k8)
    hw = hardware_for(r.cluster, "bf16", fp8=True)
    gemm, rest = hardware_flops_parts(r.model, 32, "selective", vocab_size=r.model.padded_vocab_size(2))
    assert gemm + rest == pytest.approx(hardware_flops_per_step(r.model, 32, "selective",
                                                                vocab_size=r.model.padded_vocab_size(2)))
    assert fp8.terms[COMPUTE] == pytest.approx((gemm / (hw.peak_flops_fp8 * 0.5 * FP8_EFFICIENCY_RATIO)
                                                + rest / (hw.peak_flops * 0.5)) / 16)
    speedup = bf16.terms[COMPUTE] / fp8.terms[COMPUTE]
    assert 1.2 < speedup < 1.5  # published: FP8 speeds dense training up 1.2-1.5x
    assert bf16.mfu_fp8 is None and fp8.mfu_fp8 == pytest.approx(fp8.mfu * hw.peak_flops / hw.peak_flops_fp8)


def test_search_covers_ep_etp_and_keeps_the_headroom():
    r = inline_recipe("mixtral_8x7b", check=False)
    result = search(r, top=5, losers=30, use_calibration=False)
    assert result.best is not None and result.usable_bytes < result.mem_bytes
    assert all(c.memory_bytes <= result.usable_bytes for c in result.ranked)
    eps = {c.knobs.layout.expert_size for c in result.ranked}
    assert len(eps) > 1, eps
    best = result.best.knobs
    assert any(o.startswith("parallel.expert_size=") for o in best.overrides()) or best.layout.expert_size == 1
    # the best applied to the recipe keeps every rule
    from hpc_tools.planner.knobs import apply_knobs
    from hpc_tools.recipe.rules import check_recipe

    assert check_recipe(apply_knobs(r, best)) == []


def test_search_covers_context_parallelism_for_long_sequences():
    r = inline_recipe("llama_long", check=False)
    result = search(r, top=5, losers=20, use_calibration=False)
    assert {c.knobs.layout.context_size for c in result.ranked} - {1}
    short = search(inline_recipe("gpt_3d"), top=3, losers=0, use_calibration=False)
    assert {c.knobs.layout.context_size for c in short.ranked} == {1}  # 2k tokens: no CP tried


def test_plan_json_reports_total_and_active_parameters_and_says_what_active_counts():
    out = run_cli("plan", str(REPO / "recipes/gpt_moe.yaml"), "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["parameters"] == 46_702_792_704 and data["parameters_active"] == 12_879_925_248
    assert "input embedding" in data["parameters_active_counts"]
    assert data["step_time"]["mfu_peak"].startswith("bf16") and data["step_time"]["mfu_fp8"] is None
    text = run_cli("plan", str(REPO / "recipes/gpt_moe.yaml")).stdout
    assert "12.88 B active per token, counting the input embedding" in text
    fp8 = json.loads(run_cli("plan", str(REPO / "recipes/llama_long_context.yaml"), "--json").stdout)
    step = fp8["step_time"]
    assert step["mfu_fp8_peak"].startswith("FP8") and 0 < step["mfu_fp8"] < step["mfu"]


def test_a_middle_stage_with_more_moe_layers_is_planned_too():
    """Dense layers first (DeepSeek-V3's moe_layer_freq list): the first stage holds fewer experts than the middle
    ones, so the peak may sit in the middle; the plan takes that stage too."""
    from hpc_tools.planner.arch import busiest_moe_stage, stage_layer_counts

    r = inline_recipe("mixtral_8x7b", "model.moe_layer_freq=" + str([0] * 6 + [1] * 26), "parallel.pipeline_size=4",
                      check=False)
    arch, k = arch_for(r), Knobs.from_recipe(r)
    assert [stage_layer_counts(arch, 4, s)[1] for s in range(4)] == [2, 8, 8, 8]
    assert busiest_moe_stage(arch, 4) == 1
    mem = estimate_memory(arch, k)
    assert [s.stage for s in mem.stages] == [0, 1, 3]
    assert mem.peak.total == max(s.total for s in mem.stages)
    # 8 MoE layers against the first stage's 2: more memory than the first stage, which "middle stages hold less
    # than the first" would have assumed
    assert mem.stages[1].total > mem.stages[0].total
    assert busiest_moe_stage(arch_for(inline_recipe("mixtral_8x7b", check=False)), 4) is None  # all MoE: even
