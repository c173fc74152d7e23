"""Field docstrings of recipe sections -> ``FieldInfo.description``, read with one ``ast`` parse per module.

The docstring under each field is its documentation (``validate --explain``, error messages). Pydantic can collect
them itself (``use_attribute_docstrings``), but it finds each class's source by walking stack frames and tokenizing
and parsing the class block again per class: about a fifth of the schema's import time, paid by every command that
reads a recipe. This reads each module's source once and gives the same text (``inspect.cleandoc``, as pydantic
does; a test compares the two on every section), and only when a doc is first asked for (``documented``, called by
``recipe/fields.py``): validating a recipe never needs them, so ``validate`` and ``submit`` never parse a module.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys


@functools.lru_cache(maxsize=None)
def module_docs(filename: str) -> dict[str, list[dict[str, str]]]:
    """Class name -> for each class of that name in the file, its ``field -> docstring`` (a docstring is a string
    statement right after an annotated assignment)."""
    try:
        with open(filename, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename)
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[str, list[dict[str, str]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found.setdefault(node.name, []).append(_class_docs(node))
    return found


def _class_docs(node: ast.ClassDef) -> dict[str, str]:
    docs: dict[str, str] = {}
    previous: ast.stmt | None = None
    for stmt in node.body:
        if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)
                and isinstance(previous, ast.AnnAssign) and isinstance(previous.target, ast.Name)):
            docs[previous.target.id] = inspect.cleandoc(stmt.value.value)
        previous = stmt
    return docs


_DOCUMENTED: set[type] = set()


def documented(cls: type) -> type:
    """``cls`` with its fields' descriptions set from their docstrings (once per class)."""
    if cls not in _DOCUMENTED:
        attach_docstrings(cls)
        _DOCUMENTED.add(cls)
    return cls


def attach_docstrings(cls: type) -> None:
    """Set each field's ``description`` from its docstring where it has none (what ``use_attribute_docstrings``
    does), for a pydantic model class just created."""
    module = sys.modules.get(cls.__module__)
    filename = getattr(module, "__file__", None)
    if not filename:
        return
    candidates = module_docs(filename).get(cls.__name__, [])
    own = set(cls.__dict__.get("__annotations__", {}))
    # two classes of one name in a file (tests define some inside functions): the one declaring these fields
    docs = next((d for d in candidates if own and set(d) <= own), candidates[0] if len(candidates) == 1 else {})
    for name, info in cls.model_fields.items():
        if info.description is None and name in docs:
            info.description = docs[name]
