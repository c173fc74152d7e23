"""Reading a recipe: YAML -> overrides -> typed model -> rule check.

Precedence, lowest to highest (the one place it is decided):
    1. defaults declared on the section models,
    2. the recipe file,
    3. its `local:` profile, when the job runs locally or with `--profile local`,
    4. `--set section.key=value` overrides from the command line, in the order given.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from hpc_tools.errors import RecipeError, UserError, Violation
from hpc_tools.recipe.fields import field_at, schema_path, valid_keys
from hpc_tools.recipe.schema import Recipe

PROFILES = ("local",)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The recipe file as a mapping; a missing file or bad YAML is a one-line UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist (give the path of a recipes/*.yaml file)")
    return parse_yaml(path.read_text(), str(path))


def parse_yaml(text: str, source: str = "recipe") -> dict[str, Any]:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{source}:{where} is not valid YAML: {problem} (fix the syntax there)") from None
    if not isinstance(raw, dict):
        raise UserError(f"{source} must be a YAML mapping with sections name, model, parallel, ... "
                        f"(got {type(raw).__name__})")
    return raw


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """A new dict: ``top`` over ``base``, merging nested mappings key by key."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """``parallel.tensor_size=4`` -> (['parallel', 'tensor_size'], 4); the value is read as YAML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise UserError(f"--set {text!r} must look like section.key=value (e.g. --set parallel.tensor_size=4)")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key.strip().split("."), parsed


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for depth, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(path[: depth + 1])
                raise UserError(f"--set {text!r}: {where} is a value, not a section (set {where}=... instead)")
            node = child
        node[path[-1]] = value
    return out


def apply_profile(raw: dict[str, Any], profile: str | None) -> dict[str, Any]:
    if profile is None:
        return raw
    if profile not in PROFILES:
        raise UserError(f"--profile {profile} is unknown (valid: {', '.join(PROFILES)})")
    merged = {k: v for k, v in raw.items() if k != profile}
    block = raw.get(profile)
    if block is None:
        return merged
    if not isinstance(block, dict):
        raise UserError(f"{profile}: must be a mapping of recipe sections (got {type(block).__name__})")
    return deep_merge(merged, block)


def build(raw: dict[str, Any], source: str = "recipe") -> Recipe:
    """The typed recipe, or a RecipeError listing every schema violation."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError([violation_from_pydantic(err, raw) for err in exc.errors()], source) from None


def load_recipe(path: str | Path, overrides: Iterable[str] = (), profile: str | None = None,
                check: bool = True) -> Recipe:
    """Read, merge and type a recipe; with ``check`` also enforce the cross-field rules (hpc_tools.recipe.rules)."""
    raw = read_yaml(path)
    return resolve(raw, overrides, profile, str(path), check)


def resolve(raw: dict[str, Any], overrides: Iterable[str] = (), profile: str | None = None,
            source: str = "recipe", check: bool = True) -> Recipe:
    merged = apply_overrides(apply_profile(raw, profile), overrides)
    if profile is not None:
        merged.pop("local", None)
    recipe = build(merged, source)
    if check:
        from hpc_tools.recipe.rules import check_recipe

        violations = check_recipe(recipe)
        if violations:
            raise RecipeError(violations, source)
    return recipe


def dump_resolved(recipe: Recipe) -> str:
    """The recipe as it will run: every default explicit, no profile, no sweep."""
    data = recipe.model_dump(mode="json", exclude={"local", "sweep"})
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)


# --- pydantic errors -> one-line violations ---------------------------------------------------------------------------

def violation_from_pydantic(err: dict[str, Any], raw: dict[str, Any]) -> Violation:
    """One pydantic error as a one-line Violation (unknown keys get the nearest valid key)."""
    loc = [str(x) for x in err["loc"] if not str(x).startswith("function-after")]
    path = ".".join(loc) or "recipe"
    kind = err["type"]
    if kind == "extra_forbidden":
        keys = valid_keys(loc[:-1])
        near = difflib.get_close_matches(loc[-1], keys, n=1, cutoff=0.5)
        hint = f"did you mean {near[0]!r}? " if near else ""
        return Violation(path, err.get("input"), "is not a known key", f"{hint}valid keys: {', '.join(keys)}")
    if kind == "missing":
        doc = _field_doc(loc)
        return Violation(path, Ellipsis, "is required", f"add it{': ' + doc if doc else ''}")
    message = err["msg"].removeprefix("Value error, ")
    if kind == "value_error" and " -- " in message:
        rule_text, fix = message.split(" -- ", 1)
        return Violation(path, err.get("input"), rule_text, fix)
    if kind.startswith("literal_error"):
        expected = err.get("ctx", {}).get("expected", "")
        return Violation(path, err.get("input"), "is not one of the allowed values", f"use one of {expected}")
    return Violation(path, err.get("input"), _lower_first(message), _fix_for(kind, path))


def _fix_for(kind: str, path: str) -> str:
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return "choose a value in range"
    if kind.endswith("_parsing") or kind.endswith("_type"):
        noun = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
                "list": "a list", "dict": "a mapping", "model": "a mapping"}.get(kind.split("_")[0], kind.split("_")[0])
        return f"give {noun}"
    return f"see `python -m hpc_tools validate --explain {schema_path(path)}`"


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _field_doc(loc: list[str]) -> str:
    info = field_at(loc)
    return (info.description or "").split("\n")[0] if info else ""
