"""doctor's GPU-library rows (issue 25 items 2, 9, 13): Transformer Engine against megatron-core's accepted range,
apex's weight-gradient kernel, flash-attn, and DeepSpeed's async_io op for NVMe offload, on this machine (none of
them installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_tools.doctor import gpu_library_checks, megatron_te_range, needs_transformer_engine, nvme_offload_check, pins
from hpc_tools.errors import UserError
from hpc_tools.recipe.load import load_recipe, resolve


def gpt3d(*sets: str):
    return load_recipe("recipes/gpt_3d.yaml", overrides=list(sets))


def rows(recipe=None) -> dict:
    return {r.name: r for r in gpu_library_checks(recipe)}


@pytest.mark.parametrize("impl", ["auto", "transformer_engine", "local"])
@pytest.mark.parametrize("flash", [True, False])
def test_needs_te_is_the_layer_plans_rule(impl, flash):
    """doctor cannot import the trainers: its copy of the rule agrees with layer_plan's GPU failures without TE."""
    from hpc_tools.train.megatron.layers import layer_plan

    recipe = gpt3d(f"backend.megatron.transformer_impl={impl}", f"backend.megatron.use_flash_attention={flash}")
    try:
        layer_plan(recipe, "cuda", te_available=False)
        fails = False
    except UserError as err:
        fails = "transformer_engine" in str(err) and not (impl == "local")
    assert needs_transformer_engine(recipe) == fails


@pytest.mark.parametrize("impl", ["auto", "transformer_engine", "local"])
@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("te", [True, False])
def test_doctors_attention_path_is_the_layer_plans(impl, flash, precision, te):
    """doctor's copy of the attention path (issue 43) names what layer_plan gives a GPU rank on a node with / without
    TE: sdpa, te-flash|te-fused, unfused."""
    from hpc_tools.doctor import attention_path
    from hpc_tools.train.megatron.layers import layer_plan

    recipe = gpt3d(f"backend.megatron.transformer_impl={impl}", f"backend.megatron.use_flash_attention={flash}",
                   f"training.precision={precision}")
    try:
        plan = layer_plan(recipe, "cuda", te_available=te)
    except UserError:
        assert impl == "transformer_engine" and not te
        return
    assert attention_path(recipe, te) == plan.path


def test_attention_row_names_the_path_this_node_gives():
    """No TE here: the default recipe's GPU ranks run the local layers with SDPA (a warning, not a failure, since
    issue 43), Megatron's unfused attention says what it costs; CPU ranks run SDPA too; no recipe, no row."""
    sdpa = rows(gpt3d())["attention"]
    assert sdpa.status == "warn" and sdpa.detail.startswith("sdpa: Megatron-core local layers")
    unfused = rows(gpt3d("backend.megatron.use_flash_attention=false"))["attention"]
    assert unfused.status == "warn" and unfused.detail.startswith("unfused:") and "use_flash_attention: true" in \
        unfused.fix
    cpu = rows(gpt3d("cluster.gpu_type=cpu"))["attention"]  # the CPU ranks' path, as their start line names it
    assert cpu.status == "pass" and cpu.detail.startswith("sdpa: CPU ranks")
    assert "attention" not in rows()


def test_te_row_fails_for_a_recipe_that_needs_it_naming_the_pinned_install():
    assert rows(gpt3d())["transformer-engine"].status == "warn"  # auto: the local layers run without it
    needs = gpt3d("backend.megatron.transformer_impl=transformer_engine")
    assert rows(needs)["transformer-engine"].status == "fail"
    fix = rows(needs)["transformer-engine"].fix
    assert f"transformer_engine[pytorch,core_cu12]=={pins()['transformer-engine']}" in fix
    assert "--no-build-isolation" in fix
    assert rows(gpt3d("backend.megatron.transformer_impl=local", "backend.megatron.use_flash_attention=false"))[
        "transformer-engine"].status == "skip"
    assert rows(gpt3d("cluster.gpu_type=cpu"))["transformer-engine"].status == "skip"
    assert rows()["transformer-engine"].status == "skip"
    assert megatron_te_range() == "<2.12.0,>=2.9.0a0"  # megatron-core 0.16.1's own metadata


def test_apex_and_flash_attn_rows_say_what_their_absence_costs():
    gpu = rows(gpt3d())
    assert gpu["apex"].status == "warn" and "TE's weight-gradient fusion" in gpu["apex"].detail
    assert rows()["apex"].status == "skip"
    assert gpu["flash-attn"].status == "skip" and "cuDNN's fused attention" in gpu["flash-attn"].detail


@pytest.mark.slow
def test_nvme_offload_row_asks_deepspeeds_own_libaio_test():
    recipe = resolve({"name": "n", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                             "seq_length": 32, "vocab_size": 512},
                      "backend": {"kind": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_optimizer": "nvme",
                                                                     "nvme_path": "/tmp"}},
                      "cluster": {"gpus_per_node": 1, "gpu_type": "H100-SXM"}})
    row = nvme_offload_check(recipe)
    libaio = any(Path(d, "libaio.h").exists() for d in ("/usr/include", "/usr/local/include"))
    assert row.status == ("pass" if libaio else "fail"), row
    if not libaio:
        assert "async_io" in row.detail and "libaio-dev" in row.fix
    assert nvme_offload_check(gpt3d()) is None
