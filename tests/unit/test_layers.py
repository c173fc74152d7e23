"""The import layers are contracts, checked on every test run: import-linter's contracts in setup.cfg (floors, the
torch-free control plane, harnesses only from tests and benchmarks, no cycles among siblings, the training backends
independent of each other, the loop and checkpointing free of every backend), and no import cycle
between files, counting imports inside functions and under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import subprocess
import sys

import grimp
import pytest

from tests.helpers import REPO

PACKAGES = ("hpc_tools", "profiling")


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None)


def file_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected sets of more than one module (Tarjan, iterative): each is an import cycle between files."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_the_import_contracts_are_kept():
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "6 kept, 0 broken" in out.stdout, out.stdout[-2000:]


def test_no_import_cycle_between_files():
    graph = _graph()
    assert len(graph.modules) > 100  # the whole package was read
    assert file_cycles(graph) == []


@pytest.mark.parametrize("planted, expected", [
    ({"a": ["b"], "b": ["a"]}, [["pkg.a", "pkg.b"]]),
    ({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}, [["pkg.a", "pkg.b", "pkg.c"]]),
    ({"a": ["b"], "b": ["c"]}, []),
])
def test_the_cycle_check_finds_a_planted_cycle(planted, expected):
    """The check above could fail: a planted loop of imports is found, a chain is not."""
    graph = grimp.ImportGraph()
    for importer, imported in planted.items():
        for target in imported:
            graph.add_import(importer=f"pkg.{importer}", imported=f"pkg.{target}")
    assert file_cycles(graph) == expected


def test_a_planted_upward_import_breaks_the_floors(tmp_path):
    """The floors contract fails when a lower floor imports a higher one (a copy of the package with one import
    planted in the layout, the ground floor but one)."""
    import shutil

    for top in PACKAGES:
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "setup.cfg").write_text((REPO / "setup.cfg").read_text())
    layout = tmp_path / "hpc_tools" / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef _planted():\n    from hpc_tools.cli import main  # noqa: F401\n")
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0
    assert "hpc_tools.layout -> hpc_tools.cli" in out.stdout, out.stdout[-2000:]
