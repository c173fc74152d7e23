"""A pydantic validation error as the one-line ``Violation`` users read: the field, the value, the rule and the fix
(an unknown key gets the field it is here when another library uses that name, ``recipe/aliases.py``, else the
nearest valid key). Used for recipes (``recipe/load.py``) and the site file (``recipe/site.py``).
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

from hpc_tools.errors import Violation
from hpc_tools.recipe import aliases
from hpc_tools.recipe.base import BOUNDED
from hpc_tools.recipe.fields import field_at, leaf_paths, model_at, schema_path, valid_keys
from hpc_tools.recipe.text import printable


def violations_from_pydantic(errors: list[dict[str, Any]], raw: dict[str, Any]) -> list[Violation]:
    """Pydantic's errors as one-line Violations: one per error, one per refused value of a section's guard
    (``recipe.base.BOUNDED``: its fields' paths, as if each field had failed on its own)."""
    out = []
    errors, unions = _union_fields(errors)
    out += [_union_violation(path, errs) for path, errs in unions.items()]
    for err in errors:
        if err["type"] == BOUNDED:
            out += [violation_from_pydantic({**err, "type": "value_error", "loc": (*err["loc"], name), "input": value,
                                             "msg": why}, raw) for name, value, why in err["ctx"]["problems"]]
        else:
            out.append(violation_from_pydantic(err, raw))
    return out


def _union_fields(errors: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """(the errors that are not about a union field, {union field path: its errors}). Pydantic tries each member of a
    union (``int | list[0/1]``) and reports each member's failure under the member's tag (``constrained-int``,
    ``list[literal[0,1]]``): one field, one value, one line (``_union_violation``)."""
    rest, unions = [], {}
    for err in errors:
        loc = [str(x) for x in err["loc"]]
        k = len(loc)
        while k and field_at(loc[:k]) is None:
            k -= 1
        info = field_at(loc[:k]) if k else None
        members = _members(info.annotation) if info is not None and k < len(loc) else []
        if len(members) > 1 and not loc[k].isdigit():
            unions.setdefault(".".join(loc[:k]), []).append(err)
        else:
            rest.append(err)
    return rest, unions


def _members(annotation: Any) -> list[Any]:
    """The members of a union annotation other than None ([] for a plain one)."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return []
    return [a for a in typing.get_args(annotation) if a is not type(None)]


def _union_violation(path: str, errs: list[dict[str, Any]]) -> Violation:
    """One line for a value no member of a union field takes: what the field accepts, in words."""
    from hpc_tools.recipe.explain import type_name  # the readable type (``integer (> 0) or list of 0/1``)

    info = field_at(path.split("."))
    value = min(errs, key=lambda e: len(e["loc"])).get("input")  # the field's own value, not an item of it
    accepted = type_name(info.annotation) if info is not None else "another value"
    return Violation(printable(path), _shown_input(value), "is not a value this field takes", f"accepted: {accepted}")


def violation_from_pydantic(err: dict[str, Any], raw: dict[str, Any]) -> Violation:
    """One pydantic error as a one-line Violation (unknown keys: ``unknown_key_fix``)."""
    loc = [printable(str(x))[:80] for x in err["loc"] if not str(x).startswith("function-")]
    path = ".".join(loc) or "recipe"
    kind = err["type"]
    if kind == "extra_forbidden":
        return Violation(path, _shown_input(err.get("input")), "is not a known key",
                         unknown_key_fix(loc, err.get("input")))
    err = {**err, "input": _shown_input(err.get("input"))}
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


def _shown_input(value: Any, limit: int = 120) -> Any:
    """The offending value as an error message shows it: long strings and containers cut to ``limit`` characters
    (a hostile recipe's megabyte-long value stays a one-line error)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit // 2]}...({len(value)} characters)"
    if isinstance(value, (list, dict, tuple)):
        text = repr(value) if len(value) < 1000 else f"<{type(value).__name__} of {len(value)} items>"
        return value if len(text) <= limit else f"{text[:limit // 2]}...({len(text)} characters)"
    return value


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


def unknown_key_fix(loc: list[str], value: Any) -> str:
    """The fix of an unknown key at ``loc``: first the alias table (``recipe/aliases.py``: the name Megatron-LM,
    Megatron-core, torchtitan or DeepSpeed gives a field of this recipe), then the same key in another section, and
    only then the nearest valid key by spelling, never one that an alias name is as near to and means otherwise."""
    key, section = loc[-1], loc[:-1]
    found = aliases.find(loc)
    inner = _inner_aliases(key, value)
    if found is not None:
        return "; ".join([_alias_text(found), *(f"its {sub} is `{a.target}`" for sub, a in inner)])
    if inner:  # a foreign table given whole: torchtitan's `activation_checkpoint: {mode: full}`
        return "; ".join(_alias_text(a) for _, a in inner)
    elsewhere = [p for p in leaf_paths() if p.rpartition(".")[2] == key and p.rpartition(".")[0] != ".".join(section)]
    if elsewhere:
        return f"it is {_or(elsewhere)}, {'in another section' if '.' in elsewhere[0] else 'at the top level'}"
    keys = valid_keys(section)
    return f"{_near_key(key, section, keys)}valid keys: {', '.join(keys)}" if keys else _near_key(key, section, keys)


def _alias_text(found: aliases.Alias) -> str:
    """``Megatron-LM's --expert-model-parallel-size / ... is `parallel.expert_size` here; NOTE``."""
    where = " / ".join(found.known_as)
    if found.target is None:
        return f"{where} is derived here: {found.note}"
    noun = "the section " if model_at(found.target.split(".")) is not None else ""
    return f"{where} is {noun}`{found.target}` here{'; ' + found.note if found.note else ''}"


def _inner_aliases(key: str, value: Any, limit: int = 4) -> list[tuple[str, aliases.Alias]]:
    """For a foreign table given whole (torchtitan's ``parallelism: {tensor_parallel_degree: 2}``): its keys that
    the alias table knows (at most ``limit``), with their aliases."""
    if not isinstance(value, dict):
        return []
    pairs = []
    for sub in list(value)[:64]:
        found = aliases.find([str(key), str(sub)])
        if found is not None and found.target is not None and len(pairs) < limit:
            pairs.append((printable(str(sub))[:40], found))
    return pairs


def _near_key(key: str, section: list[str], keys: list[str]) -> str:
    """``did you mean 'X'? `` for the valid key nearest in spelling, unless an alias name is at least as near and
    means another field (``expert_model_paralel_size`` is a misspelt alias of ``expert_size``, not
    ``expert_tensor_size``)."""
    name = aliases.lookup_name(key)
    near = difflib.get_close_matches(name, keys, n=1, cutoff=0.5)
    foreign = difflib.get_close_matches(name, list(aliases.ALIASES), n=1, cutoff=0.5)
    if foreign and (not near or _ratio(name, foreign[0]) >= _ratio(name, near[0])):
        alias = aliases.ALIASES[foreign[0]]
        if not near or alias.target != ".".join([*section, near[0]]):
            meaning = f"`{alias.target}` here" if alias.target else f"derived here: {alias.note}"
            return f"did you mean {foreign[0]!r}, which is {meaning}? "
    return f"did you mean {near[0]!r}? " if near else ""


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _or(paths: list[str]) -> str:
    shown = [f"`{p}`" for p in paths[:3]]
    return " or ".join(shown) + (" or ..." if len(paths) > 3 else "")
