"""The planner knows the layer kind (issue 43 item 5): Megatron's efficiency per attention path (TE, SDPA, unfused)
with the measured figure in its table, so that ``plan`` predicts the H200's measured local-layer step
(docs/gpu-path.md) within 10 %, a local-layer plan is slower than a TE one by the measured factor, activation memory
follows the path, and a search across backends without TE ranks Megatron at its local layers' speed."""

from __future__ import annotations

import json

import pytest

from hpc_tools.cli import main
from hpc_tools.planner import plan_recipe
from hpc_tools.planner.efficiency import MEGATRON_BY_PATH, MEGATRON_EFFICIENCY, efficiency_key, resolve_efficiency
from hpc_tools.planner.memory import ACTIVATIONS
from hpc_tools.recipe.load import load_recipe
from tests.helpers import REPO

# docs/gpu-path.md: one NVIDIA H200, 2026-11-28, `gpu_mfu.py --size 1.3b --layers local` (local layers, unfused
# attention, no TE): 2.452 s per step (22.9 % MFU); 2.461 s the day before
MEASURED_H200_LOCAL_STEP_S = 2.452


# the configuration that run measured (benchmarks/gpu_mfu.py's builder then): gpt_3d's GPT 1.3B on one H200, TP1,
# seq 2048, micro 4 x 8, bf16, no recompute, plain optimizer
MEASURED = ["model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=2048",
            "parallel.tensor_size=1", "parallel.pipeline_size=1", "parallel.virtual_pipeline_size=null",
            "parallel.sequence_parallel=false", "parallel.data_size=-1", "cluster.nodes=1", "cluster.gpus_per_node=1",
            "cluster.gpu_type=H200", "cluster.partition=null", "training.micro_batch_size=4",
            "training.global_batch_size=32", "training.train_iters=13", "training.lr_warmup_iters=1",
            "training.recompute_granularity=none", "training.precision=bf16",
            "backend.megatron.distributed_optimizer=false", "backend.megatron.overlap_grad_reduce=false",
            "backend.megatron.overlap_param_gather=false"]
LAYERS = {"te": ["backend.megatron.transformer_impl=transformer_engine", "backend.megatron.use_flash_attention=true"],
          "local": ["backend.megatron.transformer_impl=local", "backend.megatron.use_flash_attention=false"]}


def gpu_mfu_recipe(layers: str, *sets: str):
    """The recipe of the measured run (``layers``: ``te`` or ``local``), with ``sets`` over it."""
    return load_recipe(REPO / "recipes" / "gpt_3d.yaml", [*MEASURED, *LAYERS[layers], *sets])


def test_local_layers_plan_the_measured_h200_step_within_10_percent():
    plan = plan_recipe(gpu_mfu_recipe("local"), use_calibration=False)
    assert plan.knobs.attention == "unfused"
    assert plan.efficiency == MEGATRON_BY_PATH["unfused"][0]
    assert "measured" in plan.efficiency_source and "H200" in plan.efficiency_source
    assert plan.time.total_s == pytest.approx(MEASURED_H200_LOCAL_STEP_S, rel=0.10)
    # the TE figure would have said 0.935 s: 2.6x optimistic (the planner before the layer kind was known)
    te_priced = plan_recipe(gpu_mfu_recipe("local"), efficiency=MEGATRON_EFFICIENCY, use_calibration=False)
    assert te_priced.time.total_s < 0.4 * MEASURED_H200_LOCAL_STEP_S


def test_local_layers_are_slower_than_te_layers_by_the_measured_factor():
    te = plan_recipe(gpu_mfu_recipe("te"), use_calibration=False)
    unfused = plan_recipe(gpu_mfu_recipe("local"), use_calibration=False)
    sdpa = plan_recipe(gpu_mfu_recipe("local", "backend.megatron.use_flash_attention=true"), use_calibration=False)
    assert (te.knobs.attention, sdpa.knobs.attention) == ("te", "sdpa")
    factor = MEGATRON_EFFICIENCY / MEGATRON_BY_PATH["unfused"][0]  # 0.6 / 0.229: the H200's measured 2.6x
    assert unfused.time.total_s / te.time.total_s == pytest.approx(factor, rel=1e-6)
    assert te.time.total_s < sdpa.time.total_s < unfused.time.total_s
    assert "estimate, not measured" in sdpa.efficiency_source  # SDPA has no measurement yet and says so


def test_activation_memory_follows_the_attention_path():
    """SDPA (16-bit, GPU) and TE keep no s^2 tensor; Megatron's unfused attention keeps the fp32 softmax, its 16-bit
    copy and the causal mask, s^2 per head."""
    acts = {name: plan_recipe(gpu_mfu_recipe(*args), use_calibration=False).memory.peak.terms[ACTIVATIONS]
            for name, args in {"te": ("te",), "unfused": ("local",),
                               "sdpa": ("local", "backend.megatron.use_flash_attention=true")}.items()}
    r = gpu_mfu_recipe("local")
    s, b, a, layers = r.model.seq_length, r.training.micro_batch_size, r.model.num_attention_heads, r.model.num_layers
    # per layer: the fp32 softmax and its 16-bit copy (6 bytes per score and head) and the causal mask (1 per score)
    quadratic = layers * (6 * a * s * s * b + s * s)
    assert acts["unfused"] - acts["sdpa"] == pytest.approx(quadratic, rel=0.01)
    assert acts["sdpa"] > acts["te"]  # + the fp32 log-sum-exp per head and token


def test_calibrations_are_kept_per_attention_path(tmp_path):
    store = tmp_path / "calibration.json"
    store.write_text(json.dumps({"version": 2, "clusters": {
        "H200/megatron": {"efficiency": 0.55, "runs": ["a"]},
        "H200/megatron+unfused": {"efficiency": 0.25, "runs": ["b"]}}}))
    te, local = gpu_mfu_recipe("te"), gpu_mfu_recipe("local")
    assert (efficiency_key(te), efficiency_key(local)) == ("megatron", "megatron+unfused")
    assert resolve_efficiency(te, calibration=store)[0] == 0.55
    assert resolve_efficiency(local, calibration=store)[0] == 0.25  # a TE calibration never prices local layers
    sdpa = gpu_mfu_recipe("local", "backend.megatron.use_flash_attention=true")
    assert resolve_efficiency(sdpa, calibration=store) == MEGATRON_BY_PATH["sdpa"]


LLAMA = REPO / "recipes/llama_fsdp.yaml"
TORCHTITAN = ["cluster.nodes=1", "training.micro_batch_size=2", "training.global_batch_size=16",
              "backend.fsdp.strategy=full_shard", "training.recompute_granularity=none"]


def best_step(*sets: str, kind: str) -> float:
    from hpc_tools.planner.search import search, with_kind

    r = with_kind(load_recipe(LLAMA, [*TORCHTITAN], check=False), kind)
    if sets:
        import yaml

        from hpc_tools.recipe.load import dump_resolved, resolve

        r = resolve(yaml.safe_load(dump_resolved(r)), list(sets), source="test", check=False, layered=False)
    return search(r, top=1, losers=0, use_calibration=False).best.step_s


def test_search_without_te_ranks_megatron_at_its_local_layers_speed(capsys):
    """torchtitan's Llama 3.1 8B configuration (test_efficiency_defaults): with TE Megatron's best layout beats
    FSDP's; on nodes without TE (transformer_impl: local) Megatron's unfused local layers are priced at their measured
    figure and rank behind FSDP, and SDPA on them in between."""
    fsdp = best_step(kind="fsdp")
    te = best_step(kind="megatron")
    unfused = best_step("backend.megatron.transformer_impl=local", "backend.megatron.use_flash_attention=false",
                        kind="megatron")
    sdpa = best_step("backend.megatron.transformer_impl=local", kind="megatron")
    assert te < fsdp < unfused and te < sdpa < unfused
    assert main(["plan", str(REPO / "recipes/gpt_3d.yaml"), "--no-calibration", "--json",
                 "--set", "backend.megatron.transformer_impl=local"]) == 0
    out = json.loads(capsys.readouterr().out)["step_time"]
    assert out["efficiency"] == MEGATRON_BY_PATH["sdpa"][0] and "estimate" in out["efficiency_source"]
