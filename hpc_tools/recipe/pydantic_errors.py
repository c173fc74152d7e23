"""A pydantic validation error as the one-line ``Violation`` users read: the field, the value, the rule and the fix
(unknown keys get the nearest valid key). Used for recipes (``recipe/load.py``) and the site file (``recipe/site.py``).
"""

from __future__ import annotations

import difflib
from typing import Any

from hpc_tools.errors import Violation
from hpc_tools.recipe.base import BOUNDED
from hpc_tools.recipe.fields import field_at, schema_path, valid_keys
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
    import types
    import typing

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
    """One pydantic error as a one-line Violation (unknown keys get the nearest valid key)."""
    loc = [printable(str(x))[:80] for x in err["loc"] if not str(x).startswith("function-")]
    path = ".".join(loc) or "recipe"
    kind = err["type"]
    err = {**err, "input": _shown_input(err.get("input"))}
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
