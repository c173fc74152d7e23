"""The import graph's two rules, read from the source with ``ast`` (every import, top level or inside a function):

1. ``profiling/`` sits below ``hpc_tools``: the in-job collectors take values from their callers and read only the
   recipe's profiling section (``hpc_tools.recipe.profiling``) and the backend table (``hpc_tools.backends``)
   themselves. Annotation-only imports (under
   ``if TYPE_CHECKING:``) may name other recipe sections, the inputs ``profiling.flops`` / ``peaks`` describe; they
   never run.
2. ``hpc_tools.testing`` (test and benchmark harnesses) is used by tests and benchmarks only, never by the product.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

PROFILING_MAY_IMPORT = ("hpc_tools.recipe.profiling", "hpc_tools.backends")
PROFILING_MAY_NAME_FOR_TYPES = ("hpc_tools.recipe",)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, root: Path = REPO) -> list[tuple[str, int, bool]]:
    """(absolute module, line, annotation only) for every import in ``path``; relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in typing_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from pkg import mod` imports pkg.mod when mod is a module: judge the longest name
            found += [(f"{base}.{alias.name}", node.lineno, id(node) in typing_only) for alias in node.names]
    return found


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def profiling_violations(root: Path = REPO) -> list[str]:
    bad = []
    for path in sorted((root / "profiling").rglob("*.py")):
        for module, line, typing_only in imports(path, root):
            if not _within(module, ("hpc_tools",)) or _within(module, PROFILING_MAY_IMPORT):
                continue
            if typing_only and _within(module, PROFILING_MAY_NAME_FOR_TYPES):
                continue
            bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def harness_violations(root: Path = REPO) -> list[str]:
    bad = []
    for top in ("hpc_tools", "profiling"):
        for path in sorted((root / top).rglob("*.py")):
            if path.is_relative_to(root / "hpc_tools" / "testing"):
                continue
            bad += [f"{path.relative_to(root)}:{line} imports {module}" for module, line, _ in imports(path, root)
                    if _within(module, ("hpc_tools.testing",))]
    return bad


def test_profiling_imports_only_the_recipe_profiling_section_from_hpc_tools():
    assert profiling_violations() == []


def test_the_product_never_imports_the_test_harnesses():
    assert harness_violations() == []
    assert (REPO / "hpc_tools" / "testing" / "__init__.py").is_file()


@pytest.mark.parametrize("source, rule", [
    ("from hpc_tools.train.megatron import cpu_compat\n", profiling_violations),
    ("def f():\n    from hpc_tools.registry import atomic_write\n", profiling_violations),
    ("import hpc_tools.runtime.distenv\n", profiling_violations),
    ("from hpc_tools import registry\n", profiling_violations),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hpc_tools.runtime.context import RankContext\n",
     profiling_violations),
    ("from hpc_tools.testing.spawn import spawn_ranks\n", harness_violations),
])
def test_the_checks_catch_an_upward_import(tmp_path, source, rule):
    """Each rule fails on a planted import: the checks above could fail."""
    for top in ("profiling", "hpc_tools/testing", "hpc_tools/cli"):
        (tmp_path / top).mkdir(parents=True, exist_ok=True)
    target = tmp_path / ("profiling/planted.py" if rule is profiling_violations else "hpc_tools/cli/planted.py")
    target.write_text(source)
    [violation] = rule(tmp_path)
    assert violation.startswith(f"{target.relative_to(tmp_path)}:{len(source.splitlines())} imports hpc_tools.")


@pytest.mark.parametrize("source", [
    "def f():\n    from hpc_tools.recipe.profiling import ProfilingConfig\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hpc_tools.recipe.model import ModelConfig\n",
    "from profiling.files import atomic_write\n",
])
def test_the_allowed_imports_pass(tmp_path, source):
    (tmp_path / "profiling").mkdir()
    (tmp_path / "profiling" / "planted.py").write_text(source)
    assert profiling_violations(tmp_path) == []
