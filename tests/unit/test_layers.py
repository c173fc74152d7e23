"""The import layers are contracts, checked on every test run: import-linter's contracts in setup.cfg (floors, the
torch-free control plane, harnesses only from tests and benchmarks, profiling taking values from its callers, the
Megatron backend's model > config > layers, no cycles among siblings, the training backends independent of each
other, the loop and checkpointing free of every backend), each shown to break on a planted import, and no import
cycle between files, counting imports inside functions and under ``if TYPE_CHECKING:``.
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
    contracts = (REPO / "setup.cfg").read_text().count("\n[importlinter:contract:")
    assert contracts >= 8 and f"{contracts} kept, 0 broken" in out.stdout, out.stdout[-2000:]


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


@pytest.mark.parametrize("planted_in, planted, broken", [
    # a lower floor imports a higher one (the layout, the ground floor but one): the floors
    ("hpc_tools/layout.py", "def _planted():\n    from hpc_tools.cli import main", "hpc_tools.layout -> hpc_tools.cli"),
    # profiling reads a recipe section other than its own at run time, or a module below it that is not the backend
    # table: profiling takes values from its callers
    ("profiling/flops.py", "from hpc_tools.recipe.training import TrainingConfig",
     "profiling.flops -> hpc_tools.recipe.training"),
    ("profiling/collector.py", "def _planted():\n    from hpc_tools.layout import ParallelLayout",
     "profiling.collector -> hpc_tools.layout"),
    # the Megatron backend's layer decision reads its configuration: model > config > layers
    ("hpc_tools/train/megatron/layers.py", "def _planted():\n    from hpc_tools.train.megatron import config",
     "hpc_tools.train.megatron.layers -> hpc_tools.train.megatron.config"),
    # the product imports a test harness: harnesses
    ("hpc_tools/cli/status.py", "from hpc_tools.testing.spawn import spawn_ranks",
     "hpc_tools.cli.status -> hpc_tools.testing.spawn"),
    # one backend package builds on another: the backends are peers
    ("hpc_tools/train/horovod/trainer.py", "def _planted():\n    from hpc_tools.train.fsdp import parallel",
     "hpc_tools.train.horovod.trainer -> hpc_tools.train.fsdp.parallel"),
    # the Hugging Face causal-LM base reaches up into a backend: the base sits below every backend package
    ("hpc_tools/train/hf_causal_lm/values.py", "def _planted():\n    from hpc_tools.train.fsdp import parallel",
     "hpc_tools.train.hf_causal_lm.values -> hpc_tools.train.fsdp.parallel"),
])
def test_a_planted_import_breaks_its_contract(tmp_path, planted_in, planted, broken):
    """Each contract fails on one planted import (a copy of the packages with the import added to one module)."""
    import shutil

    for top in PACKAGES:
        shutil.copytree(REPO / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "setup.cfg").write_text((REPO / "setup.cfg").read_text())
    target = tmp_path / planted_in
    target.write_text(target.read_text() + f"\n\n{planted}  # noqa: F401\n")
    out = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                          "lint_imports_command()"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0
    assert broken in out.stdout, out.stdout[-2000:]
