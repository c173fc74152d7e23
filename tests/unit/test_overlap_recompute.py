"""What Megatron-core can overlap or recompute, the recipe can ask and the planner prices.

``parallel.overlap_moe_expert_parallel_comm`` / ``parallel.moe_shared_expert_overlap``: Megatron-core 0.16's
preconditions as one-line rules (every combination of the values they read is tried against the same preconditions
written out here); the planner's exposed all-to-all shrinks with the overlap, never below what no overlap can hide.
``training.recompute_modules``: one-line rules; each module added saves memory and costs time. DeepSeek-V3 on 1,024
H100 with the all-to-all overlapped plans within 25 % of DeepSeek's own reported throughput per GPU.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from inline_recipes import inline_recipe

from hpc_tools.errors import UserError
from hpc_tools.planner import make_plan
from hpc_tools.planner.steptime import COMPUTE, EP_COMM, a2a_passes, unpaired_microbatches
from hpc_tools.recipe.load import load_recipe, resolve
from hpc_tools.recipe.rules import check_recipe
from hpc_tools.recipe.training import RECOMPUTE_MODULES
from tests.helpers import REPO

OVERLAP, SHARED, MODULES = ("parallel.overlap_moe_expert_parallel_comm", "parallel.moe_shared_expert_overlap",
                            "training.recompute_modules")

MOE = {
    "name": "overlap_rules",
    "model": {"family": "llama", "num_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
              "seq_length": 2048, "vocab_size": 32000, "num_experts": 8, "moe_router_topk": 2},
    "parallel": {"tensor_size": 1, "pipeline_size": 1, "expert_size": 8},
    "training": {"micro_batch_size": 1, "global_batch_size": 64, "precision": "bf16"},
    "backend": {"kind": "megatron"},
    "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_type": "H100-SXM"},
}


NOT_YET = "is not supported yet: Megatron-core's combined 1F1B schedule asks the forward step for a schedule plan"


def test_the_expert_all_to_all_overlap_is_refused_in_one_line_where_megatron_core_would_accept_it():
    """Megatron-core's combined 1F1B calls the forward step with ``return_schedule_plan=True`` (CUDA streams only);
    hpc_tools' engine builds no schedule plan, so every GPU run with the field raised TypeError at step 1."""
    sets = ["parallel.expert_size=4", "training.global_batch_size=64", f"{OVERLAP}=true"]
    with pytest.raises(UserError) as err:
        resolve(MOE, sets, source="test")
    line = str(err.value)
    assert "\n" not in line and f"{OVERLAP}=true {NOT_YET}" in line and "set it false" in line


def violations_of(raw: dict, sets: list[str], field: str) -> list[str]:
    r = resolve(raw, sets, source="test", check=False)
    return [str(v) for v in check_recipe(r) if v.path == field]


# --- rules, over every combination of the values they read -----------------------------------------------------

def megatron_refuses_overlap(ep, dispatcher, precision, gpu, recompute, pipeline, shared_overlap) -> bool:
    """Megatron-core 0.16.1 TransformerConfig.__post_init__ (overlap_moe_expert_parallel_comm), plus CUDA streams."""
    pp, vpp = pipeline
    return (ep == 1 or dispatcher != "alltoall" or precision == "fp32" or gpu == "cpu" or recompute == "full"
            or (pp > 1 and vpp is None) or shared_overlap)


OVERLAP_GRID = list(itertools.product([1, 4], ["alltoall", "allgather"], ["bf16", "fp32"], ["H100-SXM", "cpu"],
                                      ["none", "selective", "full"], [(1, None), (2, None), (2, 2)], [False, True]))


@pytest.mark.parametrize("ep,dispatcher,precision,gpu,recompute,pipeline,shared_overlap", OVERLAP_GRID)
def test_overlap_rule_matches_megatron_core_preconditions(ep, dispatcher, precision, gpu, recompute, pipeline,
                                                          shared_overlap):
    pp, vpp = pipeline
    sets = [f"parallel.expert_size={ep}", f"model.moe_token_dispatcher_type={dispatcher}",
            f"training.precision={precision}", f"cluster.gpu_type={gpu}", f"training.recompute_granularity={recompute}",
            f"parallel.pipeline_size={pp}", f"parallel.virtual_pipeline_size={vpp or 'null'}",
            "training.global_batch_size=64", "parallel.overlap_moe_expert_parallel_comm=true",
            f"parallel.moe_shared_expert_overlap={str(shared_overlap).lower()}",
            "model.moe_shared_expert_intermediate_size=1024"]
    lines = violations_of(MOE, sets, OVERLAP)
    refused = megatron_refuses_overlap(ep, dispatcher, precision, gpu, recompute, pipeline, shared_overlap)
    # where Megatron-core would accept it, the field is refused until the engine builds the combined 1F1B schedule
    # plan under a GPU test (issue 46 item 1): one line either way
    assert len(lines) == 1, lines
    assert "\n" not in lines[0] and OVERLAP in lines[0]
    assert (NOT_YET in lines[0]) == (not refused), lines
    assert violations_of(MOE, sets, SHARED) == [], "the shared overlap is judged only without the EP overlap"


@pytest.mark.parametrize("shared,dispatcher,gpu", itertools.product([None, 1024], ["alltoall", "allgather"],
                                                                   ["H100-SXM", "cpu"]))
def test_shared_expert_overlap_rule(shared, dispatcher, gpu):
    sets = [f"model.moe_shared_expert_intermediate_size={shared or 'null'}",
            f"model.moe_token_dispatcher_type={dispatcher}", f"cluster.gpu_type={gpu}",
            "parallel.moe_shared_expert_overlap=true"]
    if gpu == "cpu":
        sets.append("training.precision=fp32")
    lines = violations_of(MOE, sets, SHARED)
    refused = shared is None or dispatcher != "alltoall" or gpu == "cpu"
    assert len(lines) == (1 if refused else 0), lines


def test_overlap_fields_are_refused_by_backends_without_them():
    llama = {**MOE, "model": {k: v for k, v in MOE["model"].items() if k not in ("num_experts", "moe_router_topk")},
             "parallel": {}, "backend": {"kind": "fsdp"}}
    for field in (OVERLAP, SHARED):
        lines = violations_of(llama, [f"{field}=true"], field)
        assert len(lines) == 1 and "backend.kind=fsdp" in lines[0] and "megatron" in lines[0]
    lines = violations_of(llama, ["training.recompute_modules=[mlp]"], MODULES)
    assert len(lines) == 1 and "backend.kind=fsdp" in lines[0]


DSV3 = "deepseek_v3"


def module_cases():
    """(modules, extra sets, refused): every module alone on the models that have it and on those that do not."""
    dense = ["model.num_experts=null", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=null",
             "model.moe_shared_expert_intermediate_size=null", "model.moe_layer_freq=1",
             "model.moe_router_enable_expert_bias=false", "parallel.expert_size=1",
             "model.multi_latent_attention=false", "model.q_lora_rank=null"]
    for module in RECOMPUTE_MODULES:
        yield [module], [], False
        dense_lacks = module in ("moe", "moe_act", "shared_experts", "mla_up_proj")
        yield [module], dense, dense_lacks
    yield ["moe_act"], ["model.moe_grouped_gemm=false"], True
    yield ["moe_act"], ["training.fp8_recipe=delayed"], True
    yield ["layernorm"], ["training.fp8_recipe=delayed"], True
    yield ["layernorm"], ["training.fp8=null", "training.fp8_recipe=delayed"], False
    yield ["layernorm"], ["cluster.gpu_type=cpu", "training.fp8=null", "training.precision=fp32"], True
    yield ["layernorm"], ["backend.megatron.transformer_impl=local", "training.fp8=null"], True
    yield ["shared_experts"], ["parallel.moe_shared_expert_overlap=true"], True
    yield ["mlp"], ["model.moe_layer_freq=1"], True  # every layer MoE: no dense MLP to recompute
    yield ["mlp", "mlp"], [], True
    yield [], [], True


@pytest.mark.parametrize("modules,sets,refused", list(module_cases()))
@pytest.mark.parametrize("granularity", ["none", "selective", "full"])
def test_recompute_modules_rules(modules, sets, refused, granularity):
    base = ["parallel.pipeline_size=1", "training.global_batch_size=1024",
            f"training.recompute_granularity={granularity}", f"training.recompute_modules=[{','.join(modules)}]"]
    lines = violations_of(__import__("inline_recipes").INLINE[DSV3], base + sets, MODULES)
    expected = 1 if granularity != "selective" or refused else 0
    assert len(lines) == expected, lines
    if lines:
        assert "\n" not in lines[0] and "training.recompute_modules" in lines[0]


# --- the planner ------------------------------------------------------------------------------------------------

def deepseek(*sets: str, check: bool = False):
    """The shipped recipes/deepseek_v3.yaml (DeepSeek-V3 as published on 1,024 H100: PP16 with shorter first and last
    stages, EP64, micro batch 1, global batch 15,360 sequences of 4,096 tokens, FP8 GEMMs) with the recomputation the
    report describes (sec. 3.2.3: every RMSNorm and the MLA up-projections) instead of the recipe's full one."""
    return load_recipe(REPO / "recipes" / "deepseek_v3.yaml", check=check,
                       overrides=["training.recompute_granularity=selective",
                                  "training.recompute_modules=[layernorm,mla_up_proj]", *sets])


def test_each_recompute_module_saves_memory_and_costs_time():
    """Modules added one by one (each applies to DeepSeek-V3: norms, MLA, dense first layers, routed and shared
    experts): the peak memory falls and the step time rises at every step; core_attn with explicit attention."""
    order = ["layernorm", "mla_up_proj", "mlp", "moe_act", "shared_experts", "moe"]
    plans = [make_plan(deepseek("training.recompute_granularity=none", "training.recompute_modules=null"))]
    for n in range(1, len(order) + 1):
        plans.append(make_plan(deepseek(f"training.recompute_modules=[{','.join(order[:n])}]")))
    mems = [sum(st.total for st in p.memory.stages) for p in plans]  # the dense layers are on the first stage
    times = [p.time.total_s for p in plans]
    assert all(a > b for a, b in zip(mems, mems[1:])), mems
    assert all(a < b for a, b in zip(times, times[1:])), times
    explicit = ["backend.megatron.use_flash_attention=false", "training.recompute_modules=[layernorm]"]
    without, with_core = make_plan(deepseek(*explicit)), make_plan(
        deepseek(*explicit[:1], "training.recompute_modules=[layernorm,core_attn]"))
    assert with_core.memory.total < without.memory.total
    assert with_core.time.total_s > without.time.total_s


def test_recomputing_moe_repeats_its_all_to_all():
    k = make_plan(deepseek("training.recompute_modules=[moe]")).knobs
    assert a2a_passes(k) == 6 and a2a_passes(dataclasses.replace(k, recompute_modules=("mlp",))) == 4


MIXTRAL = "mixtral_8x7b"


@pytest.mark.parametrize("sets", [
    ["parallel.pipeline_size=1", "training.global_batch_size=64"],
    ["parallel.pipeline_size=1", "training.global_batch_size=32"],
    ["parallel.pipeline_size=4", "parallel.virtual_pipeline_size=2", "training.global_batch_size=256"],
    ["parallel.pipeline_size=4", "parallel.virtual_pipeline_size=2", "training.global_batch_size=32"],
    ["parallel.pipeline_size=4", "parallel.virtual_pipeline_size=2", "training.global_batch_size=128",
     "cluster.intra_node_bw_gbps=2"],
    ["parallel.pipeline_size=1", "parallel.expert_size=2", "training.global_batch_size=128",
     "training.micro_batch_size=2", "cluster.intra_node_bw_gbps=1"],
])
def test_overlap_lowers_the_exposed_all_to_all_never_below_what_cannot_be_hidden(sets):
    r = inline_recipe(MIXTRAL, *sets, "training.recompute_granularity=none", "parallel.data_size=-1",
                      "parallel.overlap_moe_expert_parallel_comm=true", check=False)
    assert [v.path for v in check_recipe(r)] == [OVERLAP]  # Megatron-core's preconditions hold; priced all the same
    on = make_plan(r)
    off = make_plan(r, knobs=dataclasses.replace(on.knobs, ep_overlap=False))
    m = on.knobs.layout.num_microbatches
    per_mb = off.time.terms[EP_COMM] / m
    unpaired = unpaired_microbatches(on.knobs)
    compute_mb = on.time.terms[COMPUTE] / m
    # lower whenever some microbatches pair up (m above the unpaired warm-up and cool-down), else the same
    assert on.time.terms[EP_COMM] < off.time.terms[EP_COMM] if m > unpaired else \
        on.time.terms[EP_COMM] == pytest.approx(off.time.terms[EP_COMM])
    assert on.time.terms[EP_COMM] >= unpaired * per_mb - 1e-12
    # a pair hides its all-to-all fully exactly when each direction fits behind the other microbatch's compute
    fits = per_mb / 2 <= compute_mb / 3
    assert (on.time.terms[EP_COMM] == pytest.approx(unpaired * per_mb)) == fits
    # everything but the all-to-all is unchanged; the step is never shorter than its compute and bubble
    assert {k: v for k, v in on.time.terms.items() if k != EP_COMM} == \
        {k: v for k, v in off.time.terms.items() if k != EP_COMM}
    assert on.time.total_s >= on.time.terms[COMPUTE] * (1 + on.knobs.layout.bubble_fraction)


def test_shared_expert_overlap_hides_up_to_the_shared_experts_compute():
    sets = ["model.moe_shared_expert_intermediate_size=14336", "parallel.pipeline_size=1",
            "training.global_batch_size=64", "training.recompute_granularity=none"]
    r = inline_recipe(MIXTRAL, *sets, "parallel.moe_shared_expert_overlap=true")
    assert [str(v) for v in check_recipe(r)] == []
    on = make_plan(r)
    off = make_plan(r, knobs=dataclasses.replace(on.knobs, shared_expert_overlap=False))
    assert 0 <= on.time.terms[EP_COMM] < off.time.terms[EP_COMM]


# --- DeepSeek-V3 against DeepSeek's own throughput --------------------------------------------------------------

# DeepSeek-V3 Technical Report (arXiv 2412.19437), sec. 1 / Table 1: "training DeepSeek-V3 on each trillion tokens
# requires only 180K H800 GPU hours" (2,664K GPU hours of pre-training for 14.8T tokens, on 2,048 H800).
DEEPSEEK_GPU_HOURS_PER_TRILLION = 180e3
DEEPSEEK_TOKENS_PER_S_PER_GPU = 1e12 / (DEEPSEEK_GPU_HOURS_PER_TRILLION * 3600)  # 1,543 tokens/s per H800


def test_deepseek_v3_with_the_all_to_all_overlapped_is_within_25_percent_of_the_published_throughput():
    """H800 = H100 SXM's SMs and clocks (the same 989 dense bf16 TFLOP/s) with NVLink cut to 400 GB/s; the planner
    prices H100's 900 GB/s NVLink, which the EP64 all-to-all (across 8 nodes, network-bound) hardly uses. DeepSeek's
    DualPipe overlaps the all-to-all with compute fully; Megatron-core's own overlap needs virtual pipeline stages,
    which 61 layers with shorter first and last stages cannot have, so the overlapped plan is priced by the same
    model (knobs.ep_overlap) with the first stage's p warm-up / cool-down microbatches left unpaired."""
    r = deepseek(check=False)
    assert [str(v) for v in check_recipe(r)] == []
    plain = make_plan(r)
    overlapped = make_plan(r, knobs=dataclasses.replace(plain.knobs, ep_overlap=True))
    per_gpu = overlapped.time.tokens_per_s / overlapped.time.world
    ratio = per_gpu / DEEPSEEK_TOKENS_PER_S_PER_GPU
    assert DEEPSEEK_TOKENS_PER_S_PER_GPU == pytest.approx(1543.2, abs=0.1)
    assert 0.75 <= ratio <= 1.25, (f"plan {per_gpu:.0f} tokens/s/GPU vs DeepSeek's {DEEPSEEK_TOKENS_PER_S_PER_GPU:.0f}"
                                   f" (ratio {ratio:.2f}); terms {overlapped.time.terms}")
    # without the overlap the all-to-all is most of the step and the plan is far slower
    assert plain.time.terms[EP_COMM] > 0.5 * plain.time.total_s
    assert plain.time.tokens_per_s / plain.time.world < 0.75 * DEEPSEEK_TOKENS_PER_S_PER_GPU


def test_the_trainer_drops_core_attn_where_flash_attention_keeps_no_scores():
    from types import SimpleNamespace

    from hpc_tools.train.megatron.config import recompute_granularity, recompute_modules

    flash = SimpleNamespace(flash_style=True, transformer_engine=True, layers="transformer_engine")
    explicit = SimpleNamespace(flash_style=False, transformer_engine=True, layers="transformer_engine")
    default = deepseek("training.recompute_modules=null")
    assert recompute_modules(default, explicit) == ["core_attn"] and recompute_granularity(default, flash) is None
    both = deepseek("training.recompute_modules=[core_attn,mla_up_proj]")
    assert recompute_modules(both, flash) == ["mla_up_proj"] and recompute_granularity(both, flash) == "selective"
    assert recompute_modules(deepseek("training.recompute_granularity=full", "training.recompute_modules=null"),
                             flash) == []
    local = SimpleNamespace(flash_style=False, transformer_engine=False, layers="local")
    with pytest.raises(UserError, match="layernorm, which Megatron-core 0.16 recomputes through Transformer Engine"):
        recompute_modules(both.model_copy(update={"training": both.training.model_copy(
            update={"recompute_modules": ["layernorm"]})}), local)
