"""On the real Slurm test cluster, both launch paths (submitit's script and a plain `sbatch` of a rendered script):
a failing set-up line (`module load` of a module that does not exist; the test nodes have no `module` at all) fails
the job before any rank starts, named in the batch log and in the manifest; hostile values run nothing."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder
from hpc_tools.runstate import TERMINAL_STATES
from tests.helpers import REPO, run_cli, step_records, wait_for

pytestmark = pytest.mark.slurm
COMM = "recipes/comm_check.yaml"
FAILING = "module load nonexistent"
SHORT = ("--set", "cluster.time_limit=3")  # a short limit lets the scheduler backfill these around longer jobs
WAIT_S = 600  # the test cluster may be busy with other jobs first


def ended(run_dir: Path):
    manifest = RunFolder(run_dir).manifest() if (run_dir / "manifest.json").is_file() else {}
    return manifest if manifest.get("state") in TERMINAL_STATES else None


def hostile_recipe(tmp_path: Path, mark: Path) -> Path:
    """comm_check's local profile with shell payloads in every free string the job's script sees."""
    raw = yaml.safe_load((REPO / COMM).read_text())
    payloads = [f"$(touch {mark})", f"`touch {mark}`", f"'; touch {mark}; echo '", f"a' && touch {mark} #"]
    raw["description"] = f"x\ntouch {mark}\n" + payloads[0]
    raw["local"]["cluster"]["setup"] = {"env": {f"HOSTILE_{i}": p for i, p in enumerate(payloads)}}
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_failing_setup_and_hostile_values_on_both_launch_paths(slurm, tmp_path):
    runs = tmp_path / "runs"
    mark = tmp_path / "pwned"
    jobs: list[str] = []
    try:
        # submitit path: a failing module load, and a recipe full of shell payloads
        out = run_cli("submit", COMM, "--profile", "local", "--executor", "slurm", "--set",
                      "cluster.setup.modules=[nonexistent]", *SHORT, "--json", "--runs-dir", str(runs))
        assert out.returncode == 0, out.stderr
        failing_submitit = json.loads(out.stdout)
        jobs.append(failing_submitit["job_id"])
        out = run_cli("submit", str(hostile_recipe(tmp_path, mark)), "--profile", "local", "--executor", "slurm",
                      *SHORT, "--json", "--runs-dir", str(runs))
        assert out.returncode == 0, out.stderr
        hostile_submitit = json.loads(out.stdout)
        jobs.append(hostile_submitit["job_id"])
        # plain sbatch path: the rendered script with the same failing line
        script = tmp_path / "failing.sbatch"
        rendered = run_cli("render", COMM, "--profile", "local", "--set", "cluster.setup.modules=[nonexistent]",
                           *SHORT, "-o", str(script))
        assert rendered.returncode == 0, rendered.stderr
        sbatch = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp_path, capture_output=True, text=True,
                                timeout=60, env={**os.environ, "HPC_TOOLS_RUNS_DIR": str(runs)})
        assert sbatch.returncode == 0, sbatch.stderr
        jobs.append(sbatch.stdout.strip().split(";")[0])

        # the submitit job: FAILED, the line in the manifest and in the batch log, no rank ran
        manifest = wait_for(lambda: ended(Path(failing_submitit["run_dir"])), WAIT_S, "the failing submitit job")
        assert manifest["state"] == "FAILED" and manifest["setup_failed"] == FAILING, manifest
        assert FAILING in manifest["error"] and not step_records(failing_submitit["run_dir"])
        log = Path(failing_submitit["run_dir"]) / "submitit" / f"{failing_submitit['job_id']}_0_log.err"
        assert f"environment set-up failed (exit 127): {FAILING}" in wait_for(
            lambda: log.is_file() and log.read_text(), 60, "the submitit batch log")

        # the plain sbatch job: its run folder made from the recipe it carries, FAILED with the line
        run_dir = runs / f"comm_check-j{jobs[2]}"
        manifest = wait_for(lambda: ended(run_dir), WAIT_S, "the failing sbatch job")
        assert manifest["state"] == "FAILED" and manifest["setup_failed"] == FAILING, manifest
        assert manifest["executor"] == "sbatch"
        assert not step_records(run_dir)
        batch_log = tmp_path / f"comm_check-{jobs[2]}.out"
        assert f"environment set-up failed (exit 127): {FAILING}" in batch_log.read_text()

        # the hostile job: completes, runs no payload, and its ranks saw the values literally
        manifest = wait_for(lambda: ended(Path(hostile_submitit["run_dir"])), WAIT_S, "the hostile submitit job")
        assert manifest["state"] == "COMPLETED", manifest
        assert not mark.exists(), "a hostile value ran as a command"
        saved = load_recipe(Path(hostile_submitit["run_dir"]) / "recipe.yaml")
        assert saved.cluster.setup.env["HOSTILE_0"] == f"$(touch {mark})"
    finally:
        for job in jobs:
            subprocess.run(["scancel", job], timeout=30)
