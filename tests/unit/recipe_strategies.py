"""Hypothesis strategies over the recipe space, drawn from the schema itself (``hpc_tools.recipe.schema.Recipe``).

Every leaf field of the schema is found by walking pydantic's ``model_fields`` (nested sections, ``X | None``
sections included); what a field may hold comes from its annotation and its constraints (``gt``/``ge``/``lt``/``le``
metadata, ``Literal`` choices, ``X | None``, ``list[X]``, ``dict[str, X]``, unions of annotated types), never from a
list of hand-picked examples. A field added to the schema tomorrow is drawn from the day it lands.

A wholly random recipe would almost never pass the schema and the rules, so a drawn recipe is a shipped one
(``recipes/*.yaml``, all valid) with a few fields changed at once: to a valid value (near the current one: doubled,
halved, a small number, a choice of the ``Literal``), a boundary value (the bounds themselves), an out-of-bound one, a
value of the wrong type (a boolean for an integer, a string for a number, a list, a mapping), null, a deleted key or
an unknown key. Changes to a recipe's ``local:`` profile are drawn the same way.
"""

from __future__ import annotations

import copy
import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

import annotated_types
import yaml
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hpc_tools.recipe.fields import unwrap_model
from hpc_tools.recipe.schema import PROFILE_SECTIONS, Recipe
from tests.helpers import REPO

# Sections the rules and the planner read most: their fields are drawn more often than the others'.
PLANNED = ("model", "parallel", "training", "backend", "cluster")
SMALL_INTS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
WRONG_TYPES = ("abc", "", "1.5", "yes", True, False, 1.5, -0.5, [], [1, 2], {}, {"key": 1}, 2**64, 1e300)


@dataclass(frozen=True)
class Leaf:
    """One field of the schema: its dotted path, its annotation and pydantic's field info (constraints)."""

    path: tuple[str, ...]
    annotation: Any
    info: FieldInfo
    is_section: bool


def schema_leaves(model: type[BaseModel] = Recipe, prefix: tuple[str, ...] = ()) -> list[Leaf]:
    """Every field of the schema (sections too, as their own entries), depth first."""
    out = []
    for name, info in model.model_fields.items():
        path = prefix + (name,)
        sub = unwrap_model(info.annotation)
        out.append(Leaf(path, info.annotation, info, sub is not None))
        if sub is not None:
            out.extend(schema_leaves(sub, path))
    return out


def _bounds(metadata: list[Any]) -> tuple[float | None, float | None, bool, bool]:
    """(low, high, low is exclusive, high is exclusive) from pydantic's constraint metadata."""
    lo = hi = None
    lo_open = hi_open = False
    for m in metadata:
        for item in getattr(m, "metadata", None) or [m]:  # Field(...) inside Annotated carries its own metadata
            if isinstance(item, annotated_types.Gt):
                lo, lo_open = item.gt, True
            elif isinstance(item, annotated_types.Ge):
                lo, lo_open = item.ge, False
            elif isinstance(item, annotated_types.Lt):
                hi, hi_open = item.lt, True
            elif isinstance(item, annotated_types.Le):
                hi, hi_open = item.le, False
    return lo, hi, lo_open, hi_open


def _split_annotated(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        return _split_annotated(base, [*metadata, *extra])
    return annotation, metadata


def _int_values(lo, hi, lo_open, hi_open, current: Any) -> tuple[st.SearchStrategy, list[int], list[int]]:
    """(valid values, boundary values, out-of-bound values) of an integer field."""
    low = -(2**63) if lo is None else (math.floor(lo) + 1 if lo_open else math.ceil(lo))
    high = 2**63 - 1 if hi is None else (math.ceil(hi) - 1 if hi_open else math.floor(hi))
    near = set(SMALL_INTS) | {0, -1}
    if isinstance(current, int) and not isinstance(current, bool):
        near |= {current * 2, current * 4, current // 2, current + 1, current - 1, current * 3}
    near = sorted(v for v in near if low <= v <= high)
    valid = st.one_of(st.sampled_from(near), st.integers(max(low, -64), min(high, 4096))) if near else \
        st.integers(low, high)
    boundary = [v for v in (low, low + 1, high - 1, high) if low <= v <= high]
    outside = ([low - 1] if lo is not None else []) + ([high + 1] if hi is not None else [])
    return valid, boundary, outside


def _float_values(lo, hi, lo_open, hi_open, current: Any) -> tuple[st.SearchStrategy, list[float], list[float]]:
    low = -1e6 if lo is None else lo
    high = 1e6 if hi is None else hi
    near = [0.0, 1e-9, 0.001, 0.5, 1.0, 2.0, 100.0]
    if isinstance(current, (int, float)) and not isinstance(current, bool):
        near += [current * f for f in (0.01, 0.1, 0.5, 2.0, 10.0)]

    def inside(v: float) -> bool:
        return (v > low if lo_open else v >= low) and (v < high if hi_open else v <= high)

    near = [float(v) for v in near if inside(v)]
    ranged = st.floats(low, min(high, 1e6), exclude_min=lo_open, exclude_max=hi_open, allow_nan=False,
                       allow_infinity=False)
    valid = st.one_of(st.sampled_from(near), ranged) if near else ranged
    boundary = [v for v in (lo, hi) if v is not None and inside(v)]
    boundary += [math.nextafter(lo, math.inf)] if lo is not None and lo_open else []
    outside = [v for v in (lo, hi) if v is not None and not inside(v)]
    outside += [lo - 1.0] if lo is not None else []
    outside += [hi + 1.0] if hi is not None else []
    return valid, boundary, outside


STRINGS = ("", "x", "cpu", "H100-SXM", "A100-40GB", "A100-80GB", "B200", "00:10:00", "1-00:00:00", "gpu", "/tmp",
           "does/not/exist", "a b", "$HOME/x", "~")


def values_for(annotation: Any, metadata: list[Any], current: Any) -> dict[str, st.SearchStrategy]:
    """{kind: strategy} of the values to draw for a field of ``annotation`` whose constraints are ``metadata``:
    kinds ``valid``, ``boundary``, ``outside`` (out of bounds), ``wrong`` (wrong types and null)."""
    annotation, metadata = _split_annotated(annotation, list(metadata))
    wrong = st.sampled_from(WRONG_TYPES + (None,))
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        parts = [values_for(arg, metadata if arg is not type(None) else [], current)
                 for arg in typing.get_args(annotation)]
        kinds: dict[str, st.SearchStrategy] = {"wrong": wrong}
        for kind in ("valid", "boundary", "outside"):
            options = [p[kind] for p in parts if kind in p]
            if options:
                kinds[kind] = st.one_of(options)
        return kinds
    if annotation is type(None):
        return {"valid": st.none()}
    if annotation is bool:
        return {"valid": st.booleans(), "wrong": wrong}
    if annotation in (int, float):
        values = _int_values if annotation is int else _float_values
        valid, boundary, outside = values(*_bounds(metadata), current)
        kinds = {"valid": valid, "wrong": wrong}
        if boundary:
            kinds["boundary"] = st.sampled_from(boundary)
        if outside:
            kinds["outside"] = st.sampled_from(outside)
        return kinds
    if origin is Literal:
        choices = list(typing.get_args(annotation))
        return {"valid": st.sampled_from(choices), "wrong": wrong}
    if annotation is str:
        near = [current] if isinstance(current, str) else []
        return {"valid": st.one_of(st.sampled_from(STRINGS + tuple(near)), st.text(max_size=12)), "wrong": wrong}
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        lo, hi, _, _ = _bounds(metadata)
        inner = values_for(item, [], None)
        kinds = {"valid": st.lists(inner["valid"], max_size=4), "wrong": wrong}
        if isinstance(current, list) and current:  # the same length, one item changed (a per-layer list)
            kinds["boundary"] = st.builds(_replace_item, st.just(current), st.integers(0, len(current) - 1),
                                          inner["valid"])
        if "wrong" in inner:
            kinds["outside"] = st.lists(inner["wrong"], min_size=1, max_size=2)
        return kinds
    if origin is dict:
        _, value = typing.get_args(annotation) or (str, Any)
        inner = values_for(value, [], None)
        keys = st.sampled_from(("A", "X_1", "1x", "with space", ""))
        return {"valid": st.dictionaries(keys, inner["valid"], max_size=2), "wrong": wrong,
                "outside": st.dictionaries(keys, inner.get("wrong", wrong), min_size=1, max_size=1)}
    # Any, or a type this walk does not know: values of every kind
    return {"valid": st.sampled_from((1, "x", True, 0.5, [1], {"a": 1})), "wrong": wrong}


def _replace_item(items: list[Any], index: int, value: Any) -> list[Any]:
    out = list(items)
    out[index] = value
    return out


def _get(raw: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = raw
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(raw: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = raw
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value


def _delete(raw: dict[str, Any], path: tuple[str, ...]) -> None:
    parent = _get(raw, path[:-1]) if len(path) > 1 else raw
    if isinstance(parent, dict):
        parent.pop(path[-1], None)


def shipped_recipes() -> dict[str, dict[str, Any]]:
    """Every recipe under recipes/ (each valid), as parsed YAML: a fresh copy each call (parsed once per process:
    each drawn example needs them, and parsing them all took a third of the property test's time)."""
    return copy.deepcopy(_parsed_recipes())


@functools.cache
def _parsed_recipes() -> dict[str, dict[str, Any]]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted((REPO / "recipes").glob("*.yaml"))}


KINDS = ("valid",) * 6 + ("boundary",) * 2 + ("outside", "wrong", "delete", "unknown")
UNKNOWN_KEYS = st.from_regex(r"[a-z][a-z_]{0,20}", fullmatch=True)


@st.composite
def mutation(draw, raw: dict[str, Any], leaves: list[Leaf]) -> tuple[str, tuple[str, ...], Any]:
    """One change to ``raw`` (in place): (kind, path, value)."""
    leaf = draw(st.sampled_from(leaves))
    path = leaf.path
    if raw.get("local") and path[0] in PROFILE_SECTIONS and draw(st.integers(0, 5)) == 0:
        path = ("local",) + path  # the profile takes the same sections, partial
    kind = draw(st.sampled_from(KINDS))
    if kind == "delete":
        _delete(raw, path)
        return kind, path, None
    if kind == "unknown":
        section = path[:-1] if not leaf.is_section else path
        key = draw(UNKNOWN_KEYS)
        _set(raw, section + (key,), draw(st.sampled_from((1, "x", True, None))))
        return kind, section + (key,), None
    if leaf.is_section:
        value = draw(st.sampled_from((None, {}, 1, "x", [])))
    else:
        kinds = values_for(leaf.annotation, leaf.info.metadata, _get(raw, path))
        value = draw(kinds[kind] if kind in kinds else kinds["valid"])
    _set(raw, path, value)
    return kind, path, value


@st.composite
def drawn_recipes(draw, max_changes: int = 4) -> tuple[str, dict[str, Any], list[tuple[str, tuple[str, ...], Any]]]:
    """(shipped recipe name, changed recipe mapping, the changes) -- a shipped recipe with 1 to ``max_changes``
    fields changed, the fields of the planned sections drawn three times as often as the others."""
    recipes = shipped_recipes()
    name = draw(st.sampled_from(sorted(recipes)))
    raw = copy.deepcopy(recipes[name])
    leaves = schema_leaves()
    weighted = [leaf for leaf in leaves for _ in range(3 if leaf.path[0] in PLANNED else 1)]
    changes = [draw(mutation(raw, weighted)) for _ in range(draw(st.integers(1, max_changes)))]
    return name, raw, changes
