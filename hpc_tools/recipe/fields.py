"""Walking the recipe schema by dotted path (``parallel.tensor_size``): the sections, their fields, their docs.

Used by the error messages of ``hpc_tools.recipe.load`` (valid keys, the doc of a missing field) and by
``validate --explain`` (``hpc_tools.recipe.explain``).
"""

from __future__ import annotations

import types
import typing
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from hpc_tools.recipe.docstrings import documented
from hpc_tools.recipe.schema import Recipe


def unwrap_model(annotation: Any) -> type[BaseModel] | None:
    """The section class behind an annotation (``X``, ``X | None``), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = unwrap_model(arg)
            if found is not None:
                return found
    return None


def model_at(parts: list[str], root: type[BaseModel] = Recipe) -> type[BaseModel] | None:
    """The section class at a path (``['backend', 'deepspeed']``), or None when the path is not a section."""
    model: type[BaseModel] | None = root
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        model = unwrap_model(model.model_fields[part].annotation)
    return model


def field_at(parts: list[str]) -> FieldInfo | None:
    """The pydantic field at a path (a section's field or a leaf), or None."""
    parent = model_at(parts[:-1])
    if not parts or parent is None:
        return None
    return documented(parent).model_fields.get(parts[-1])


def valid_keys(parts: list[str]) -> list[str]:
    """The keys the section at ``parts`` accepts ([] when it is not a section)."""
    model = model_at(parts)
    return list(model.model_fields) if model else []


def field_doc(parts: list[str]) -> str:
    """The field's docstring (its ``description``), whitespace-normalised; '' when it has none."""
    info = field_at(parts)
    return " ".join((info.description or "").split()) if info else ""


def iter_paths(model: type[BaseModel] = Recipe, prefix: str = "") -> Iterator[tuple[str, bool]]:
    """Every dotted path of the schema, depth first, with whether it is a section (True) or a leaf field."""
    for name, info in model.model_fields.items():
        path = prefix + name
        sub = unwrap_model(info.annotation)
        yield path, sub is not None
        if sub is not None:
            yield from iter_paths(sub, path + ".")


def leaf_paths() -> list[str]:
    """Every leaf field of the recipe (``model.hidden_size``, ``backend.deepspeed.zero_stage``, ...)."""
    return [path for path, is_section in iter_paths() if not is_section]


def schema_path(path: str) -> str:
    """The longest prefix of a pydantic error location that the schema names (``cluster.setup.env.X`` ->
    ``cluster.setup.env``; list indices and mapping keys dropped); ``recipe`` when none does."""
    parts = path.split(".")
    while parts and field_at(parts) is None:
        parts.pop()
    return ".".join(parts) or "recipe"
