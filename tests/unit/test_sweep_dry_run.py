"""``sweep RECIPE --dry-run`` submits nothing, so it never asks a Slurm controller: with Slurm's client installed and
its controller down (``scontrol ping`` fails) it lists the cells, exit 0, and writes nothing; the same sweep without
--dry-run is refused in one line, naming the controller."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpc_tools.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def controller_down(tmp_path, monkeypatch):
    """sbatch on PATH (Slurm installed), scontrol ping failing (no controller), sbatch itself leaving a mark."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mark = tmp_path / "sbatch-called"
    for name, body in (("sbatch", f"touch {mark}\nexit 1"), ("scontrol", "echo 'no controller' >&2\nexit 1"),
                       ("sinfo", "exit 1"), ("squeue", "exit 1"), ("sacct", "exit 1")):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("HPC_TOOLS_SLURM", raising=False)
    monkeypatch.setenv("HPC_TOOLS_SITE", "none")
    monkeypatch.chdir(tmp_path)
    return mark


@pytest.mark.parametrize("executor", ["auto", "slurm"])
def test_dry_run_lists_the_cells_without_a_controller(controller_down, tmp_path, capsys, executor):
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main(["sweep", str(REPO / "recipes" / "gpt_3d_sweep.yaml"), "--dry-run", "--executor", executor,
                 "--runs-dir", str(tmp_path / "runs")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert [ln for ln in out.out.splitlines() if ln.startswith("cell ")], out.out
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not controller_down.exists()


def test_without_dry_run_the_controller_is_needed(controller_down, tmp_path, capsys):
    code = main(["sweep", str(REPO / "recipes" / "gpt_3d_sweep.yaml"), "--runs-dir", str(tmp_path / "runs")])
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Slurm" in errors[0], errors
    assert not (tmp_path / "runs").exists() and not controller_down.exists()
