"""``validate --explain NAME``: the reference of one recipe field, section or cross-field rule, from the schema itself.

A field shows its path, type, default, constraints, docstring, its names in Megatron-LM, Megatron-core, torchtitan and
DeepSpeed (``hpc_tools.recipe.aliases``) and the rules that read it; a section lists its fields; a rule shows its
docstring and the fields it reads; one of those libraries' names explains the field it is here. Everything comes
from the section models (``hpc_tools/recipe/<section>.py``), ``hpc_tools.recipe.rules`` and the alias table; nothing
here restates a field.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

from hpc_tools.errors import UserError, show
from hpc_tools.recipe import aliases
from hpc_tools.recipe.fields import field_at, field_doc, iter_paths, model_at, unwrap_model
from hpc_tools.recipe.rules import RULES, Rule

ROOT = "recipe"
_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="), (annotated_types.Lt, "lt", "<"),
           (annotated_types.Le, "le", "<="))
_NOUNS = {int: "integer", float: "number", bool: "true/false", str: "string", type(None): "null", Any: "any value"}


def explain(name: str) -> dict[str, Any]:
    """The explanation of a field path, a section path, ``recipe`` or a rule name, as plain data.

    An unknown name is a UserError naming the nearest valid one.
    """
    name = name.strip()
    rules = {r.name: r for r in RULES}
    if name in rules:
        return explain_rule(rules[name])
    parts = [] if name == ROOT else name.split(".")
    if model_at(parts) is not None:
        return explain_section(name)
    if field_at(parts) is not None:
        return explain_field(name)
    found = aliases.find(parts)
    if found is not None:
        return explain_alias(found)
    raise UserError(f"--explain {name}: no recipe field, section or rule has that name ({_nearest(name)})")


def explain_field(path: str) -> dict[str, Any]:
    """A leaf field: type, default, bounds, docstring and the rules whose source reads it."""
    info = field_at(path.split("."))
    assert info is not None
    return {"kind": "field", "name": path, "type": type_name(info.annotation), "default": default_text(info),
            "constraints": constraints(info), "doc": field_doc(path.split(".")),
            "rules": [{"name": r.name, "doc": r.doc} for r in RULES if path in r.reads],
            "known_as": [_alias_dict(a) for a in aliases.known_names(path)]}


def explain_alias(found: aliases.Alias) -> dict[str, Any]:
    """A name from Megatron-LM, Megatron-core, torchtitan or DeepSpeed (``recipe/aliases.py``): the field or section
    it is here, explained, with the alias under ``alias``; a name derived here is ``kind: alias`` on its own."""
    if found.target is None:
        return {"kind": "alias", **_alias_dict(found)}
    parts = found.target.split(".")
    info = explain_section(found.target) if model_at(parts) is not None else explain_field(found.target)
    return {**info, "alias": _alias_dict(found)}


def _alias_dict(found: aliases.Alias) -> dict[str, Any]:
    return {"name": found.name, "target": found.target, "known_as": list(found.known_as), "note": found.note}


def explain_section(path: str) -> dict[str, Any]:
    """A section (or ``recipe``, the whole schema): its docstring and one line per field."""
    parts = [] if path == ROOT else path.split(".")
    model = model_at(parts)
    assert model is not None
    fields = []
    for key, info in model.model_fields.items():
        is_section = unwrap_model(info.annotation) is not None
        fields.append({"name": key, "type": "section" if is_section else type_name(info.annotation),
                       "default": default_text(info), "doc": field_doc(parts + [key])})
    return {"kind": "section", "name": path, "doc": field_doc(parts) if parts else (model.__doc__ or "").strip(),
            "fields": fields, "known_as": [_alias_dict(a) for a in aliases.known_names(path)]}


def explain_rule(r: Rule) -> dict[str, Any]:
    """A cross-field rule: its docstring and the fields it reads."""
    return {"kind": "rule", "name": r.name, "doc": r.doc, "reads": sorted(r.reads)}


def format_text(info: dict[str, Any]) -> str:
    """The explanation as the lines ``validate --explain`` prints."""
    if info["kind"] == "alias":
        return "\n".join([info["name"], f"  {' / '.join(info['known_as'])}: derived here, not set: {info['note']}"])
    head = []
    if info.get("alias"):
        a = info["alias"]
        head = [f"{a['name']}: {' / '.join(a['known_as'])} is `{a['target']}` here"
                + (f" ({a['note']})" if a["note"] else "")]
    return "\n".join(head + [_format(info)])


def _format(info: dict[str, Any]) -> str:
    if info["kind"] == "rule":
        return "\n".join([f"rule {info['name']}", f"  {info['doc']}", f"  reads: {', '.join(info['reads'])}"])
    if info["kind"] == "section":
        known = "; ".join(" / ".join(a["known_as"]) for a in info["known_as"])
        lines = [f"section {info['name']}" + (f": {info['doc']}" if info["doc"] else "")
                 + (f" (known elsewhere as {known})" if known else "")]
        prefix = "" if info["name"] == ROOT else info["name"] + "."
        for f in info["fields"]:
            default = "" if f["type"] == "section" else \
                ", required" if f["default"] == "required" else f" = {f['default']}"
            lines.append(f"  {prefix}{f['name']} ({f['type']}{default}): {f['doc']}")
        return "\n".join(lines)
    lines = [info["name"], f"  type: {info['type']}", f"  default: {info['default']}"]
    if info["constraints"]:
        lines.append(f"  constraints: {', '.join(info['constraints'])}")
    lines.append(f"  {info['doc'] or '(no description)'}")
    if info["known_as"]:
        lines.append("  known elsewhere as:")
        lines += [f"    {' / '.join(a['known_as'])}" + (f" ({a['note']})" if a["note"] else "")
                  for a in info["known_as"]]
    if info["rules"]:
        lines.append("  rules that read it:")
        lines += [f"    {r['name']}: {r['doc']}" for r in info["rules"]]
    return "\n".join(lines)


def type_name(annotation: Any, nested: bool = False) -> str:
    """A YAML-reader's name for an annotation: ``integer``, ``integer or null``, ``one of gpt, llama``,
    ``integer (> 0, <= 100000) or list of 0/1``, ... (``nested``: inside a list or union, where a set of literals
    reads ``0/1``)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        bounds = _bounds(args[1:])
        return type_name(args[0], nested) + (f" ({', '.join(bounds)})" if bounds else "")
    if origin is typing.Literal:
        return "/".join(show(a) for a in args) if nested else "one of " + ", ".join(show(a) for a in args)
    if unwrap_model(annotation) is not None and origin is None:
        return "section"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a, True) for a in args)
    if origin in (list, tuple, set):
        return f"list of {type_name(args[0], True)}" if args else "list"
    if origin is dict:
        return f"mapping of {type_name(args[0], True)} to {type_name(args[1], True)}" if args else "mapping"
    return _NOUNS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(metadata: Any) -> list[str]:
    """The bounds in an annotation's metadata (``Annotated[int, Field(gt=0)]``): ``> 0``, ``at most 8 items``;
    markers that are not bounds (strictness, validators) say nothing."""
    out = []
    for meta in metadata:
        inner = getattr(meta, "metadata", None)  # a FieldInfo (Field(...)) holds its constraints as metadata
        for item in inner if isinstance(inner, list) else [meta]:
            for kind, attr, sign in _BOUNDS:
                if isinstance(item, kind):
                    out.append(f"{sign} {show(getattr(item, attr))}")
            if isinstance(item, annotated_types.MaxLen):
                out.append(f"at most {item.max_length} items")
    return out


def default_text(info: FieldInfo) -> str:
    """The default as YAML shows it, ``required``, or ``the section's defaults`` for a nested section."""
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        value = info.default_factory()
        if unwrap_model(type(value)) is not None:
            return "the section's defaults"
        return show(value) if not isinstance(value, (list, dict)) else (repr(value) if value else "empty")
    return show(info.default)


def constraints(info: FieldInfo) -> list[str]:
    """Bounds declared on the field itself (``> 0``, ``< 1``, ``at most 64 items``)."""
    return _bounds(info.metadata)


def all_names() -> list[str]:
    """Every name ``--explain`` accepts: ``recipe``, section and field paths, rule names."""
    return [ROOT] + [path for path, _ in iter_paths()] + [r.name for r in RULES]


def _nearest(name: str) -> str:
    names = all_names() + list(aliases.ALIASES)  # another library's name, misspelt, is explained too
    near = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    if not near:  # a bare or misspelt last part: `tensor_size` -> `parallel.tensor_size`
        by_tail = {n.rsplit(".", 1)[-1]: n for n in reversed(names)}
        near = [by_tail[t] for t in difflib.get_close_matches(name.rsplit(".", 1)[-1], list(by_tail), n=1, cutoff=0.6)]
    listing = f"`python -m hpc_tools validate --explain {ROOT}` lists the sections, `validate --rules` the rules"
    return f"did you mean {near[0]}? {listing}" if near else listing
