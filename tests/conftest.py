"""Shared fixtures: the repository, a CLI runner, and the Slurm test cluster (environment/slurm-dev)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
# Hermetic recipes: a developer's site file (~/.config/hpc_tools/site.yaml) must not change what the tests resolve;
# tests of the site file set HPC_TOOLS_SITE themselves.
os.environ["HPC_TOOLS_SITE"] = "none"


@pytest.fixture
def repo() -> Path:
    return REPO


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600,
            input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m hpc_tools ARGS` in a fresh process, as a user runs it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpc_tools", *args], cwd=cwd or REPO, env=full_env, text=True,
                          capture_output=True, timeout=timeout, input=input)


def wait_for(predicate, timeout_s: float = 120, what: str = "", poll_s: float = 0.5):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what or predicate}")


def step_records(run_dir: Path) -> dict[int, list[dict]]:
    """rank -> its step records (records/rank<R>.jsonl), read with the project's own reader."""
    from profiling.records import read_jsonl

    return {int(p.stem[4:]): list(read_jsonl(p)) for p in sorted((Path(run_dir) / "records").glob("rank*.jsonl"))}


def loss_curve(run_dir: Path) -> dict[int, float]:
    """step -> loss, from whichever ranks recorded one."""
    return {r["step"]: r["loss"] for recs in step_records(run_dir).values() for r in recs if r["loss"] is not None}


@pytest.fixture
def cli():
    return run_cli


def _slurm_nodes() -> int:
    from hpc_tools.executors.slurm import slurm_available

    ok, _ = slurm_available()
    if not ok:
        return 0
    out = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, timeout=10)
    try:
        return sum(int(x) for x in out.stdout.split())
    except ValueError:
        return 0


def _need_slurm(min_nodes: int) -> int:
    nodes = _slurm_nodes()
    if nodes >= min_nodes:
        return nodes
    why = (f"needs the Slurm test cluster with >= {min_nodes} node(s) (found {nodes}): "
           f"bash environment/slurm-dev/up.sh{' --nodes 2' if min_nodes > 1 else ''}")
    if os.environ.get("HPC_TOOLS_REQUIRE_SLURM") == "1":
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture
def slurm() -> int:
    """A live Slurm cluster (number of nodes). Skips without one, but fails under HPC_TOOLS_REQUIRE_SLURM=1 (CI)."""
    return _need_slurm(1)


@pytest.fixture
def slurm_multinode() -> int:
    return _need_slurm(2)


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"
