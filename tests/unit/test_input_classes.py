"""Classes of input answered in one line, the cases generated from the schema itself: every integer or number field
refuses booleans and YAML's words for them, every boolean field refuses numbers and other strings, `--set local.*`
reaches the local profile, one root cause gives one line, a setting that would do nothing is refused (or, when valid
but unusual, noted), and the numbers reported are the ones the user wrote or the GPU holds.

Each refusal runs through the real command (``hpc_tools.cli.main``, in this process) as users run it: exit 2, exactly
one line, naming the field and the value as written, and nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from hpc_tools.cli import main
from hpc_tools.recipe.base import scalar_kinds
from hpc_tools.recipe.fields import field_at, leaf_paths
from tests.helpers import REPO

BASE = {"name": "classes", "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                     "vocab_size": 512},
        "training": {"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 20},
        "cluster": {"nodes": 1, "gpus_per_node": 2, "gpu_type": "cpu", "time_limit": "00:10:00",
                    "signal_delay_s": 30}}


def kinds(path: str) -> tuple[frozenset[str], frozenset[str]]:
    return scalar_kinds(field_at(path.split(".")).annotation)


def number_fields() -> list[str]:
    """Every leaf taking an integer or a number and neither a boolean nor a string, found by walking the schema."""
    return [p for p in leaf_paths() if (s := kinds(p)[0]) & {"int", "float"} and not s & {"bool", "str"}]


def bool_fields() -> list[str]:
    """Every leaf taking true/false and neither a number nor a string."""
    return [p for p in leaf_paths() if "bool" in (s := kinds(p)[0]) and not s & {"int", "float", "str"}]


def number_list_fields() -> list[str]:
    """Every leaf holding a list of integers (``profiling.torch_profiler.ranks``)."""
    return [p for p in leaf_paths() if kinds(p)[1] & {"int"} and not kinds(p)[1] & {"bool", "str"}]


def write_recipe(tmp: Path, data: dict | None = None) -> str:
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(data or BASE, sort_keys=False))
    return str(path)


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def argv_for(command: str, recipe: str, tmp: Path, *extra: str) -> list[str]:
    """The command on ``recipe`` with its outputs pointed into ``tmp/out`` (which must stay absent)."""
    if command == "validate":
        return ["validate", recipe, "--offline", "--no-fit", *extra]
    if command == "render":
        return ["render", recipe, "--jobs-dir", str(tmp / "out"), *extra]
    return ["submit", recipe, "--dry-run", "--executor", "local", "--force", "--runs-dir", str(tmp / "out"), *extra]


def refused(capsys, tmp: Path, command: str, *extra: str, data: dict | None = None) -> str:
    """The one line a refused command prints (asserting exit 2, one line, nothing written)."""
    jobs_before = sorted((REPO / "jobs").iterdir())
    code, out, err = run(capsys, argv_for(command, write_recipe(tmp, data), tmp, *extra))
    # validate also says `ok:` for a profile that is valid (a recipe with a local profile is checked both ways)
    lines = [ln for ln in (out + err).strip().splitlines() if not (command == "validate" and ln.startswith("ok: "))]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not (tmp / "out").exists(), "something was written"
    assert sorted((REPO / "jobs").iterdir()) == jobs_before
    return lines[0]


# --- strict scalar types ----------------------------------------------------------------------------------------------

# (what is written after --set path=, as it shows in the error)
BOOLEANS_FOR_NUMBERS = [("true", "true"), ("false", "false"), ("yes", "yes"), ("on", "on"), ("Off", "Off"),
                        ("'true'", "true"), ("'no'", "no")]
NUMBERS_FOR_BOOLEANS = [("1", "1"), ("0", "0"), ("2", "2"), ("1.0", "1.0"), ("'1'", "1"), ("'t'", "t")]


def test_the_schema_has_fields_of_every_class():
    # the cases below are generated from these lists: they must not be empty by a change in how fields are typed
    assert {"model.moe_router_topk", "cluster.restarts", "model.num_experts", "training.lr",
            "backend.deepspeed.zero_stage", "model.moe_layer_freq"} <= set(number_fields())
    assert {"parallel.sequence_parallel", "checkpoint.resume", "model.untie_embeddings"} <= set(bool_fields())
    assert "profiling.torch_profiler.ranks" in number_list_fields()


@pytest.mark.parametrize("path", number_fields())
def test_a_number_field_refuses_booleans_as_written(capsys, tmp_path, path):
    for command in ("validate", "render", "submit"):
        for written, shown in BOOLEANS_FOR_NUMBERS if command == "validate" else BOOLEANS_FOR_NUMBERS[2:3]:
            line = refused(capsys, tmp_path, command, "--set", f"{path}={written}")
            assert f" {path}={shown} " in line and "not a number" in line, (command, written, line)


@pytest.mark.parametrize("path", bool_fields())
def test_a_boolean_field_refuses_numbers_and_other_strings(capsys, tmp_path, path):
    for command in ("validate", "render", "submit"):
        for written, shown in NUMBERS_FOR_BOOLEANS if command == "validate" else NUMBERS_FOR_BOOLEANS[:1]:
            line = refused(capsys, tmp_path, command, "--set", f"{path}={written}")
            assert f" {path}={shown} " in line and "give true or false" in line, (command, written, line)


@pytest.mark.parametrize("path", number_list_fields())
def test_a_list_of_integers_refuses_a_boolean_item(capsys, tmp_path, path):
    line = refused(capsys, tmp_path, "validate", "--set", f"{path}=[0, true]")
    assert f" {path}=[0, true] item 1 is a boolean" in line, line


def test_a_boolean_written_in_a_recipe_file_is_quoted_as_written(capsys, tmp_path):
    text = yaml.safe_dump(BASE, sort_keys=False).replace("train_iters: 20", "train_iters: yes")
    (tmp_path / "recipe.yaml").write_text(text + "checkpoint:\n  interval_iters: on\n")
    code, out, err = run(capsys, argv_for("validate", str(tmp_path / "recipe.yaml"), tmp_path))
    lines = (out + err).strip().splitlines()
    assert code == 2 and len(lines) == 2, lines  # two fields wrong: one line each
    assert any(" training.train_iters=yes is a word for true or false" in ln for ln in lines), lines
    assert any(" checkpoint.interval_iters=on is a word for true or false" in ln for ln in lines), lines


def test_yaml_words_for_booleans_still_set_boolean_fields(capsys, tmp_path):
    recipe = write_recipe(tmp_path)
    code, out, _ = run(capsys, ["render", recipe, "-o", "-", "--set", "checkpoint.resume=no", "--set",
                                "parallel.sequence_parallel=off", "--set", "checkpoint.async_save=false"])
    assert code == 0
    assert "  resume: false\n" in out and "  sequence_parallel: false\n" in out
    from hpc_tools.recipe.load import resolve

    ds = resolve(BASE, ["backend.kind=deepspeed", "backend.deepspeed.config_overrides={wall_clock_breakdown: yes}"])
    assert ds.backend.deepspeed.config_overrides == {"wall_clock_breakdown": True}  # JSON's boolean, as before


# --- the local profile ------------------------------------------------------------------------------------------------

WITH_LOCAL = {**BASE, "local": {"training": {"train_iters": 10}}}


def rendered_iters(capsys, tmp: Path, *extra: str) -> str:
    code, out, err = run(capsys, ["render", write_recipe(tmp, WITH_LOCAL), "-o", "-", *extra])
    assert code == 0, err
    return next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("train_iters:"))


def test_set_local_applies_to_the_local_profile_and_only_with_it(capsys, tmp_path):
    assert rendered_iters(capsys, tmp_path, "--profile", "local") == "train_iters: 10"
    assert rendered_iters(capsys, tmp_path, "--profile", "local", "--set", "local.training.train_iters=7") == \
        "train_iters: 7"
    assert rendered_iters(capsys, tmp_path, "--set", "local.training.train_iters=7") == "train_iters: 20"
    # a profile made by --set alone
    code, out, _ = run(capsys, ["render", write_recipe(tmp_path), "-o", "-", "--profile", "local", "--set",
                                "local.training.train_iters=3"])
    assert code == 0 and "  train_iters: 3\n" in out
    # --set of the recipe's own value still beats the profile (precedence: profile < --set)
    assert rendered_iters(capsys, tmp_path, "--profile", "local", "--set", "local.training.train_iters=7",
                          "--set", "training.train_iters=5") == "train_iters: 5"


@pytest.mark.parametrize("command", ["validate", "render", "submit"])
@pytest.mark.parametrize("profile", [[], ["--profile", "local"]], ids=["without-profile", "with-profile"])
def test_a_bad_local_value_is_refused_whether_or_not_the_profile_is_used(capsys, tmp_path, command, profile):
    line = refused(capsys, tmp_path, command, *profile, "--set", "local.training.train_iters=yes", data=WITH_LOCAL)
    assert " training.train_iters=yes " in line, line
    if not profile and command != "submit":  # (submit --executor local takes the local profile itself)
        assert "(profile local)" in line, line  # the value is the profile's, and the line says so


@pytest.mark.parametrize("command", ["validate", "render"])
def test_set_local_of_something_not_a_section_is_refused(capsys, tmp_path, command):
    line = refused(capsys, tmp_path, command, "--profile", "local", "--set", "local.name=x", data=WITH_LOCAL)
    assert "local.name is not a section a profile may set" in line


# --- one root cause, one line ---------------------------------------------------------------------------------------

MOE = {**BASE, "model": {**BASE["model"], "num_experts": 4},
       "cluster": {**BASE["cluster"], "nodes": 2, "gpus_per_node": 2}, "training": {**BASE["training"],
                                                                                    "global_batch_size": 8}}


@pytest.mark.parametrize("overrides, start, fix, absent", [
    # an invalid CP: no sequence-length line computed from it (nor the CPU one: same value, one line)
    (["parallel.context_size=3"], "parallel.context_size=3 x parallel.tensor_size=1 x parallel.pipeline_size=1 "
     "must divide the world size", "try 1, 2, 4", "seq_length"),
    # an invalid TP: the heads and the world are one line (fix: what both admit), no batch line from the layout
    (["parallel.tensor_size=3"], "parallel.tensor_size=3 x parallel.pipeline_size=1 must divide the world size "
     "cluster.nodes x cluster.gpus_per_node = 4 and must divide model.num_attention_heads=4", "(try 1, 2, 4)",
     "global_batch_size"),
    (["parallel.tensor_size=3", "model.num_attention_heads=8", "model.hidden_size=128"],
     "parallel.tensor_size=3", "(try 1, 2, 4)", "global_batch_size"),
    # EP bound by num_experts and by the world: one line, the intersection (8 experts, 4 ranks: 1, 2, 4)
    (["parallel.expert_size=3", "model.num_experts=8"], "parallel.expert_size=3 must divide model.num_experts=8 "
     "and x parallel.expert_tensor_size=1 must divide tensor x context x data", "(try 1, 2, 4)", "try 1, 2, 4, 8"),
    # no expert_size fits the expert_tensor_size written: that is the value named, with the values that can fit
    (["parallel.expert_tensor_size=3", "model.add_bias_linear=false"], "parallel.expert_tensor_size=3 x "
     "parallel.expert_size=1 must divide tensor x context x data = world / pipeline = 4",
     "(no expert_size fits it: try 1, 2, 4 for expert_tensor_size)", "parallel.expert_size=1 x"),
    # ... and with expert biases (GPT), which need ETP 1: one line, whose fix is what both admit
    (["parallel.expert_tensor_size=3"], "parallel.expert_tensor_size=3 x parallel.expert_size=1 must divide",
     "and must be 1 when the experts have biases", "try 1, 2"),
    # a union field: what it accepts in words, no pydantic member tags
    (["model.moe_layer_freq=[1, 2, 1, 1]"], "model.moe_layer_freq=[1, 2, 1, 1] is not a value this field takes",
     "integer", "literal"),
    (["model.moe_layer_freq=-1"], "model.moe_layer_freq=-1 is not a value this field takes", "list of 0/1",
     "constrained-int"),
])
def test_one_root_cause_is_one_line(capsys, tmp_path, overrides, start, fix, absent):
    line = refused(capsys, tmp_path, "validate", *[x for o in overrides for x in ("--set", o)], data=MOE)
    assert line.split(": ", 2)[2].startswith(start), line
    assert fix in line and absent not in line, line


# --- settings that would do nothing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, needle", [
    (["checkpoint.local_dir=ckpt/local", "checkpoint.local_interval_iters=5"],
     "checkpoint.local_dir=ckpt/local is a relative path"),
    (["checkpoint.local_dir=/tmp/x", "checkpoint.local_interval_iters=20"],
     "checkpoint.local_interval_iters=20 is never reached: training.train_iters=20 ends first"),
    (["checkpoint.local_dir=/tmp/x", "checkpoint.local_interval_iters=10", "checkpoint.interval_iters=5"],
     "checkpoint.local_interval_iters=10 falls only on steps that checkpoint.interval_iters=5 saves"),
    (["checkpoint.local_dir=/tmp/x", "checkpoint.local_interval_iters=5", "checkpoint.interval_iters=5"],
     "(use a value below 5)"),
    (["training.fp8_recipe=blockwise"], "training.fp8_recipe=blockwise is read only with training.fp8"),
    (["model.moe_router_topk=2"], "model.moe_router_topk=2 is read only with model.num_experts"),
    (["model.moe_aux_loss_coeff=0.01"], "model.moe_aux_loss_coeff=0.01 is read only with model.num_experts"),
    (["model.num_experts=4", "model.moe_layer_freq=[0, 0, 0, 0]"],
     "model.moe_layer_freq=[0, 0, 0, 0] has no 1: no layer is MoE"),
    (["training.recompute_num_layers=2"], "training.recompute_num_layers=2 is read only with "
     "training.recompute_granularity=full"),
    (["training.recompute_method=block"], "training.recompute_method=block is read only with"),
    (["checkpoint.local_replicate=false"], "checkpoint.local_replicate=false is read only with checkpoint.local_dir"),
])
@pytest.mark.parametrize("command", ["validate", "render", "submit"])
def test_a_setting_that_would_do_nothing_is_refused(capsys, tmp_path, command, overrides, needle):
    line = refused(capsys, tmp_path, command, *[x for o in overrides for x in ("--set", o)])
    assert needle in line, line


def test_a_feature_turned_off_on_purpose_leaves_its_options_alone(capsys, tmp_path):
    # a profile that turns FP8 or the experts off keeps the recipe's fp8_recipe / router options: no error (FP8 is
    # turned off above the file that sets fp8_recipe: beside fp8: null in one layer, fp8_recipe is refused, issue 47)
    fp8 = {**BASE, "training": {**BASE.get("training", {}), "fp8_recipe": "blockwise"}}
    code, out, err = run(capsys, argv_for("validate", write_recipe(tmp_path, fp8), tmp_path,
                                          "--set", "training.fp8=null"))
    assert code == 0, out + err
    for extra in (["model.num_experts=null", "model.moe_router_topk=2"],
                  ["training.recompute_granularity=none", "training.recompute_num_layers=2"],
                  ["checkpoint.local_dir=null", "checkpoint.local_replicate=false"]):
        code, out, err = run(capsys, argv_for("validate", write_recipe(tmp_path), tmp_path,
                                              *[x for o in extra for x in ("--set", o)]))
        assert code == 0, out + err


@pytest.mark.parametrize("command", ["validate", "render", "submit"])
def test_more_spares_than_nodes_is_a_note(capsys, tmp_path, command):
    extra = ["--set", "cluster.restarts=1", "--set", "cluster.spare_nodes=2", "-o", "-"] if command == "render" \
        else ["--set", "cluster.restarts=1", "--set", "cluster.spare_nodes=2"]
    argv = argv_for(command, write_recipe(tmp_path), tmp_path, *extra)
    if command == "render":
        argv = [a for a in argv if a not in ("--jobs-dir", str(tmp_path / "out"))]
    code, _, err = run(capsys, argv)
    notes = [ln for ln in err.splitlines() if ln.startswith("note: ")]
    assert code == 0 and len(notes) == 1, err
    assert notes[0].startswith("note: cluster.spare_nodes=2 exceeds cluster.nodes=1"), notes


def test_a_sweep_cell_with_restarts_is_its_own_job_not_an_array_task():
    from hpc_tools.recipe.load import resolve
    from hpc_tools.sweep.runner import slurm_groups

    cells = [{"id": f"c{i}"} for i in range(4)]
    plain, restarting = resolve(BASE), resolve(BASE, ["cluster.restarts=2"])
    recipes = {"c0": plain, "c1": plain, "c2": restarting, "c3": restarting}
    groups = sorted(slurm_groups(cells, recipes).values())
    assert groups == [["c0", "c1"], ["c2"], ["c3"]]


# --- the numbers reported -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, overrides, shard, bytes_per_param", [
    ("recipes/llama_fsdp.yaml", ["backend.fsdp.strategy=full_shard"], 16, 4),  # fp32 master copy, over all 16
    ("recipes/llama_fsdp.yaml", ["backend.fsdp.strategy=hybrid_shard"], 8, 4),  # over one node's 8
    ("recipes/gpt_zero.yaml", ["backend.deepspeed.zero_stage=3"], 16, 2),  # bf16 parameters over DP16
    ("recipes/gpt_zero.yaml", ["backend.deepspeed.zero_stage=2"], 1, 2),  # ZeRO-2 keeps every parameter
])
def test_parameters_per_gpu_are_those_one_gpu_holds(capsys, recipe, overrides, shard, bytes_per_param):
    argv = ["plan", str(REPO / recipe), "--json", "--calibration", "/nonexistent/calibration.json",
            *[x for o in overrides for x in ("--set", o)]]
    code, out, _ = run(capsys, argv)
    assert code in (0, 1)
    plan = json.loads(out)
    per_gpu = plan["parameters_per_gpu"]
    assert per_gpu == pytest.approx(plan["parameters"] / shard, rel=0.02)  # TP1 x PP1: the whole model, sharded
    params_term = next(t["bytes"] for t in plan["memory"]["terms"] if t["name"] == "parameters")
    assert params_term == pytest.approx(bytes_per_param * per_gpu, rel=1e-6)  # what the memory terms hold
    assert plan["memory"]["stages"][0]["parameters"] == pytest.approx(per_gpu)


def test_the_plan_table_names_the_parameters_one_gpu_holds(capsys):
    from hpc_tools.planner.report import count

    argv = ["plan", str(REPO / "recipes/llama_fsdp.yaml"), "--calibration", "/nonexistent/calibration.json",
            "--set", "backend.fsdp.strategy=full_shard"]
    code, out, _ = run(capsys, [*argv, "--json"])
    per_gpu = json.loads(out)["parameters_per_gpu"]
    code, out, _ = run(capsys, argv)
    assert code in (0, 1) and f"; {count(per_gpu)} parameters on it" in out, out[:2000]
    assert per_gpu < json.loads(run(capsys, [*argv, "--json"])[1])["parameters"] / 8


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")
                                          if "local" in yaml.safe_load(p.read_text())))
@pytest.mark.parametrize("field", ["training.train_iters", "cluster.nodes", "training.global_batch_size"])
def test_a_value_both_profiles_refuse_is_one_line(capsys, recipe, field):
    """A --set value that the recipe as written and its local profile both refuse is one cause: one line, saying
    that it holds for both (validate checks a recipe with a local profile both ways)."""
    code, out, err = run(capsys, ["validate", "--offline", str(REPO / "recipes" / recipe), "--set", f"{field}=yes"])
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert "(and its local profile)" in lines[0] and f"{field}=yes" in lines[0], lines[0]
