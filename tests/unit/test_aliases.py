"""The names users already know (recipe/aliases.py): every alias names a real field, an unknown key that another
library uses gets its field here in one line wherever it is written, and `validate --explain` knows the names."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from hpc_tools.cli import main
from hpc_tools.recipe import aliases
from hpc_tools.recipe.explain import explain
from hpc_tools.recipe.fields import iter_paths, leaf_paths
from tests.helpers import run_cli
from tests.unit.test_recipe_rules import BASE

SECTIONS = {path for path, is_section in iter_paths() if is_section}


def test_every_alias_names_a_real_field_or_section_or_says_how_it_is_derived():
    leaves = set(leaf_paths())
    assert len(aliases.ALIASES) == len(aliases.TABLE), "a name is in the table twice"
    for a in aliases.TABLE:
        assert a.known_as and all(a.known_as), a.name
        assert ".".join(aliases.lookup_name(p) for p in a.name.split(".")) == a.name, a.name
        if a.target is None:
            assert a.note, f"{a.name}: a name derived here says how"
        else:
            assert a.target in leaves or a.target in SECTIONS, (a.name, a.target)
        assert a.name not in leaves and a.name not in SECTIONS, f"{a.name} is the recipe's own path"


def test_megatron_core_names_are_fields_of_its_configs():
    core = pytest.importorskip("megatron.core.transformer.transformer_config")
    import dataclasses
    import inspect

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    classes = {"TransformerConfig": core.TransformerConfig, "MLATransformerConfig": core.MLATransformerConfig,
               "DistributedDataParallelConfig": DistributedDataParallelConfig, "OptimizerConfig": OptimizerConfig}
    from megatron.core.models.gpt import GPTModel

    model_args = set(inspect.signature(GPTModel.__init__).parameters)
    checked = 0
    for a in aliases.TABLE:
        for spelling in a.known_as:
            field = re.fullmatch(r"Megatron-core's (\w+)\.(\w+)", spelling)
            arg = re.fullmatch(r"Megatron-core's GPTModel\((\w+)\)", spelling)
            if field:
                assert field.group(2) in {f.name for f in dataclasses.fields(classes[field.group(1)])}, spelling
            if arg:
                assert arg.group(1) in model_args, spelling
            checked += bool(field or arg)
    assert checked >= 40


# (where the key is written, the foreign key, its value, what the one line must say)
FOREIGN = [
    ((), "tensor_model_parallel_size", 2, "`parallel.tensor_size` here"),
    (("model",), "num_moe_experts", 8, "`model.num_experts` here"),
    (("parallel",), "expert_model_parallel_size", 8, "`parallel.expert_size` here"),
    (("parallel",), "num_layers_per_virtual_pipeline_stage", 2,
     "virtual_pipeline_size = num_layers / (pipeline_size x n)"),
    (("training",), "fp8_format", "hybrid", "`training.fp8` here"),
    (("training",), "gradient_accumulation_steps", 4, "derived here: global_batch_size / (micro_batch_size x"),
    (("backend",), "use_distributed_optimizer", True, "`backend.megatron.distributed_optimizer` here"),
    (("backend", "megatron"), "sequence_parallel", True, "`parallel.sequence_parallel` here"),
    (("backend", "deepspeed"), "train_micro_batch_size_per_gpu", 2, "`training.micro_batch_size` here"),
    (("backend", "fsdp"), "sharding_strategy", "HYBRID_SHARD", "`backend.fsdp.strategy` here"),
    (("data",), "data_path", "x", "`data.blend` here"),
    (("checkpoint",), "async_mode", "async", "`checkpoint.async_save` here"),
    (("checkpoint",), "interval", 500, "`checkpoint.interval_iters` here"),
    (("cluster",), "context_parallel_degree", 2, "torchtitan's parallelism.context_parallel_degree is "
                                                 "`parallel.context_size` here"),
    (("profiling",), "log_freq", 10, "`training.log_interval` here"),
    (("tracking",), "wandb_project", "p", "`tracking.wandb.project` here"),
    (("tracking", "wandb"), "log_freq", 10, "`training.log_interval` here"),
    (("cluster", "setup"), "num_layers", 4, "`model.num_layers` here"),
    (("profiling", "torch_profiler"), "train_iters", 4, "`training.train_iters` here"),
    (("sweep",), "seq_length", 4, "`model.seq_length` here"),
    ((), "parallelism", {"tensor_parallel_degree": 2}, "section `parallel` here"),
    ((), "activation_checkpoint", {"mode": "full"}, "activation_checkpoint.mode is `training.recompute_granularity`"),
    (("training",), "--Expert-Model-Parallel-Size", 8, "`parallel.expert_size` here"),
]


def _recipe_with(tmp_path, where: tuple[str, ...], key: str, value, name: str = "r.yaml") -> str:
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    node = raw
    for part in where:
        node = node.setdefault(part, {})
    node[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _one_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    code = main(argv)
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2 and not out.out.strip(), (code, out.out[:300])
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("where,key,value,needle", FOREIGN, ids=lambda x: x if isinstance(x, str) else None)
def test_a_foreign_name_in_any_section_gets_its_field_here_in_one_line(capsys, tmp_path, where, key, value,
                                                                       needle):
    path = ".".join([*where, key])
    line = _one_error(capsys, ["validate", "--offline", _recipe_with(tmp_path, where, key, value)])
    assert f"{path}=" in line and "is not a known key" in line and needle in line, line
    assert "did you mean" not in line and "valid keys" not in line, line
    # the same key given with --set gets the same line
    base = _recipe_with(tmp_path, (), "description", "", "base.yaml")
    value_text = json.dumps(value) if not isinstance(value, str) else value
    assert _one_error(capsys, ["validate", "--offline", base, "--set", f"{path}={value_text}"]).split(": ", 2)[2] \
        == line.split(": ", 2)[2]


def test_the_issues_examples_through_the_command_line(tmp_path):
    # Megatron-LM's names used to get "did you mean 'expert_tensor_size'?" and "'fp8_recipe'" (string distance)
    path = _recipe_with(tmp_path, (), "description", "")
    for setting, right, wrong in [("parallel.expert_model_parallel_size=8", "`parallel.expert_size`",
                                   "expert_tensor_size"),
                                  ("training.fp8_format=hybrid", "`training.fp8`", "fp8_recipe")]:
        out = run_cli("validate", path, "--offline", "--set", setting)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and not out.stdout.strip(), out.stderr
        assert right in lines[0] and "Megatron-LM's --" in lines[0] and wrong not in lines[0], lines[0]


def test_a_misspelt_foreign_name_is_not_sent_to_a_field_of_another_meaning(capsys, tmp_path):
    line = _one_error(capsys, ["validate", "--offline",
                               _recipe_with(tmp_path, ("parallel",), "expert_model_paralel_size", 8)])
    assert "'expert_model_parallel_size', which is `parallel.expert_size` here" in line, line
    assert "did you mean 'expert_tensor_size'" not in line
    # a plain misspelling of the recipe's own key still gets the nearest key
    line = _one_error(capsys, ["validate", "--offline", _recipe_with(tmp_path, ("parallel",), "tensorr_size", 2)])
    assert "did you mean 'tensor_size'?" in line, line
    # a key of another section is named there
    line = _one_error(capsys, ["validate", "--offline", _recipe_with(tmp_path, ("cluster",), "max_nonfinite_steps", 2)])
    assert "it is `training.max_nonfinite_steps`, in another section" in line, line


def test_explain_of_an_alias_explains_the_field_it_is_here():
    out = run_cli("validate", "--explain", "expert_model_parallel_size")
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[0].startswith("expert_model_parallel_size: Megatron-LM's "), out.stdout
    assert "is `parallel.expert_size` here" in lines[0] and lines[1] == "parallel.expert_size"
    data = json.loads(run_cli("validate", "--explain", "expert_model_parallel_size", "--json").stdout)
    assert data["name"] == "parallel.expert_size" and data["alias"]["name"] == "expert_model_parallel_size"
    # torchtitan's dotted name and a name derived here
    assert explain("checkpoint.interval")["name"] == "checkpoint.interval_iters"
    misspelt = run_cli("validate", "--explain", "expert_model_paralel_size")
    assert misspelt.returncode == 2 and "did you mean expert_model_parallel_size?" in misspelt.stderr
    derived = explain("gradient_accumulation_steps")
    assert derived["kind"] == "alias" and derived["target"] is None and "global_batch_size" in derived["note"]


def test_explain_of_a_field_lists_its_names_in_the_other_libraries():
    info = explain("parallel.tensor_size")
    names = {a["name"] for a in info["known_as"]}
    assert {"tensor_model_parallel_size", "tensor_parallel_degree"} <= names
    assert names == {a.name for a in aliases.TABLE if a.target == "parallel.tensor_size"}
    out = run_cli("validate", "--explain", "training.fp8")
    assert "  known elsewhere as:" in out.stdout and "Megatron-LM's --fp8-format" in out.stdout


def test_explain_of_a_section_names_the_tables_it_is_elsewhere():
    assert {a["name"] for a in explain("parallel")["known_as"]} == {"parallelism"}
    out = run_cli("validate", "--explain", "backend.deepspeed")
    assert out.returncode == 0 and "known elsewhere as DeepSpeed's zero_optimization" in out.stdout.splitlines()[0]


def test_a_foreign_name_in_the_local_profile_gets_its_field_too(tmp_path):
    raw = yaml.safe_load(yaml.safe_dump(BASE))
    raw["local"] = {"parallel": {"expert_model_parallel_size": 2}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = run_cli("validate", str(path), "--offline")
    [line] = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "(profile local): parallel.expert_model_parallel_size=2 is not a known key" in line
    assert "`parallel.expert_size` here" in line, line
