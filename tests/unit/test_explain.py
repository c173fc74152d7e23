"""`validate --explain` and `validate --rules`: the reference from the schema, and every hint that points at them."""

from __future__ import annotations

import json
import re

import pytest

from hpc_tools.errors import RecipeError
from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.docstrings import documented
from hpc_tools.recipe.explain import explain
from hpc_tools.recipe.fields import iter_paths, leaf_paths, schema_path
from hpc_tools.recipe.load import load_recipe, resolve
from hpc_tools.recipe.parallel import ParallelConfig
from hpc_tools.recipe.pydantic_errors import violation_from_pydantic
from hpc_tools.recipe.rules import RULES
from tests.helpers import REPO, run_cli
from tests.unit.test_recipe_rules import BASE, CASES, HIDDEN_PACKAGES

HINT = re.compile(r"`(python -m hpc_tools [^`]+)`")


def test_explain_field_prints_type_default_bounds_doc_and_rules():
    out = run_cli("validate", "--explain", "parallel.tensor_size")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "parallel.tensor_size"
    assert "  type: integer" in lines and "  default: 1" in lines and "  constraints: > 0, <= 1048576" in lines
    assert "  " + documented(ParallelConfig).model_fields["tensor_size"].description in lines
    readers = [r.name for r in RULES if "parallel.tensor_size" in r.reads]
    assert "heads_divisible_by_tensor" in readers and "layout_fills_world" in readers
    assert [ln.split(":")[0].strip() for ln in lines[lines.index("  rules that read it:") + 1:]] == readers


def test_explain_section_lists_its_fields_and_recipe_lists_the_sections():
    out = run_cli("validate", "--explain", "parallel")
    assert out.returncode == 0 and out.stdout.startswith("section parallel")
    listed = [ln.split()[0] for ln in out.stdout.splitlines()[1:]]
    assert listed == [f"parallel.{k}" for k in ParallelConfig.model_fields]
    sections = run_cli("validate", "--explain", "recipe", "--json")
    assert {f["name"] for f in json.loads(sections.stdout)["fields"]} >= {"model", "parallel", "cluster", "sweep"}


def test_explain_rule_prints_its_doc_and_the_fields_it_reads():
    out = run_cli("validate", "--explain", "heads_shape")
    assert out.returncode == 0
    assert "rule heads_shape" in out.stdout and "reads: model.hidden_size, model.num_attention_heads" in out.stdout


@pytest.mark.parametrize("name,nearest", [("parallel.tensr_size", "parallel.tensor_size"),
                                          ("tensor_size", "parallel.tensor_size"), ("heads_shap", "heads_shape")])
def test_unknown_name_is_one_line_with_the_nearest_valid_one(name, nearest):
    out = run_cli("validate", "--explain", name)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and f"did you mean {nearest}?" in lines[0], out.stderr


def test_rules_and_explain_need_no_recipe():
    out = run_cli("validate", "--rules", "--json")
    assert out.returncode == 0
    assert [r["name"] for r in json.loads(out.stdout)] == [r.name for r in RULES]
    none = run_cli("validate")
    assert none.returncode == 2 and "--explain NAME" in none.stderr


def test_every_schema_path_explains():
    for path, _ in iter_paths():
        assert explain(path)["name"] == path


def test_rule_reads_are_real_fields_and_cover_what_each_rule_reports(monkeypatch):
    """The fields a rule reads come from its source; each path its violation names must be among them."""
    import importlib.util

    leaves = set(leaf_paths())
    for r in RULES:
        assert r.reads and r.reads <= leaves, (r.name, sorted(r.reads - leaves))
    real = importlib.util.find_spec
    for r in RULES:
        hidden = HIDDEN_PACKAGES.get(r.name, ())  # packages the case needs missing (installed here for other tests)
        monkeypatch.setattr(importlib.util, "find_spec", lambda pkg, *a, h=hidden: None if pkg in h else real(pkg, *a))
        overrides = CASES[r.name][0]
        recipe = resolve(BASE, overrides, check=False)
        reported = {schema_path(v.path) for v in r.fn(recipe, ParallelLayout.from_recipe(recipe))}
        assert reported and reported <= r.reads, (r.name, sorted(reported - r.reads))


def test_explain_hint_of_a_schema_error_is_a_command_that_works():
    err = {"loc": ("cluster", "setup", "env", "X"), "type": "string_too_long", "msg": "String should have at most 9",
           "input": "x" * 10, "ctx": {"max_length": 9}}
    violation = violation_from_pydantic(err, {})
    [command] = HINT.findall(violation.fix)
    assert command == "python -m hpc_tools validate --explain cluster.setup.env"
    assert run_cli(*command.split()[3:]).returncode == 0


def test_more_violations_hint_is_a_command_that_lists_them_all():
    overrides = ["parallel.tensor_size=3", "training.min_lr=1"]
    path = str(REPO / "recipes/gpt_3d.yaml")
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    [command] = HINT.findall(str(info.value))
    assert command == f"python -m hpc_tools validate {path}"
    out = run_cli(*command.split()[3:], *[a for o in overrides for a in ("--set", o)])
    assert out.returncode == 2 and len([ln for ln in out.stderr.splitlines() if ln.startswith("error:")
                                        and "(profile" not in ln]) >= 2


class _Traced:
    """A recipe section that records every leaf field read through it (``path``), following properties and methods
    (``m.moe_layers()`` reads ``m.num_layers``) so that what a rule reads at run time can be compared with what
    ``recipe/reads.py`` finds in its source."""

    def __init__(self, real, path: str, log: set[str]):
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, name: str):
        from pydantic import BaseModel

        real, cls = self._real, type(self._real)
        if name in cls.model_fields:
            path, value = f"{self._path}.{name}" if self._path else name, getattr(real, name)
            if isinstance(value, BaseModel):
                return _Traced(value, path, self._log)
            self._log.add(path)
            return value
        attr = getattr(cls, name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if callable(attr) and hasattr(attr, "__get__") and not name.startswith(("model_", "__")):
            return attr.__get__(self)
        return getattr(real, name)


def test_every_field_a_rule_reads_at_run_time_is_one_explain_names():
    """``validate --explain FIELD`` lists the rules that read FIELD (``Rule.reads``, from the rule's source, helpers it
    passes a section to included): run every rule on every shipped recipe (and its local profile) through a recipe
    that records its reads, and each leaf it read must be among them."""
    from hpc_tools.recipe.load import read_yaml

    leaves, checked = set(leaf_paths()), 0
    recipes = []
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        raw = read_yaml(path, site=False)
        recipes += [(f"{path.name} {profile}", resolve(raw, (), profile, check=False))
                    for profile in ((None, "local") if raw.get("local") else (None,))]
    # and every rule's own violating case (tests/unit/test_recipe_rules.py), which takes the branches that refuse
    recipes += [(name, resolve(BASE, case[0], check=False)) for name, case in CASES.items()]
    for where, recipe in recipes:
        layout = ParallelLayout.from_recipe(recipe)
        for r in RULES:
            log: set[str] = set()
            list(r.fn(_Traced(recipe, "", log), layout))
            missed = (log & leaves) - r.reads
            assert not missed, (where, r.name, sorted(missed))
            checked += len(log)
    assert checked > 1000
