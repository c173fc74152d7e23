"""Base class for recipe sections: strict (unknown keys are errors), documented field by field, and safe by
construction: every value of every section passes one guard (``Section._bounded_values``) before anything reads it.

The guard is the one rule for values from an untrusted recipe file:
- strings are single-line (no newline, no control character) and at most ``MAX_STRING`` characters, unless the field
  is declared ``Text`` (free text such as ``description``: newlines and tabs allowed, other control characters not);
- integers fit in int64 and floats are finite (``allow_inf_nan=False``), so no loop or formula downstream sees a
  number no hardware can mean (fields that loops use carry tighter, hardware-sized bounds of their own);
- lists and mappings (``modules``, ``env``, ``config_overrides``, ``sweep.grid``, ...) are checked item by item.
Values never reach a script unquoted anyway (``hpc_tools.render``); this guard makes sure a value that would end a
comment, a ``#SBATCH`` line or an error message early never gets that far.
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from hpc_tools.recipe.text import is_control, printable  # noqa: F401  (re-exported: light module, no pydantic)

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
MAX_STRING = 4096  # PATH_MAX on Linux: no single-line value of a recipe needs more
MAX_TEXT = 16384  # free text (description)


class _MultiLine:
    """Marker: the annotated string field holds free text (newlines and tabs allowed)."""

    def __repr__(self) -> str:
        return "Text"


MULTILINE = _MultiLine()
Text = Annotated[str, MULTILINE]
"""A free-text string field: newlines and tabs allowed, other control characters refused."""


def check_string(value: str, multiline: bool = False) -> str | None:
    """Why ``value`` cannot be a recipe string (None when it can)."""
    limit = MAX_TEXT if multiline else MAX_STRING
    if len(value) > limit:
        return f"is {len(value)} characters long -- use at most {limit}"
    for i, ch in enumerate(value):
        if multiline and ch in "\n\t":
            continue
        if is_control(ch):
            what = "a newline" if ch in "\r\n\u2028\u2029\x85" else f"the control character {ch!r}"
            return f"holds {what} at position {i} -- {'free text' if multiline else 'this value is one line and'} " \
                   "cannot hold control characters; remove it"
    return None


def check_value(value: Any, multiline: bool = False, where: str = "",
                bounds: tuple[int | None, int | None] = (None, None)) -> str | None:
    """Why ``value`` (a scalar, or a list / mapping of them, walked) cannot be in a recipe; None when it can.
    ``bounds``: the field's own (lowest, highest) integer, named when an integer is beyond 64 bits."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            return f"{where}{beyond_int64(value, bounds)}"
        return None
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return f"{where}is {value} -- give a finite number"
        return None
    if isinstance(value, str):
        why = check_string(value, multiline)
        return f"{where}{why}" if why else None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            why = check_value(item, multiline, f"item {i} ")
            if why:
                return f"{where}{why}"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            why = check_value(key, False, f"key {printable(str(key))[:40]!r} ") or \
                check_value(item, multiline, f"{printable(str(key))[:40]}: ")
            if why:
                return f"{where}{why}"
        return None
    return None


def beyond_int64(value: int, bounds: tuple[int | None, int | None]) -> str:
    """The rule and the fix for an integer beyond int64: the field's own bound when it has one, else int64's (the
    value itself is printed by the line's ``path=value``)."""
    what = "integer a recipe holds (64 bits)" if bounds == (None, None) else "value this field takes"
    low = INT64_MIN if bounds[0] is None else max(bounds[0], INT64_MIN)
    high = INT64_MAX if bounds[1] is None else min(bounds[1], INT64_MAX)
    side = f"above the largest {what}, {high}" if value > 0 else f"below the smallest {what}, {low}"
    return f"is {side} -- give a value from {low} to {high}"


def int_bounds(cls: type[BaseModel], name: str) -> tuple[int | None, int | None]:
    """(lowest, highest) integer the field ``name`` of ``cls`` takes by its Field bounds (None: unbounded)."""
    low = high = None
    info = cls.model_fields.get(name)
    for m in info.metadata if info is not None else ():
        for attr, shift, is_low in (("ge", 0, True), ("gt", 1, True), ("le", 0, False), ("lt", -1, False)):
            bound = getattr(m, attr, None)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool):
                edge = int(bound) + shift if float(bound).is_integer() else int(bound // 1) + (1 if is_low else 0)
                low, high = (edge, high) if is_low else (low, edge)
    return low, high


BOUNDED = "recipe_value"
"""The error type of a value the guard refuses; its ctx ``problems`` lists (field, value, why) of one section."""


class Section(BaseModel):
    """A recipe section. Field docstrings are the user documentation: ``python -m hpc_tools validate --explain PATH``
    prints them (PATH a field such as ``parallel.tensor_size``, a section such as ``parallel``, or ``recipe``)."""

    # Field docstrings become descriptions when first asked for (recipe/docstrings.py ``documented``: one parse per
    # module; pydantic's use_attribute_docstrings re-parses every class and costs a fifth of the schema's import time).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=False, validate_assignment=False,
                              allow_inf_nan=False)

    # The guard runs once per section, not once per field: a validator on every field ("*") made pydantic wrap and
    # inspect each of the recipe's ~200 fields at import (a sixth of the schema's build time).
    @model_validator(mode="before")
    @classmethod
    def _bounded_values(cls, data: Any) -> Any:
        # Before type coercion: a 400-digit integer is refused before pydantic turns it into a float, and nested
        # sections (mappings of their own fields) are left to their own guard so errors keep their full path.
        if isinstance(data, dict):
            kinds = _field_kinds(cls)
            data = {name: _as_bool(value, kinds[name][2]) if name in kinds else value for name, value in data.items()}
            _refuse([(name, value, check_value(value, kinds[name][1], bounds=int_bounds(cls, name)) or
                      check_scalar(value, kinds[name][2]))
                     for name, value in data.items()
                     if name in kinds and not (isinstance(value, BaseModel) or
                                               (isinstance(value, dict) and kinds[name][0]))])
        return data

    @model_validator(mode="after")
    def _bounded_ints(self) -> "Section":
        # After coercion too: a string of 30 digits given for an integer field becomes a 30-digit integer.
        values = ((name, getattr(self, name)) for name in type(self).model_fields)
        _refuse([(name, v, check_value(v, bounds=int_bounds(type(self), name))) for name, v in values
                 if isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX])
        return self


def _refuse(checked: list[tuple[str, Any, str | None]]) -> None:
    problems = [(name, value, why) for name, value, why in checked if why]
    if problems:
        raise PydanticCustomError(BOUNDED, "{why}", {"why": problems[0][2], "problems": problems})


def _field_kinds(cls: type[BaseModel]) -> dict[str, tuple[bool, bool, tuple[frozenset[str], frozenset[str]]]]:
    """{field: (holds a section, is free text, ``scalar_kinds`` of its annotation)} of a section class, worked out
    once per class."""
    kinds = cls.__dict__.get("_hpc_field_kinds")
    if kinds is None:
        kinds = {name: (_holds_section(f), MULTILINE in f.metadata, scalar_kinds(f.annotation))
                 for name, f in cls.model_fields.items()}
        type.__setattr__(cls, "_hpc_field_kinds", kinds)
    return kinds


# --- strict scalar types ----------------------------------------------------------------------------------------------
# Pydantic's lax mode turns `true` into 1 for an int field and 1 or "1" into True for a bool field: a YAML boolean
# written for a count (`moe_router_topk: true`) would train with 1. The guard refuses a value whose kind the field's
# annotation does not name, as the user wrote it. The recipe reader (``recipe/yamlfile.py``) reads YAML 1.2 booleans
# only (true/false), so `yes`, `no`, `on`, `off` reach the guard as the words written: a bool field takes them as
# true/false, a number field refuses them quoting the word.

BOOL_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
"""YAML 1.1's spellings of true and false (PyYAML's safe loader reads these as booleans): a bool field takes them."""


def scalar_kinds(annotation: Any) -> tuple[frozenset[str], frozenset[str]]:
    """(kinds of a scalar value, kinds of a list item) the annotation accepts, each from
    {"bool", "int", "float", "str", "any"}; a section or a mapping adds nothing (it has a guard of its own, or is
    walked by ``_as_bool``)."""
    scalars: set[str] = set()
    items: set[str] = set()

    def walk(t: Any, into: set[str]) -> None:
        origin = typing.get_origin(t)
        if origin is Annotated:
            walk(typing.get_args(t)[0], into)
        elif origin in (typing.Union, types.UnionType):
            for arg in typing.get_args(t):
                walk(arg, into)
        elif origin is typing.Literal:
            into.update("bool" if isinstance(v, bool) else type(v).__name__ for v in typing.get_args(t))
        elif origin in (list, tuple, set, frozenset):
            for arg in typing.get_args(t):
                walk(arg, items)
        elif origin is dict:
            if any(arg is Any for arg in typing.get_args(t)):
                into.add("mapping-any")
        elif t is Any:
            into.add("any")
        elif t in (bool, int, float, str):
            into.add(t.__name__)

    walk(annotation, scalars)
    return frozenset(scalars), frozenset(items)


def check_scalar(value: Any, kinds: tuple[frozenset[str], frozenset[str]]) -> str | None:
    """Why ``value`` is of a kind the field does not take (a boolean for a number, a number for a boolean); None
    when it is not refused here (pydantic checks the rest)."""
    scalars, items = kinds
    if isinstance(value, list) and items:
        for i, item in enumerate(value):
            why = _scalar_mismatch(item, items)
            if why:
                return f"item {i} {why}"
        return None
    return _scalar_mismatch(value, scalars)


def _scalar_mismatch(value: Any, kinds: frozenset[str]) -> str | None:
    if not kinds or "any" in kinds:
        return None
    numbers = kinds & {"int", "float"}
    noun = "an integer" if "float" not in numbers else "a number"
    if isinstance(value, bool) and "bool" not in kinds and numbers:
        return f"is a boolean (YAML reads true and false as booleans), not a number -- give {noun}"
    if isinstance(value, str) and value.lower() in BOOL_WORDS and "str" not in kinds and numbers:
        return f"is a word for true or false, not a number -- give {noun}"
    if "bool" in kinds and not numbers and "str" not in kinds:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return "is a number, not true or false -- give true or false"
        if isinstance(value, str) and value.lower() not in BOOL_WORDS:
            return "is a string, not true or false -- give true or false"
    return None


def _as_bool(value: Any, kinds: tuple[frozenset[str], frozenset[str]]) -> Any:
    """``value`` with YAML 1.1 boolean words read as booleans where the field takes a boolean and no string (and, in
    a mapping of anything such as ``config_overrides``, at any depth: the library it is passed to reads JSON
    booleans)."""
    scalars, _ = kinds
    if isinstance(value, str) and value.lower() in BOOL_WORDS and "bool" in scalars and "str" not in scalars:
        return BOOL_WORDS[value.lower()]
    if "mapping-any" in scalars and isinstance(value, dict):
        return _words_as_bools(value)
    return value


def _words_as_bools(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _words_as_bools(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_words_as_bools(v) for v in value]
    if isinstance(value, str) and value.lower() in BOOL_WORDS:
        return BOOL_WORDS[value.lower()]
    return value


def _holds_section(field) -> bool:
    """True when the field's annotation is a section (``X`` or ``X | None``)."""
    annotation = field.annotation
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in (annotation, *args))
