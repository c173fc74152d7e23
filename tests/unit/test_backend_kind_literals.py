"""No backend kind is spelled out outside ``hpc_tools/train/`` and ``hpc_tools/backends.py`` (issue 45, item 3).

Every layer asks the backend table (``hpc_tools.backends``) what a backend is and can do: a comparison of a kind
(``recipe.backend.kind``, a ``backend`` or ``kind`` value) with a literal such as ``"megatron"`` is a second table
that a new backend would have to find. Found by reading the syntax trees of ``hpc_tools/`` and ``profiling/``, so
strings in docstrings and messages do not count, and names that only share a spelling with a kind (a package name,
the planner's layer-code name ``layers == "megatron"``, a FLOPs convention) are left alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

from hpc_tools import backends

ROOT = Path(__file__).resolve().parents[2]
KINDS = frozenset(k for k, row in backends.BACKENDS.items() if row.trains_model)
KIND_NAMES = ("kind", "backend")  # the last name of an expression that holds a backend kind


def _allowed(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return rel.startswith("hpc_tools/train/") or rel == "hpc_tools/backends.py"


def _holds_kind(node: ast.expr) -> bool:
    """``recipe.backend.kind``, ``base.backend``, ``backend``, ``kind``: an expression whose last name says kind."""
    if isinstance(node, ast.Attribute):
        return node.attr in KIND_NAMES
    return isinstance(node, ast.Name) and node.id in KIND_NAMES


def _kind_literals(node: ast.expr) -> list[str]:
    """The kind strings of a literal or of a tuple/list/set literal of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [x.value for x in items if isinstance(x, ast.Constant) and x.value in KINDS]


def kind_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, code) of each comparison of a kind-holding expression with a kind literal in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(_holds_kind(x) for x in operands) and any(_kind_literals(x) for x in operands):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_what_it_forbids():
    """The scan itself: each spelling it must catch, and the look-alikes it must not."""
    caught = ['recipe.backend.kind == "megatron"', 'base.backend != "fsdp"', 'backend in (None, "horovod")',
              'kind not in ["deepspeed"]', '"horovod" == self.kind']
    for code in caught:
        assert kind_comparisons(code), code
    left = ['row.layers == "megatron"', 'name == "horovod"', '"horovod" in row.packages',
            'recipe.backend.kind == "comm_check"', 'x = "megatron"']
    for code in left:
        assert not kind_comparisons(code), code


def test_no_backend_kind_literal_outside_train_and_the_backend_table():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {code}"
                 for top in ("hpc_tools", "profiling") for path in sorted((ROOT / top).rglob("*.py"))
                 if not _allowed(path) for line, code in kind_comparisons(path.read_text(encoding="utf-8"))]
    assert offenders == [], "ask the backend table (hpc_tools/backends.py) instead:\n" + "\n".join(offenders)
