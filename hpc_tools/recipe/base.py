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


def check_value(value: Any, multiline: bool = False, where: str = "") -> str | None:
    """Why ``value`` (a scalar, or a list / mapping of them, walked) cannot be in a recipe; None when it can."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            # bit_length, not str(): Python refuses to print integers of more than 4300 digits
            return f"{where}is a {value.bit_length()}-bit integer, beyond 64 bits -- use a realistic value"
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
            _refuse([(name, value, check_value(value, multiline=kinds[name][1])) for name, value in data.items()
                     if name in kinds and not (isinstance(value, BaseModel) or
                                               (isinstance(value, dict) and kinds[name][0]))])
        return data

    @model_validator(mode="after")
    def _bounded_ints(self) -> "Section":
        # After coercion too: a string of 30 digits given for an integer field becomes a 30-digit integer.
        values = ((name, getattr(self, name)) for name in type(self).model_fields)
        _refuse([(name, v, check_value(v)) for name, v in values
                 if isinstance(v, int) and not isinstance(v, bool) and not INT64_MIN <= v <= INT64_MAX])
        return self


def _refuse(checked: list[tuple[str, Any, str | None]]) -> None:
    problems = [(name, value, why) for name, value, why in checked if why]
    if problems:
        raise PydanticCustomError(BOUNDED, "{why}", {"why": problems[0][2], "problems": problems})


def _field_kinds(cls: type[BaseModel]) -> dict[str, tuple[bool, bool]]:
    """{field: (holds a section, is free text)} of a section class, worked out once per class."""
    kinds = cls.__dict__.get("_hpc_field_kinds")
    if kinds is None:
        kinds = {name: (_holds_section(f), MULTILINE in f.metadata) for name, f in cls.model_fields.items()}
        type.__setattr__(cls, "_hpc_field_kinds", kinds)
    return kinds


def _holds_section(field) -> bool:
    """True when the field's annotation is a section (``X`` or ``X | None``)."""
    annotation = field.annotation
    args = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in (annotation, *args))
