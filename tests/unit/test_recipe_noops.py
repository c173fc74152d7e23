"""Values that do nothing because their feature is off are refused (``hpc_tools.recipe.noops``), unless a layer above
the one that set them turned the feature off: the shipped recipes' local profiles, --set, sweep cells, a site file's
defaults, a run's resolved recipe and the planner's copies stay valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpc_tools.errors import RecipeError
from hpc_tools.recipe.load import dump_resolved, load_recipe, load_resolved, resolve

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
HOROVOD = ["backend.kind=horovod", "parallel.tensor_size=1", "parallel.pipeline_size=1"]
BASE = {"name": "t", "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                               "vocab_size": 512},
        "training": {"micro_batch_size": 1, "global_batch_size": 4},
        "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_type": "H100-SXM"}}


def errors(raw, overrides=(), profile=None):
    try:
        resolve(raw, list(overrides), profile)
    except RecipeError as exc:
        return [str(v) for v in exc.violations]
    return []


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
@pytest.mark.parametrize("profile", [None, "local"])
def test_shipped_recipes_still_validate(path, profile, monkeypatch):
    monkeypatch.setenv("HPC_TOOLS_SITE", "none")
    try:
        recipe = load_recipe(path, profile=profile)
    except RecipeError as exc:
        pytest.fail(f"{path.name} (profile {profile}) is refused: {[str(v) for v in exc.violations]}")
    assert recipe.name


@pytest.mark.parametrize("overrides,field", [
    (["training.fp8=null", "training.fp8_recipe=blockwise"], "training.fp8_recipe=blockwise"),
    ([*HOROVOD, "backend.deepspeed.zero_stage=3"], "backend.deepspeed.zero_stage=3"),
    ([*HOROVOD, "backend.fsdp.strategy=ddp"], "backend.fsdp.strategy=ddp"),
    (["backend.horovod.compression=fp16"], "backend.horovod.compression=fp16"),  # megatron, the default kind
    ([*HOROVOD, "backend.megatron.distributed_optimizer=true"], "backend.megatron.distributed_optimizer=true"),
])
def test_a_noop_is_one_line_naming_it(overrides, field, monkeypatch):
    monkeypatch.setenv("HPC_TOOLS_SITE", "none")
    found = [e for e in errors(BASE, overrides) if e.startswith(field)]
    assert len(found) == 1 and "\n" not in found[0] and "(" in found[0], errors(BASE, overrides)


def test_written_in_the_recipe_file_too(monkeypatch):
    monkeypatch.setenv("HPC_TOOLS_SITE", "none")
    raw = {**BASE, "backend": {"kind": "fsdp", "deepspeed": {"zero_stage": 1}}}  # the default value, written
    assert any(e.startswith("backend.deepspeed.zero_stage=1 is an option of backend.kind=deepspeed")
               for e in errors(raw))
    raw = {**BASE, "training": {**BASE["training"], "fp8": None, "fp8_recipe": "tensorwise"}}
    assert any(e.startswith("training.fp8_recipe=tensorwise") for e in errors(raw))


def test_turned_off_above_the_layer_that_set_it_is_fine(monkeypatch):
    monkeypatch.setenv("HPC_TOOLS_SITE", "none")
    fp8 = {**BASE, "training": {**BASE["training"], "precision": "bf16", "fp8": "e4m3", "fp8_recipe": "tensorwise"}}
    assert errors(fp8) == []
    assert errors(fp8, ["training.fp8=null"]) == []  # --set over the file
    assert errors({**fp8, "local": {"training": {"fp8": None}}}, profile="local") == []  # the profile over the file
    ds = {**BASE, "parallel": {"tensor_size": 1}, "backend": {"kind": "deepspeed", "deepspeed": {"zero_stage": 3}}}
    assert errors(ds) == []
    assert errors(ds, ["backend.kind=fsdp"]) == []
    # the option set in the same layer as the kind, or above it, is refused
    assert errors(ds, ["backend.kind=fsdp", "backend.deepspeed.zero_stage=2"])
    assert errors({**ds, "local": {"backend": {"deepspeed": {"zero_stage": 2}}}}, ["backend.kind=fsdp"], "local") == []
    assert errors({**ds, "local": {"backend": {"kind": "fsdp"}}}, ["backend.deepspeed.zero_stage=2"], "local")


def test_a_site_files_options_are_defaults_for_every_kind(tmp_path, monkeypatch):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"backend": {"deepspeed": {"offload_optimizer": "cpu"}}}))
    monkeypatch.setenv("HPC_TOOLS_SITE", str(site))
    from hpc_tools.recipe.load import read_yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**BASE, "backend": {"kind": "megatron"}}))
    assert load_recipe(recipe).backend.deepspeed.offload_optimizer == "cpu"
    assert errors(read_yaml(recipe)) == []


def test_resolved_recipes_and_planner_copies_are_judged_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_TOOLS_SITE", "none")
    recipe = load_recipe(REPO / "recipes" / "deepseek_v3.yaml", profile="local")  # fp8 null over blockwise
    assert recipe.training.fp8 is None and recipe.training.fp8_recipe == "blockwise"
    written = tmp_path / "recipe.yaml"
    written.write_text(dump_resolved(recipe))
    assert load_resolved(written).training.fp8_recipe == "blockwise"  # a run folder's recipe loads (resume, export)
    assert load_recipe(written).training.fp8_recipe == "blockwise"  # by any path (recognised as resolved)
    gpt = tmp_path / "gpt.yaml"  # every default written: fp8_recipe beside fp8: null, all kinds' options
    gpt.write_text(dump_resolved(load_recipe(REPO / "recipes" / "gpt_3d.yaml")))
    assert load_recipe(gpt).backend.kind == "megatron"
    from hpc_tools.recipe.rules import check_recipe

    ds = resolve({**BASE, "parallel": {"tensor_size": 1}, "backend": {"kind": "deepspeed",
                                                                      "deepspeed": {"zero_stage": 3}}})
    switched = ds.model_copy(update={"backend": ds.backend.model_copy(update={"kind": "fsdp"})})
    assert not [v for v in check_recipe(switched) if v.path.startswith("backend.deepspeed")]
