"""Issue 31 items 1-4 and 10: what would fail on the first GPU job, refused in one line (or fixed on every device),
each checked on CPU through the decision the GPU rank takes (docs/gpu-path.md)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from hpc_tools.errors import RecipeError, UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe import te_support
from hpc_tools.recipe.load import load_recipe, resolve

GPT = "recipes/gpt_3d.yaml"


def refusals(path: str, sets: list[str]) -> list[str]:
    try:
        load_recipe(path, overrides=sets)
    except RecipeError as exc:
        return [str(v) for v in exc.violations]
    return []


# -- item 1: context parallelism needs TE's flash or fused attention --------------------------------------------------

CP = ["parallel.context_size=2", "parallel.pipeline_size=4", "parallel.virtual_pipeline_size=null"]


@pytest.mark.parametrize("sets, rule, fix", [
    (["training.precision=fp32"], "with training.precision=fp32 TE has no attention backend for context parallelism",
     "use training.precision: bf16, or context_size: 1"),
    (["backend.megatron.use_flash_attention=false"],
     "backend.megatron.use_flash_attention=false leaves TE's unfused attention, which has no context parallelism",
     "set use_flash_attention: true, or context_size: 1"),
])
def test_context_parallelism_without_flash_or_fused_attention_is_refused(sets, rule, fix):
    assert refusals(GPT, CP) == []  # the layout itself is valid (bf16, flash attention)
    found = refusals(GPT, CP + sets)
    assert len(found) == 1 and found[0].startswith("parallel.context_size=2 needs Transformer Engine's flash or "
                                                   "fused attention"), found
    assert rule in found[0] and fix in found[0] and "\n" not in found[0]


def test_context_parallelism_with_fp32_and_no_flash_is_one_line_with_both_fixes():
    found = refusals(GPT, CP + ["training.precision=fp32", "backend.megatron.use_flash_attention=false"])
    assert len(found) == 1 and "precision: bf16" in found[0] and "use_flash_attention: true" in found[0], found


# -- item 2: block-scaled FP8 needs compute capability >= 9.0 and CUDA >= 12.9 -----------------------------------------

@pytest.mark.parametrize("capability, cuda, refused", [
    ((9, 0), "12.8", "this torch is built for CUDA 12.8"),  # the H100 with the cu128 torch the docs named
    ((9, 0), "12.9", None),
    ((10, 0), "13.0", None),
    ((8, 9), "12.9", "this GPU has compute capability 8.9"),  # Ada: FP8, but no block-scaled GEMM
    ((9, 0), None, "this torch is built for CUDA none"),
])
def test_blockwise_decision_is_a_function_of_capability_and_cuda(capability, cuda, refused):
    why = te_support.blockwise_refusal(capability, cuda)
    assert (why is None) == (refused is None), why
    if refused:
        assert refused in why and "compute capability >= 9.0" in why and "CUDA >= 12.9" in why


def blockwise_recipe():
    return load_recipe(GPT, overrides=["training.fp8=e4m3", "training.fp8_recipe=blockwise"])


def test_rank_start_refuses_blockwise_with_an_older_cuda_in_one_line():
    from hpc_tools.train.megatron.config import fp8_device_check

    with pytest.raises(UserError) as err:
        fp8_device_check(blockwise_recipe(), (9, 0), "12.8")
    text = str(err.value)
    assert text.startswith("training.fp8_recipe=blockwise needs compute capability >= 9.0") and "\n" not in text
    assert "fp8_recipe: tensorwise" in text
    fp8_device_check(blockwise_recipe(), (9, 0), "12.9")  # runs
    fp8_device_check(load_recipe(GPT, overrides=["training.fp8=e4m3", "training.fp8_recipe=tensorwise"]),
                     (9, 0), "12.8")  # only blockwise needs 12.9


def test_rank_passes_torchs_own_values_to_the_check(monkeypatch):
    """fp8_options (the CUDA TransformerConfig's FP8 fields) reads the device and torch.version.cuda."""
    import torch

    from hpc_tools.train.megatron.config import fp8_options

    te = SimpleNamespace(transformer_engine=True, layers="transformer_engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(UserError, match="this torch is built for CUDA 12.8"):
        fp8_options(blockwise_recipe(), te)
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    assert fp8_options(blockwise_recipe(), te) == {"fp8": "e4m3", "fp8_recipe": "blockwise"}


def test_doctor_refuses_blockwise_on_a_node_whose_torch_is_older():
    from hpc_tools.doctor import fp8_recipe_check

    row = fp8_recipe_check(blockwise_recipe(), (9, 0), "12.8")
    assert row.status == "fail" and "CUDA 12.8" in row.detail and "tensorwise" in row.fix
    assert fp8_recipe_check(blockwise_recipe(), (9, 0), "12.9").status == "pass"
    assert fp8_recipe_check(blockwise_recipe(), None, "12.9").status == "pass"  # login node: the CUDA build only
    assert fp8_recipe_check(load_recipe(GPT), (9, 0), "12.8") is None  # no FP8: no row


# -- item 3: the fp32 router's te_general_gemm, bound by the model builder on every device -----------------------------

def test_model_builder_binds_the_router_gemm_name_on_a_gpu_without_te(tmp_path):
    """The CUDA path without TE, in a fresh process with no CPU shim installed: the MoE block spec binds
    moe_utils.te_general_gemm, so the fp32 router's gating GEMM runs (before: NameError at the first forward)."""
    code = textwrap.dedent(f"""
        import warnings; warnings.filterwarnings("ignore")
        import torch, torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe import moe_utils
        from hpc_tools.layout import ParallelLayout
        from hpc_tools.recipe.load import load_recipe
        from hpc_tools.train.megatron import cpu_compat
        from hpc_tools.train.megatron.config import transformer_config
        from hpc_tools.train.megatron.layers import layer_plan
        from hpc_tools.train.megatron.model import block_spec

        r = load_recipe("recipes/gpt_moe.yaml", profile="local", overrides=[
            "cluster.gpu_type=H100-SXM", "cluster.nodes=1", "cluster.gpus_per_node=1",
            "backend.megatron.use_flash_attention=false", "parallel.pipeline_size=1", "parallel.expert_size=1",
            "parallel.tensor_size=1", "parallel.sequence_parallel=false",
            "parallel.num_layers_in_first_pipeline_stage=null"])
        plan = layer_plan(r, "cuda", te_available=False)
        config = transformer_config(r, ParallelLayout.from_recipe(r), "cuda", plan)
        assert plan.layers == "local" and config.moe_router_dtype == "fp32" and not cpu_compat.active()
        assert not hasattr(moe_utils, "te_general_gemm")  # no TE here: upstream never bound it
        dist.init_process_group("gloo", init_method="file://{tmp_path}/pg", rank=0, world_size=1)
        ps.initialize_model_parallel()
        block_spec(r, config, "cuda", None)
        x, w = torch.randn(3, config.hidden_size), torch.randn(config.num_moe_experts, config.hidden_size)
        out = moe_utils.router_gating_linear(x, w, None, torch.float32)
        print("router", tuple(out.shape), out.dtype)
        dist.destroy_process_group()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "router (3, 4) torch.float32" in proc.stdout


# -- item 4: multi-latent attention needs TE layers on a GPU -----------------------------------------------------------

MLA = ["model.family=llama", "model.multi_latent_attention=true", "model.num_query_groups=null"]


def test_mla_with_local_layers_on_a_gpu_is_refused_at_validate():
    found = refusals(GPT, MLA + ["backend.megatron.transformer_impl=local",
                                 "backend.megatron.use_flash_attention=false"])
    assert len(found) == 1 and found[0].startswith("model.multi_latent_attention=true needs Transformer Engine "
                                                   "layers on GPUs"), found
    assert refusals(GPT, MLA) == []


def test_mla_on_a_gpu_node_without_te_is_refused_at_rank_start():
    from hpc_tools.train.megatron.config import mla_layers_check, transformer_config
    from hpc_tools.train.megatron.layers import layer_plan

    r = load_recipe(GPT, overrides=MLA + ["backend.megatron.use_flash_attention=false"])
    local = layer_plan(r, "cuda", te_available=False)  # auto without TE: local layers
    assert local.layers == "local"
    with pytest.raises(UserError) as err:
        transformer_config(r, ParallelLayout.from_recipe(r), "cuda", local)
    assert str(err.value).startswith("model.multi_latent_attention=true needs Transformer Engine layers on a GPU")
    assert "\n" not in str(err.value)
    mla_layers_check(layer_plan(r, "cpu"), "cpu")  # CPU ranks run it on the local layers (cpu_compat)
    mla_layers_check(layer_plan(r, "cuda", te_available=True), "cuda")


# -- item 10: NVTE_*_ATTN in the job's environment --------------------------------------------------------------------

BASE = {"name": "t", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "seq_length": 32,
                               "vocab_size": 512},
        "training": {"micro_batch_size": 1, "global_batch_size": 8},
        "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu_type": "H100-SXM"}}


def env_refusals(sets: list[str]) -> list[str]:
    try:
        resolve(BASE, sets)
    except RecipeError as exc:
        return [str(v) for v in exc.violations]
    return []


@pytest.mark.parametrize("sets, refused", [
    (["cluster.setup.env.NVTE_FLASH_ATTN='0'"], "cluster.setup.env.NVTE_FLASH_ATTN=0"),  # auto asserts on it
    (["cluster.setup.env.NVTE_FUSED_ATTN='0'"], "cluster.setup.env.NVTE_FUSED_ATTN=0"),
    # 1 with TE (auto), 0 without (issue 43: the local layers with SDPA, AttnBackend local): either node asserts
    (["cluster.setup.env.NVTE_FLASH_ATTN='1'"], "cluster.setup.env.NVTE_FLASH_ATTN=1"),
    (["cluster.setup.env.NVTE_FLASH_ATTN='1'", "backend.megatron.transformer_impl=transformer_engine"],
     None),  # what megatron-core sets for auto anyway
    (["cluster.setup.env.NVTE_FLASH_ATTN='0'", "backend.megatron.use_flash_attention=false",
      "backend.megatron.transformer_impl=transformer_engine"], None),  # TE's unfused: flash off, as asked
    (["cluster.setup.env.NVTE_UNFUSED_ATTN='1'", "backend.megatron.use_flash_attention=false"],
     "cluster.setup.env.NVTE_UNFUSED_ATTN=1"),  # 1 with TE (unfused), 0 without (local): either node asserts
    (["cluster.setup.env.NVTE_FLASH_ATTN='1'", "cluster.gpu_type=cpu"], "cluster.setup.env.NVTE_FLASH_ATTN=1"),
    (["cluster.setup.env.NVTE_FUSED_ATTN_BACKEND='1'"], None),  # not one megatron-core checks
])
def test_attention_variables_in_setup_env(sets, refused):
    found = env_refusals(sets)
    if refused is None:
        assert found == []
        return
    assert len(found) == 1 and found[0].startswith(refused + " makes Megatron-core's attention check assert"), found
    assert "remove NVTE_" in found[0]


def test_rank_refuses_a_site_nvte_variable_for_its_plan():
    from hpc_tools.train.megatron.layers import LayerPlan, attention_environment_check

    auto = LayerPlan("transformer_engine", "auto", flash_style=True)
    with pytest.raises(UserError) as err:
        attention_environment_check(auto, {"NVTE_FLASH_ATTN": "0"})
    text = str(err.value)
    assert text.startswith("NVTE_FLASH_ATTN=0 is set in this rank's environment") and "\n" not in text
    attention_environment_check(auto, {"NVTE_FLASH_ATTN": "1", "PATH": "/bin"})
    attention_environment_check(LayerPlan("local", "local"), {"NVTE_FLASH_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"})
    with pytest.raises(UserError, match="NVTE_UNFUSED_ATTN=1"):
        attention_environment_check(LayerPlan("local", "local"), {"NVTE_UNFUSED_ATTN": "1"})


# -- items 7 and 8: doctor's datasets and flash-attn rows --------------------------------------------------------------

@pytest.mark.parametrize("version, capability, status", [
    ("2.8.3", None, "pass"), ("2.1.1", None, "pass"), ("2.9.0", None, "warn"), ("2.8.3.post1", None, "warn"),
    ("2.0.9", None, "warn"), ("2.6.3", (10, 0), "warn"), ("2.7.4", (10, 0), "pass"), (None, None, "skip"),
])
def test_doctor_names_the_flash_attn_versions_te_uses(version, capability, status):
    from hpc_tools.doctor import flash_attn_check

    row = flash_attn_check(version, capability)
    assert row.status == status, row
    if status == "warn":
        assert "2.8.3" in row.detail and "ignores this one" in row.detail and row.fix


@pytest.mark.parametrize("source, status", [("synthetic", "warn"), ("indexed", "warn"), (None, "warn"),
                                            ("files", "fail")])
def test_doctor_needs_datasets_only_for_hugging_face_inputs(monkeypatch, source, status):
    import importlib.metadata

    from hpc_tools.doctor import package_checks

    real = importlib.metadata.version

    def version(name):
        if name == "datasets":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    [row] = [r for r in package_checks("megatron", data_source=source) if r.name == "datasets"]
    assert row.status == status and "data.source: files" in row.detail, row
    torch_row = [r for r in package_checks("megatron", data_source=source) if r.name == "torch"]
    assert torch_row and torch_row[0].status in ("pass", "warn")  # every job's packages unchanged
