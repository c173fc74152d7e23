"""Which recipe fields a rule reads, found in the rule's own source, so the rule stays the one place that says so.

A rule is ``fn(r: Recipe, lay: ParallelLayout)``. Reading its source (``ast``) follows attribute chains from ``r``
(``r.model.hidden_size``), local aliases of sections (``m = r.model``, ``p, t = r.parallel, r.training``), properties
(``m.head_dim`` reads what ``ModelConfig.head_dim`` reads), the layout (``lay.world_size`` reads what
``ParallelLayout.from_recipe`` fed into ``nodes`` and ``ranks_per_node``), and ``getattr(m, key)`` with keys named as
strings in the rule or in a module constant it uses. It is a reading aid for ``validate --explain``, not a proof:
a unit test checks it against every path the rules report.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

from hpc_tools.layout import ParallelLayout
from hpc_tools.recipe.fields import field_at, model_at


@dataclass(frozen=True)
class _Section:
    """A name bound to a recipe section (``''`` = the whole recipe)."""

    path: str

    def child(self, attr: str) -> str:
        return f"{self.path}.{attr}" if self.path else attr


@dataclass(frozen=True)
class _Layout:
    """A name bound to the ParallelLayout."""


Binding = _Section | _Layout | frozenset
_FOLLOWING: set[Callable[..., Any]] = set()  # helpers being read now (a helper calling itself is read once)


@functools.cache
def fields_read(fn: Callable[..., Any]) -> frozenset[str]:
    """The dotted recipe fields ``fn(recipe, layout)`` reads."""
    func = _parse(fn)
    args = [a.arg for a in func.args.args]
    env: dict[str, Binding] = {args[0]: _Section("")}
    if len(args) > 1:
        env[args[1]] = _Layout()
    return _Reader(env, fn.__globals__).function(func)


@functools.cache
def layout_inputs() -> dict[str, frozenset[str]]:
    """ParallelLayout field -> the recipe fields ``from_recipe`` derives it from."""
    func = _parse(ParallelLayout.from_recipe.__func__)
    reader = _Reader({func.args.args[1].arg: _Section("")}, {})
    reader.function(func)
    call = next(n for n in ast.walk(func) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "cls")
    return {kw.arg: reader.expr(kw.value) for kw in call.keywords if kw.arg}


def _parse(fn: Callable[..., Any]) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


class _Reader:
    def __init__(self, env: dict[str, Binding], module_globals: dict[str, Any]):
        self.env = dict(env)
        self.globals = module_globals

    def function(self, func: ast.FunctionDef) -> frozenset[str]:
        """Bind the simple assignments in source order, then collect every read in the body."""
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                self._bind(node.targets[0], node.value)
        return self.expr(func)

    def _bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)
        elif isinstance(target, ast.Name):
            bound = self._resolve(value)
            self.env[target.id] = bound if bound is not None else self.expr(value)

    def expr(self, node: ast.AST) -> frozenset[str]:
        """Every recipe field read anywhere inside ``node``."""
        reads: set[str] = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute):
                found = self._resolve(sub)
                if isinstance(found, frozenset):
                    reads |= found
            elif isinstance(sub, ast.Name) and isinstance(self.env.get(sub.id), frozenset):
                reads |= self.env[sub.id]
            elif isinstance(sub, ast.Call) and getattr(sub.func, "id", "") == "getattr" and sub.args:
                reads |= self._getattr(sub, node)
            elif isinstance(sub, ast.Call):
                reads |= self._call(sub)
        return frozenset(reads)

    def _call(self, call: ast.Call) -> frozenset[str]:
        """A helper given a section or the recipe (``backends.of(r)``, ``_mesh(r.backend.fsdp)``): what it reads
        of its parameters, read in its own source the same way (a module-level Python function; not recursive)."""
        fn = self._callee(call.func)
        bound = [self._resolve(a) if isinstance(a, (ast.Name, ast.Attribute)) else None for a in call.args]
        if fn is None or fn in _FOLLOWING or not any(isinstance(b, _Section) for b in bound):
            return frozenset()
        try:
            func = _parse(fn)
        except (OSError, TypeError, SyntaxError, IndexError):
            return frozenset()
        params = [a.arg for a in func.args.args]
        env = {name: b for name, b in zip(params, bound) if isinstance(b, (_Section, _Layout))}
        _FOLLOWING.add(fn)
        try:
            return _Reader(env, fn.__globals__).function(func)
        finally:
            _FOLLOWING.discard(fn)

    def _callee(self, node: ast.expr) -> Callable[..., Any] | None:
        """The plain function an expression names in the rule's module (``name`` or ``module.name``), else None."""
        if isinstance(node, ast.Name):
            fn = self.globals.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            fn = getattr(self.globals.get(node.value.id), node.attr, None) \
                if inspect.ismodule(self.globals.get(node.value.id)) else None
        else:
            return None
        return fn if inspect.isfunction(fn) else None

    def _resolve(self, node: ast.expr) -> Binding | None:
        """What an expression is: a section, the layout, or the fields a value is read from (None: not ours)."""
        if isinstance(node, ast.Name):
            return self.env.get(node.id)
        if not isinstance(node, ast.Attribute):
            return None
        base = self._resolve(node.value)
        if isinstance(base, _Layout):
            return self._layout_attr(node.attr)
        if not isinstance(base, _Section):
            return None
        path = base.child(node.attr)
        parts = _parts(path)
        if model_at(parts) is not None:
            return _Section(path)
        if field_at(parts) is not None:
            return frozenset({path})
        owner = model_at(_parts(base.path))
        prop = getattr(owner, node.attr, None)
        if isinstance(prop, property):
            return _property_reads(prop, base)
        return None

    def _layout_attr(self, attr: str) -> frozenset[str] | None:
        inputs = layout_inputs()
        if attr in inputs:
            return inputs[attr]
        prop = getattr(ParallelLayout, attr, None)
        if isinstance(prop, property):
            return _property_reads(prop, _Layout())
        return None

    def _getattr(self, call: ast.Call, scope: ast.AST) -> frozenset[str]:
        """``getattr(section, key)``: the section's fields named by a string in the rule or a constant it uses."""
        base = self._resolve(call.args[0])
        if not isinstance(base, _Section) or isinstance(call.args[1], ast.Constant):
            return frozenset()
        names = {n.value for n in ast.walk(scope) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        for n in ast.walk(scope):
            if isinstance(n, ast.Name) and isinstance(self.globals.get(n.id), dict):
                names |= _strings(self.globals[n.id])
        model = model_at(_parts(base.path))
        return frozenset(base.child(name) for name in names if model is not None and name in model.model_fields)


def _parts(path: str) -> list[str]:
    return path.split(".") if path else []


def _property_reads(prop: property, self_binding: Binding) -> frozenset[str]:
    func = _parse(prop.fget)
    return _Reader({func.args.args[0].arg: self_binding}, prop.fget.__globals__).function(func)


def _strings(value: Any) -> set[str]:
    """Every string key or value in a nested constant (e.g. a table of field names)."""
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        return set().union(*(_strings(k) | _strings(v) for k, v in value.items())) if value else set()
    if isinstance(value, (list, tuple, set, frozenset)):
        return set().union(*(_strings(v) for v in value)) if value else set()
    return set()
