"""The launcher table (``hpc_tools/render/launchers.py``, issue 45 item 2): a row for every ``cluster.launcher`` the
schema allows, callers that ask it instead of comparing names, and the one rank-step loop it fills in the rendered
script (plain srun: the restart loop with a budget of 0; Ray: its driver as the loop's one step)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import stat
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from hpc_tools import backends, doctor
from hpc_tools.recipe import launchers as launcher_facts
from hpc_tools.recipe.cluster import ClusterConfig
from hpc_tools.recipe.load import resolve
from hpc_tools.render import launchers
from hpc_tools.render.sbatch import render_sbatch
from hpc_tools.render.slurm_params import SlurmSpec
from tests.helpers import REPO

NAMES = typing.get_args(ClusterConfig.model_fields["launcher"].annotation)
BASE = {"name": "launch", "backend": {"kind": "fsdp"},
        "model": {"family": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32,
                  "vocab_size": 512},
        "cluster": {"nodes": 2, "gpus_per_node": 2, "gpu_type": "cpu", "python": sys.executable}}


def recipe(*overrides: str):
    return resolve({**BASE, "cluster": dict(BASE["cluster"])}, list(overrides))


def test_the_table_has_a_row_for_every_launcher_the_schema_allows():
    assert NAMES and set(launchers.LAUNCHERS) == set(NAMES) == set(launcher_facts.LAUNCHERS)
    assert launcher_facts.DEFAULT == ClusterConfig.model_fields["launcher"].default
    for name in NAMES:
        row = launchers.of(name)
        assert row.name == name and row.facts is launcher_facts.of(name)
        if row.facts.backend_feature:  # a feature of the backend table's rows
            assert row.facts.backend_feature in backends.Backend.__dataclass_fields__
            assert backends.with_feature(row.facts.backend_feature)
        if row.driver is not None:  # the module the batch shell and the local executor run `drive` of
            spec = importlib.util.find_spec(row.driver)
            assert spec is not None and spec.origin, row.driver
            tree = ast.parse(Path(spec.origin).read_text())
            assert "drive" in {f.name for f in tree.body if isinstance(f, ast.FunctionDef)}, row.driver
        for package, requirement in row.packages:  # doctor checks each, named by the launcher
            assert doctor.LAUNCHER_PACKAGES[package] == (name, requirement)
        spec = SlurmSpec.from_recipe(recipe(f"cluster.launcher={name}"))
        assert spec.stop_signal is row.time_limit_stop
        assert any(k == "signal" for k, _ in spec.sbatch_options()) is row.time_limit_stop


def launcher_comparisons(source: str) -> list[str]:
    """Comparisons of a launcher-holding expression (its text names ``launcher``) with a launcher's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = any(isinstance(x, ast.Constant) and x.value in NAMES for x in operands)
            if named and any("launcher" in ast.unparse(x) for x in operands if not isinstance(x, ast.Constant)):
                found.append(ast.unparse(node))
    return found


def test_no_caller_compares_the_launcher_with_a_name():
    """Outside the two tables (the facts in recipe/launchers.py, the batch-script rows in render/launchers.py) nothing
    compares a launcher with a name, the recipe's rules included."""
    assert launcher_comparisons('c.launcher == "ray"') and launcher_comparisons('launcher(run) != "srun"')
    assert launcher_comparisons('manifest.get("launcher") == "ray"')
    assert not launcher_comparisons('name == "ray"') and not launcher_comparisons('launchers.of(x).driver')
    found = {}
    for path in sorted((REPO / "hpc_tools").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in ("hpc_tools/render/launchers.py", "hpc_tools/recipe/launchers.py"):
            continue
        hits = launcher_comparisons(path.read_text())
        if hits:
            found[rel] = hits
    assert not found, f"ask hpc_tools.render.launchers instead: {found}"


@pytest.mark.parametrize("overrides", [(), ("cluster.restarts=2",), ("cluster.place_by_topology=true",),
                                       ("cluster.restarts=1", "cluster.spare_nodes=1",
                                        "cluster.place_by_topology=true"),
                                       ("cluster.launcher=ray",), ("cluster.launcher=ray", "cluster.restarts=2")],
                         ids=["plain", "restarts", "placed", "placed-restarts", "ray", "ray-restarts"])
def test_one_rank_step_loop_for_every_launcher(overrides):
    r = recipe(*overrides)
    script = render_sbatch(r)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    lines = script.splitlines()
    assert lines.count("while :; do") == 1 and lines.count("done") == 1
    loop = lines[lines.index("while :; do"):lines.index("done")]
    rank = [ln for ln in loop if "|| SRUN_EXIT=$?" in ln]
    assert len(rank) == 1
    shell_budget = r.cluster.restarts if launchers.of(r.cluster.launcher).driver is None else 0
    assert ("hpc_tools.job.restarts next" in script) is bool(shell_budget)
    assert loop[-1].strip() == ("break" if not shell_budget else 'eval "$HPC_TOOLS_STEP"')
    assert script.count("-m hpc_tools.job.placement") == int(r.cluster.place_by_topology and r.cluster.launcher
                                                             == "srun")
    if r.cluster.place_by_topology:
        assert script.count("# PLACEMENT (cluster.place_by_topology)") == 1


def stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_plain_srun_is_the_loop_with_a_budget_of_0(tmp_path):
    """A failed rank step of a job without restarts: one step, no restart controller asked, its exit status recorded
    by the epilogue and the script's own."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    stub(bin_dir, "srun", f'echo "$*" >> {calls}\ncase "$*" in *hpc_tools.runtime.rank*) exit 3 ;; esac')
    stub(bin_dir, "scontrol", "echo node1; echo node2")
    script = tmp_path / "job.sbatch"
    r = recipe("cluster.requeue=false")
    script.write_text(render_sbatch(r, "launch.yaml"))
    run_dir = tmp_path / "runs" / "launch-j4242"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_SUBMIT_DIR": str(tmp_path), "PYTHONPATH": str(REPO),
           "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs")}
    env.pop("HPC_TOOLS_RUN_DIR", None)
    out = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert [c for c in calls.read_text().splitlines() if "hpc_tools.runtime.rank" in c] == [
        f"--kill-on-bad-exit=1 --cpus-per-task={r.cluster.cpus_per_task} --mem=0 --label {sys.executable} -m "
        f"hpc_tools.runtime.rank --run-dir {run_dir}"]
    assert "no restart" not in out.stderr and "restart " not in out.stdout
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["exit_code"] == 3 and not manifest.get("restarts"), manifest
