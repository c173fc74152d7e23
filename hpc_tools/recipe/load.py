"""Reading a recipe: YAML -> overrides -> typed model -> rule check.

Precedence, lowest to highest (the one place it is decided):
    1. defaults declared on the section models,
    2. the site file (``hpc_tools.recipe.site``: $HPC_TOOLS_SITE or ~/.config/hpc_tools/site.yaml), merged under every
       recipe file ``read_yaml`` reads (a run folder's resolved recipe is complete and never gets it again),
    3. the recipe file,
    4. its `local:` profile, when the job runs locally or with `--profile local` (`--set local.section.key=value`
       sets a value of the profile itself: applied with it, and checked against the schema whether or not it is),
    5. `--set section.key=value` overrides from the command line, in the order given.
Mappings merge key by key (a site's `cluster.setup.env` and a recipe's add up); lists and values replace.

Recipe files are untrusted input: reading one is bounded (``hpc_tools.recipe.yamlfile``), and values are then bounded
by the schema (``hpc_tools.recipe.base.Section``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from hpc_tools.errors import RecipeError, UserError
from hpc_tools.recipe.pydantic_errors import violations_from_pydantic
from hpc_tools.recipe.schema import PROFILE_SECTIONS, Recipe
from hpc_tools.recipe.site import read_site
from hpc_tools.recipe.text import printable
from hpc_tools.recipe.yamlfile import RecipeLimitError, read_recipe_file, safe_yaml

PROFILES = ("local",)


def read_yaml(path: str | Path, site: bool = True) -> dict[str, Any]:
    """The recipe file as a mapping, over the site file's defaults unless ``site`` is False; a missing, unreadable,
    oversized, non-UTF-8 file or bad YAML is a one-line UserError (a bad site file too, naming it)."""
    raw = read_recipe_file(path)
    if not site:
        return raw
    _, defaults = read_site()
    return deep_merge(defaults, raw) if defaults else raw


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
        raise UserError(f"--set {printable(text)[:80]!r} must look like section.key=value "
                        "(e.g. --set parallel.tensor_size=4)")
    try:
        parsed = safe_yaml(value) if value.strip() else ""
    except RecipeLimitError as exc:  # YAML, but not a value a recipe takes
        raise UserError(f"--set {printable(key.strip())[:80]}=...: the value holds {exc.problem} "
                        "(give a plain value)") from None
    except yaml.YAMLError:
        parsed = value  # not YAML: the text itself
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
                where = printable(".".join(path[: depth + 1]))
                raise UserError(f"--set {printable(text)[:80]!r}: {where} is a value, not a section "
                                f"(set {where}=... instead)")
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
    unknown = [key for key in block if key not in PROFILE_SECTIONS]
    if unknown:
        raise UserError(f"{profile}.{printable(str(unknown[0]))[:80]} is not a section a profile may set "
                        f"(valid: {', '.join(PROFILE_SECTIONS)})")
    return deep_merge(merged, block)


def split_profile_overrides(overrides: Iterable[str]) -> tuple[list[str], list[str]]:
    """(``--set local.…`` overrides, which set the local profile's own values, the others)."""
    local, rest = [], []
    for text in overrides:
        (local if text.partition("=")[0].strip().split(".")[0] in PROFILES else rest).append(text)
    return local, rest


def build(raw: dict[str, Any], source: str = "recipe") -> Recipe:
    """The typed recipe, or a RecipeError listing every schema violation."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(violations_from_pydantic(exc.errors(), raw), source) from None


def load_recipe(path: str | Path, overrides: Iterable[str] = (), profile: str | None = None,
                check: bool = True) -> Recipe:
    """Read, merge and type a recipe; with ``check`` also enforce the cross-field rules (hpc_tools.recipe.rules)."""
    raw = read_yaml(path)
    return resolve(raw, overrides, profile, printable(str(path)), check)


def resolve(raw: dict[str, Any], overrides: Iterable[str] = (), profile: str | None = None,
            source: str = "recipe", check: bool = True, check_profile: bool = True, layered: bool = True) -> Recipe:
    """The typed recipe: ``raw`` with ``profile`` applied and ``overrides`` over it. ``--set local.…`` overrides set
    the local profile's values (applied with the profile, never dropped); without the profile they are still checked
    against the schema (with ``check_profile``: ``validate`` checks the profile itself). ``layered``: ``raw`` is a
    recipe file (over the site file), not a resolved recipe whose every value is written (``load_resolved``): the
    recipe records which layer wrote what (``recipe.provenance``)."""
    profile_sets, overrides = split_profile_overrides(overrides)
    raw = apply_overrides(raw, profile_sets)
    if profile_sets and profile is None and check_profile and raw.get("local") is not None:
        build(apply_profile(raw, "local"), f"{source} (profile local)")  # the schema only: the values are recipe values
    merged = apply_overrides(apply_profile(raw, profile), overrides)
    if profile is not None:
        merged.pop("local", None)
    recipe = build(merged, source)
    if layered:
        from hpc_tools.recipe.provenance import looks_resolved, stamp

        if not looks_resolved(raw):
            stamp(recipe, raw.get(profile) if profile is not None else None, _override_paths(overrides))
    if check:
        from hpc_tools.recipe.rules import check_recipe

        violations = check_recipe(recipe)
        if violations:
            raise RecipeError(violations, source)
    return recipe


def _override_paths(overrides: Iterable[str]) -> set[str]:
    """The dotted paths ``--set PATH=VALUE`` overrides write (a mapping value: its keys too)."""
    from hpc_tools.recipe.provenance import paths

    out: set[str] = set()
    for text in overrides:
        keys, value = parse_override(text)
        out |= {".".join(keys)} | paths(value, ".".join(keys) + ".")
    return out


def load_resolved(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """A recipe ``dump_resolved`` wrote (a run folder's ``recipe.yaml``: site defaults and profile already merged,
    so neither is applied again), with ``overrides`` over it, checked against the rules."""
    from hpc_tools.recipe.yamlfile import parse_yaml

    return resolve(parse_yaml(Path(path).read_text(), str(path)), overrides, source=str(path), layered=False)


def dump_resolved(recipe: Recipe) -> str:
    """The recipe as it will run: every default explicit, no profile, no sweep."""
    data = recipe.model_dump(mode="json", exclude={"local", "sweep"})
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=120)


# --- pydantic errors -> one-line violations ---------------------------------------------------------------------------


