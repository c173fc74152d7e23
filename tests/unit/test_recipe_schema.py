"""Recipe schema: strict keys with suggestions, family defaults, profiles and override precedence."""

from __future__ import annotations

import pytest
import yaml

from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.load import dump_resolved, load_recipe, parse_override, resolve
from hpc_tools.recipe.yamlfile import parse_yaml
from tests.helpers import RECIPES

MINIMAL = {"name": "t", "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                                  "vocab_size": 512},
           "cluster": {"nodes": 1, "gpus_per_node": 4, "gpu_type": "cpu"}}


def messages(exc: RecipeError) -> list[str]:
    return [str(v) for v in exc.violations]


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
@pytest.mark.parametrize("profile", [None, "local"])
def test_shipped_recipes_are_valid(path, profile):
    recipe = load_recipe(path, profile=profile)
    assert recipe.name == path.stem


def test_unknown_key_names_the_nearest_valid_key():
    raw = {**MINIMAL, "parallel": {"tensor_sise": 2}}
    with pytest.raises(RecipeError) as exc:
        resolve(raw)
    (msg,) = messages(exc.value)
    assert msg.startswith("parallel.tensor_sise=2 is not a known key")
    assert "did you mean 'tensor_size'" in msg and "valid keys: tensor_size, pipeline_size" in msg


def test_unknown_section_is_an_error():
    with pytest.raises(RecipeError) as exc:
        resolve({**MINIMAL, "trainig": {}})
    assert "did you mean 'training'" in messages(exc.value)[0]


def test_missing_required_field_says_what_to_add():
    raw = {**MINIMAL, "model": {k: v for k, v in MINIMAL["model"].items() if k != "hidden_size"}}
    with pytest.raises(RecipeError) as exc:
        resolve(raw)
    assert messages(exc.value) == ["model.hidden_size is required (add it: Model width (h).)"]


def test_wrong_type_and_literal_are_reported_together():
    raw = {**MINIMAL, "training": {"micro_batch_size": "two", "precision": "fp8"}}
    with pytest.raises(RecipeError) as exc:
        resolve(raw)
    msgs = messages(exc.value)
    assert any(m.startswith("training.micro_batch_size=two") and "give an integer" in m for m in msgs)
    assert any(m.startswith("training.precision=fp8 is not one of the allowed values") and "'bf16'" in m for m in msgs)


def test_family_defaults_are_explicit_after_resolution():
    llama = resolve({**MINIMAL, "model": {**MINIMAL["model"], "family": "llama"}})
    m = llama.model
    assert (m.normalization, m.activation, m.position_embedding) == ("RMSNorm", "swiglu", "rope")
    assert llama.model.untie_embeddings is True and llama.model.num_query_groups == 4
    assert llama.model.ffn_hidden_size == 192  # 8*64/3 = 170.7 -> rounded up to a multiple of 64
    gpt = resolve(MINIMAL)
    assert gpt.model.ffn_hidden_size == 256 and gpt.model.normalization == "LayerNorm"


def test_resolved_dump_round_trips():
    recipe = load_recipe(RECIPES[0])
    text = dump_resolved(recipe)
    assert dump_resolved(resolve(yaml.safe_load(text))) == text
    assert "local:" not in text


def test_precedence_defaults_recipe_profile_cli():
    raw = {**MINIMAL, "training": {"lr": 0.1, "train_iters": 7},
           "local": {"training": {"lr": 0.2}}}
    assert resolve(raw).training.adam_beta2 == 0.95                      # default
    assert resolve(raw).training.lr == 0.1                               # recipe over default
    assert resolve(raw, profile="local").training.lr == 0.2              # profile over recipe
    assert resolve(raw, profile="local").training.train_iters == 7       # profile is partial
    assert resolve(raw, ["training.lr=0.3"], profile="local").training.lr == 0.3  # --set over profile
    assert resolve(raw, ["training.lr=0.3", "training.lr=0.4"]).training.lr == 0.4  # last --set wins


def test_override_values_are_typed_as_yaml():
    assert parse_override("parallel.tensor_size=4") == (["parallel", "tensor_size"], 4)
    assert parse_override("parallel.sequence_parallel=true") == (["parallel", "sequence_parallel"], True)
    assert parse_override("cluster.time_limit=01:00:00")[1] == "01:00:00"
    with pytest.raises(UserError, match="must look like section.key=value"):
        parse_override("parallel.tensor_size")


def test_override_into_a_value_is_refused():
    with pytest.raises(UserError, match="is a value, not a section"):
        resolve(MINIMAL, ["model.num_layers.x=1"])


def test_bad_yaml_is_one_line_with_location():
    with pytest.raises(UserError) as exc:
        parse_yaml("name: x\nmodel: [1,\n", "r.yaml")
    assert "\n" not in str(exc.value) and "r.yaml: line" in str(exc.value)


def test_unknown_profile_section_is_refused():
    with pytest.raises(RecipeError) as exc:
        resolve({**MINIMAL, "local": {"modle": {}}})
    assert "local" in messages(exc.value)[0] and "'modle'" in messages(exc.value)[0]


def test_slurm_strings_cannot_carry_options():
    with pytest.raises(RecipeError) as exc:
        resolve({**MINIMAL, "cluster": {**MINIMAL["cluster"], "partition": "gpu --uid=0"}})
    assert messages(exc.value)[0].startswith("cluster.partition=") and "valid Slurm name" in messages(exc.value)[0]
    for field, value in (("partition", "gpu\n#SBATCH --uid=0"), ("time_limit", "10\n"), ("qos", "normal\n")):
        # `re.match(...$)` took a trailing newline, which ended the #SBATCH block early: now every field refuses it
        with pytest.raises(RecipeError) as exc:
            resolve({**MINIMAL, "cluster": {**MINIMAL["cluster"], field: value}})
        assert messages(exc.value)[0].startswith(f"cluster.{field}=") and "holds a newline" in messages(exc.value)[0]
        assert "\n" not in messages(exc.value)[0]


@pytest.mark.parametrize("override,start,fix", [
    ("cluster.gpus_per_node=0", "cluster.gpus_per_node=0 input should be greater than 0", "choose a value in range"),
    ("cluster.time_limit=4h", "cluster.time_limit=4h is not in Slurm's --time format", "e.g. 04:00:00"),
    ("cluster.setup.env={'BAD-NAME': x}", "cluster.setup.env=", "use letters, digits and _"),
    ("name='two words'", "name='two words' is not a valid job name", "use 1-64 letters"),
    ("parallel.tensor_size=0", "parallel.tensor_size=0 input should be greater than 0", "choose a value in range"),
])
def test_field_constraints_name_field_and_fix(override, start, fix):
    with pytest.raises(RecipeError) as exc:
        resolve(MINIMAL, [override])
    (msg,) = messages(exc.value)
    assert msg.startswith(start) and fix in msg, msg


def test_time_limit_in_minutes_as_a_yaml_integer():
    recipe = resolve(MINIMAL, ["cluster.time_limit=90"])
    assert recipe.cluster.time_limit == "90" and recipe.cluster.time_limit_min == 90
