"""Step-time model: each term against the formula it claims (docs/formulas.md), and the derived tokens/s and MFU.

The numbers below are those of the test's own recipes (tests/unit/inline_recipes.py), not of recipes/*.yaml.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpc_tools.planner.arch import arch_for, stage_parameters
from hpc_tools.planner.hardware import hardware_for
from hpc_tools.planner.knobs import Knobs
from hpc_tools.planner.pipeline_schedule import bubble_fraction
from hpc_tools.planner.steptime import (
    BUBBLE,
    COMPUTE,
    DP_COMM,
    OFFLOAD,
    PP_COMM,
    TP_COMM,
    estimate_step_time,
    step_flops,
)
from hpc_tools.recipe.load import load_recipe
from profiling.flops import hardware_flops_per_step, model_flops_per_step
from tests.helpers import REPO
from tests.unit.inline_recipes import inline_recipe


@pytest.fixture(scope="module")
def gpt3d():
    r = inline_recipe("gpt_3d")
    return r, arch_for(r), Knobs.from_recipe(r), hardware_for(r.cluster, r.training.precision)


def test_compute_and_bubble(gpt3d):
    r, arch, k, hw = gpt3d
    flops = step_flops(r.model, k, "megatron")
    vocab = r.model.padded_vocab_size(2)
    assert flops[0] == model_flops_per_step(r.model, 256, convention="megatron", vocab_size=vocab)
    assert flops[1] == pytest.approx(hardware_flops_per_step(r.model, 256, "selective", convention="megatron",
                                                             vocab_size=vocab), rel=1e-12)
    assert 0 < flops[2] < flops[1]  # the layers' weight GEMMs: what FP8 would speed up
    t = estimate_step_time(arch, k, hw, flops, efficiency=0.5)
    assert t.terms[COMPUTE] == pytest.approx(flops[1] / 16 / (989.4e12 * 0.5))
    p, v, m = 2, 2, 256 // (2 * 4)
    # the last stage also holds the logits: it sets the pace and idles less than (p-1)/(v m) of its work
    assert t.terms[BUBBLE] == pytest.approx(t.terms[COMPUTE] * bubble_fraction(arch, p, v, m, tensor=2))
    assert 0.8 * (p - 1) / (v * m) < t.terms[BUBBLE] / t.terms[COMPUTE] < (p - 1) / (v * m)
    half = estimate_step_time(arch, k, hw, flops, efficiency=0.25)
    assert half.terms[COMPUTE] == pytest.approx(2 * t.terms[COMPUTE])


def test_tensor_and_pipeline_traffic(gpt3d):
    r, arch, k, hw = gpt3d
    t = estimate_step_time(arch, k, hw, step_flops(r.model, k, "megatron"))
    b, s, h, tp, m, L, p, v = 2, 2048, 2048, 2, 32, 24, 2, 2
    # Narayanan: 8 b s h (t-1)/t elements per layer per microbatch, 2 bytes each, at the NVLink busbw
    tp_bytes = 8 * b * s * h * (tp - 1) / tp * 2
    assert t.terms[TP_COMM] == pytest.approx(tp_bytes * (L // p) * m / hw.intra_node_bw)
    # p2p: b s h / t (sequence parallel) forward + backward per microbatch and virtual stage, across nodes
    assert t.terms[PP_COMM] == pytest.approx(2 * m * v * (b * s * h / tp * 2) / hw.inter_node_bw)
    full = estimate_step_time(arch, replace(k, recompute="full"), hw, step_flops(r.model, replace(k, recompute="full"),
                                                                                 "megatron"))
    assert full.terms[TP_COMM] == pytest.approx(1.5 * t.terms[TP_COMM])  # the recomputed forward's 2 all-reduces


def test_data_parallel_and_overlap(gpt3d):
    r, arch, k, hw = gpt3d
    k = replace(k, sharding=replace(k.sharding, overlap_grad_reduce=False, overlap_param_gather=False))
    flops = step_flops(r.model, k, "megatron")
    n = max(stage_parameters(arch, 2, 2, 0), stage_parameters(arch, 2, 2, 1))
    d, bw = 4, hw.intra_node_bw  # TP2 x DP4 = 8 ranks: the DP group stays in a node
    tied = 4 * arch.padded_vocab(2) * arch.hidden / 2 * 2 * (2 - 1) / 2 / hw.inter_node_bw  # embedding copies
    dist = estimate_step_time(arch, k, hw, flops)
    assert dist.terms[DP_COMM] == pytest.approx((4 * n + 2 * n) * (d - 1) / d / bw + tied)
    plain = estimate_step_time(arch, replace(k, sharding=replace(k.sharding, distributed_optimizer=False)), hw, flops)
    assert plain.terms[DP_COMM] == pytest.approx(4 * n * 2 * (d - 1) / d / bw + tied)
    hidden = estimate_step_time(arch, replace(k, sharding=replace(k.sharding, overlap_grad_reduce=True,
                                                                  overlap_param_gather=True)), hw, flops)
    assert hidden.terms[DP_COMM] < dist.terms[DP_COMM]


def test_throughput_and_mfu(gpt3d):
    r, arch, k, hw = gpt3d
    t = estimate_step_time(arch, k, hw, step_flops(r.model, k, "megatron"))
    assert t.total_s == pytest.approx(sum(t.terms.values()))
    assert t.tokens_per_s == pytest.approx(256 * 2048 / t.total_s)
    assert t.mfu == pytest.approx(t.model_flops / (t.total_s * 16 * 989.4e12))


def test_zero_stages_traffic_and_offload():
    r = inline_recipe("gpt_zero")
    arch, k, hw = arch_for(r), Knobs.from_recipe(r), hardware_for(r.cluster, r.training.precision)
    flops = step_flops(r.model, k, "megatron")
    n, d, m = stage_parameters(arch, 1, 1, 0), 16, 512 // (4 * 16)
    unit = 2 * n * (d - 1) / d / hw.inter_node_bw  # one reduce-scatter or all-gather of 16-bit values
    stage = {s: estimate_step_time(arch, replace(k, sharding=replace(k.sharding, zero_stage=s, overlap_comm=False)),
                                   hw, flops) for s in range(4)}
    assert stage[0].terms[DP_COMM] == pytest.approx(2 * unit)
    assert stage[1].terms[DP_COMM] == pytest.approx(2 * unit)
    assert stage[2].terms[DP_COMM] == pytest.approx((m + 1) * unit)
    assert stage[3].terms[DP_COMM] == pytest.approx(3 * m * unit)
    overlapped = estimate_step_time(arch, replace(k, sharding=replace(k.sharding, overlap_comm=True)), hw, flops)
    assert overlapped.terms[DP_COMM] == pytest.approx(max(3 * m * unit - overlapped.terms[COMPUTE], 0.0))
    assert stage[3].terms[OFFLOAD] == 0.0
    off = estimate_step_time(arch, replace(k, sharding=replace(k.sharding, offload_optimizer="cpu")), hw, flops)
    assert off.terms[OFFLOAD] > 0.0


def test_cpu_has_no_step_time():
    r = load_recipe(REPO / "recipes/gpt_3d.yaml", profile="local")
    arch, k, hw = arch_for(r), Knobs.from_recipe(r), hardware_for(r.cluster, r.training.precision)
    assert hw.peak_flops is None and estimate_step_time(arch, k, hw, step_flops(r.model, k, "megatron")) is None
    hw2 = hardware_for(r.cluster.model_copy(update={"gpu_peak_tflops": 1.0}), "fp32")
    assert estimate_step_time(arch, k, hw2, step_flops(r.model, k, "megatron")).total_s > 0
