"""The control plane against the real Slurm test cluster (environment/slurm-dev) and the local fallback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder, list_runs
from hpc_tools.submission import prepare_run
from tests.conftest import RECIPES, REPO, run_cli, step_records, wait_for

pytestmark = pytest.mark.slurm
COMM = "recipes/comm_check.yaml"


def sbatch(script: Path, cwd: Path, *args: str, env: dict | None = None) -> tuple[str, subprocess.CompletedProcess]:
    out = subprocess.run(["sbatch", "--parsable", *args, str(script)], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env={**os.environ, **(env or {})})
    return out.stdout.strip().split(";")[0], out


def test_submit_through_submitit_and_get_the_result(slurm, runs_dir):
    out = run_cli("submit", COMM, "--profile", "local", "--executor", "slurm", "--wait", "--json",
                  "--runs-dir", str(runs_dir))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    run = RunFolder(result["run_dir"])
    manifest = run.manifest()
    assert result["state"] == "COMPLETED" and manifest["executor"] == "slurm" and manifest["job_id"] == result["job_id"]
    assert manifest["state"] == "COMPLETED" and manifest["slurm_state"] == "COMPLETED"
    recs = step_records(run.path)
    assert sorted(recs) == [0, 1] and all(len(r) == 5 for r in recs.values())
    assert {r["job_id"] for rs in recs.values() for r in rs} == {result["job_id"]}


def test_plain_sbatch_of_a_rendered_script_completes(slurm, tmp_path):
    script = tmp_path / "comm_check.sbatch"
    assert run_cli("render", COMM, "--profile", "local", "-o", str(script)).returncode == 0
    job_id, out = sbatch(script, tmp_path, "--wait", env={"HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs")})
    assert out.returncode == 0, out.stderr
    run = RunFolder(tmp_path / "runs" / f"comm_check-j{job_id}")
    assert run.manifest()["state"] == "COMPLETED" and run.manifest()["executor"] == "sbatch"
    assert (run.path / "job.sbatch").read_text() == script.read_text()
    status = run_cli("status", job_id, "--json", "--runs-dir", str(tmp_path / "runs"))
    assert json.loads(status.stdout)["slurm_state"] == "COMPLETED"
    logs = run_cli("logs", job_id, "--runs-dir", str(tmp_path / "runs"))
    assert "rendezvous ok: 2 ranks" in logs.stdout


def test_two_node_job_allreduces_across_nodes(slurm_multinode, tmp_path):
    script = tmp_path / "two_nodes.sbatch"
    rendered = run_cli("render", COMM, "--profile", "local", "--set", "cluster.nodes=2", "--set",
                       "cluster.gpus_per_node=2", "-o", str(script))
    assert rendered.returncode == 0, rendered.stderr
    job_id, out = sbatch(script, tmp_path, "--wait", env={"HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs")})
    assert out.returncode == 0, out.stderr
    run = RunFolder(tmp_path / "runs" / f"comm_check-j{job_id}")
    recs = step_records(run.path)
    assert sorted(recs) == [0, 1, 2, 3]
    nodes = {rs[0]["node"] for rs in recs.values()}
    assert len(nodes) == 2, f"ranks ran on {nodes}, expected two nodes"
    log = Path(run.manifest()["batch_log"]).read_text()
    assert "rendezvous ok: 4 ranks" in log and "all-reduce sum 6" in log


def test_status_logs_and_cancel_on_a_real_job(slurm, runs_dir):
    out = run_cli("submit", COMM, "--profile", "local", "--executor", "slurm", "--json", "--runs-dir", str(runs_dir),
                  "--set", "training.train_iters=10000000", "--set", "training.log_interval=1000")
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    run = RunFolder(job["run_dir"])
    try:
        wait_for(lambda: run.manifest().get("state") == "RUNNING" and (run.records_dir / "rank00000.jsonl").exists())
        follower = subprocess.Popen([sys.executable, "-m", "hpc_tools", "logs", job["job_id"], "-f", "--runs-dir",
                                     str(runs_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        # sacct can lag the job's own start by a poll or two, and records reach the file at the first flush (2 s)
        status = wait_for(lambda: (s := json.loads(run_cli("status", run.run_id, "--json", "--runs-dir",
                                                            str(runs_dir)).stdout))["slurm_state"] == "RUNNING"
                          and s.get("last_step") and s, timeout_s=60)
        assert status["state"] == "RUNNING" and status["last_step"]["step"] >= 1
        logs = run_cli("logs", run.run_id, "--runs-dir", str(runs_dir))
        assert "rendezvous ok: 2 ranks" in logs.stdout
        cancel = run_cli("cancel", run.run_id, "--runs-dir", str(runs_dir))
        assert cancel.returncode == 0, cancel.stderr
        final = wait_for(lambda: (m := json.loads(run_cli("status", run.run_id, "--json", "--runs-dir", str(runs_dir))
                                                  .stdout)).get("slurm_state") == "CANCELLED" and m, timeout_s=60)
        assert final["state"] == "CANCELLED"
        stdout, _ = follower.communicate(timeout=60)
        assert follower.returncode == 0 and "rendezvous ok" in stdout
        again = run_cli("cancel", run.run_id, "--runs-dir", str(runs_dir))
        assert again.returncode == 2 and "already ended (CANCELLED)" in again.stderr
        assert run.manifest()["state"] == "CANCELLED"  # the ranks' late stop report did not replace it
    finally:
        subprocess.run(["scancel", job["job_id"]], timeout=30)  # never leave a runaway job behind


def test_logs_follow_returns_when_slurm_drops_the_job_at_its_deadline(slurm, runs_dir):
    # A job that cannot end before its --deadline never starts: Slurm ends it DEADLINE (no terminal state the ranks
    # could report). The rendered script runs in the run folder made for it, as `submit` would make it.
    recipe = load_recipe(REPO / COMM, profile="local")
    run = prepare_run(recipe, runs_dir, "sbatch")
    script = run.path / "job.sbatch"
    job_id, out = sbatch(script, run.path, "--time=10", "--deadline=now+1minute",
                         env={"HPC_TOOLS_RUN_DIR": str(run.path)})
    assert out.returncode == 0, out.stderr
    run.update(event="submitted", state="PENDING", job_id=job_id)
    try:
        follow = run_cli("logs", run.run_id, "-f", "--runs-dir", str(runs_dir), timeout=120)
        assert follow.returncode == 0, follow.stderr
        status = json.loads(run_cli("status", run.run_id, "--json", "--runs-dir", str(runs_dir)).stdout)
        assert status["slurm_state"] == "DEADLINE" and status["state"] == "TIMEOUT" and status["status"] == "timeout"
        assert status["reason"].startswith("Slurm DEADLINE"), status["reason"]
        again = run_cli("cancel", run.run_id, "--runs-dir", str(runs_dir))
        assert again.returncode == 2 and "already ended (TIMEOUT)" in again.stderr
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_sbatch_test_only_accepts_rendered_scripts(slurm, tmp_path, path):
    variants = {"local": []}
    if slurm >= 2:
        variants["two-node"] = ["--set", "cluster.nodes=2"]
    for name, extra in variants.items():
        script = tmp_path / f"{name}.sbatch"
        out = run_cli("render", str(path.relative_to(REPO)), "--profile", "local", *extra, "-o", str(script))
        assert out.returncode == 0, out.stderr
        _, test = sbatch(script, tmp_path, "--test-only")
        assert test.returncode == 0 and "to start at" in test.stderr, (name, test.stderr)


def test_twenty_concurrent_submits_give_twenty_intact_runs(slurm, runs_dir):
    def submit(_):
        return run_cli("submit", COMM, "--profile", "local", "--executor", "slurm", "--json", "--runs-dir",
                       str(runs_dir), "--set", "training.train_iters=3")

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(submit, range(20)))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results if r.returncode]
    jobs = [json.loads(r.stdout)["job_id"] for r in results]
    subprocess.run(["scancel", *jobs], check=True, timeout=60)
    runs = list_runs(runs_dir)
    assert len(runs) == 20 and len(set(jobs)) == 20
    for run in runs:
        manifest = run.manifest()
        assert manifest["job_id"] in jobs and manifest["executor"] == "slurm"
        assert run.recipe_path.read_text().startswith("name: comm_check")
