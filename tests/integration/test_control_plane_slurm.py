"""The control plane against the real Slurm test cluster (environment/slurm-dev) and the local fallback.

Tests that take ``slurm_cluster`` run twice: against the real cluster (slow tier) and against the fake Slurm of
hpc_tools/testing/fake_slurm.py (fast tier), where the test sets the job states that Slurm and the ranks would
reach; what only a real job shows (ranks' records and logs) is asserted on the real side only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hpc_tools.executors.slurm import slurm_available
from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder, list_runs
from hpc_tools.runstate import SacctReader
from hpc_tools.submission import new_run
from hpc_tools.world import slurm_view
from tests.helpers import PACED, RECIPES, REPO, run_cli, step_records, wait_for

COMM = "recipes/comm_check.yaml"


def sbatch(script: Path, cwd: Path, *args: str, env: dict | None = None) -> tuple[str, subprocess.CompletedProcess]:
    out = subprocess.run(["sbatch", "--parsable", *args, str(script)], cwd=cwd, capture_output=True, text=True,
                         timeout=600, env={**os.environ, **(env or {})})
    return out.stdout.strip().split(";")[0], out


def test_the_slurm_commands_answer_as_the_toolkit_reads_them(slurm_cluster, tmp_path):
    """Pins the fake to the real commands, read through the toolkit's own readers: sbatch's job id, sacct's state of
    a held job and of a cancelled one, squeue, scancel, scontrol ping and sinfo's partition."""
    script = tmp_path / "held.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=held\n#SBATCH --time=1\ntrue\n")
    job_id, out = sbatch(script, tmp_path, "--hold")
    assert out.returncode == 0 and job_id.isdigit(), out.stderr
    reader = SacctReader(max_age_s=0)
    try:
        held = wait_for(lambda: reader.job(job_id), timeout_s=30, what="sacct to know the job")
        assert (held.slurm_state, held.run_state, held.terminal) == ("PENDING", "PENDING", False)
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30)
        assert queued.returncode == 0 and queued.stdout.split()[0] == job_id
        assert slurm_available() == (True, "")
        view = slurm_view.__wrapped__()  # not the answer cached by an earlier test
        part = view.find(None)
        assert view.checked and (part.name, part.default, part.available) == ("debug", True, "up")
        assert part.nodes == slurm_cluster.nodes and part.gpus_per_node == 0 and part.cpus_per_node >= 1
        assert subprocess.run(["scancel", job_id], timeout=30).returncode == 0
        gone = wait_for(lambda: (j := reader.job(job_id)) and j.terminal and j, timeout_s=30, what="CANCELLED")
        assert gone.state == f"CANCELLED by {os.getuid()}" and gone.run_state == "CANCELLED"
        queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30)
        assert not queued.stdout.strip()
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


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


def test_status_logs_and_cancel_on_a_job(slurm_cluster, runs_dir):
    real = slurm_cluster.kind == "real"
    out = run_cli("submit", COMM, "--profile", "local", "--executor", "slurm", "--json", "--runs-dir", str(runs_dir),
                  "--set", "training.train_iters=10000000", "--set", "training.log_interval=1000", env=PACED)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    run = RunFolder(job["run_dir"])
    assert run.manifest()["job_id"] == job["job_id"]
    try:
        if real:
            wait_for(lambda: run.manifest().get("state") == "RUNNING"
                     and (run.records_dir / "rank00000.jsonl").exists())
        else:  # what Slurm and the ranks' start would record
            slurm_cluster.settle(job["job_id"], "RUNNING", elapsed="00:00:05", nodelist="n1")
            run.update(event="started", state="RUNNING")
        follower = subprocess.Popen([sys.executable, "-m", "hpc_tools", "logs", job["job_id"], "-f", "--runs-dir",
                                     str(runs_dir)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
        # sacct can lag the job's own start by a poll or two, and records reach the file at the first flush (2 s)
        status = wait_for(lambda: (s := json.loads(run_cli("status", run.run_id, "--json", "--runs-dir",
                                                            str(runs_dir)).stdout))["slurm_state"] == "RUNNING"
                          and (s.get("last_step") or not real) and s, timeout_s=60)
        assert status["state"] == "RUNNING" and status["status"] == "running"
        if real:
            assert status["last_step"]["step"] >= 1
            logs = run_cli("logs", run.run_id, "--runs-dir", str(runs_dir))
            assert "rendezvous ok: 2 ranks" in logs.stdout
        cancel = run_cli("cancel", run.run_id, "--runs-dir", str(runs_dir))
        assert cancel.returncode == 0, cancel.stderr
        final = wait_for(lambda: (m := json.loads(run_cli("status", run.run_id, "--json", "--runs-dir", str(runs_dir))
                                                  .stdout)).get("slurm_state") == "CANCELLED" and m, timeout_s=60)
        assert final["state"] == "CANCELLED"
        stdout, _ = follower.communicate(timeout=60)
        assert follower.returncode == 0 and ("rendezvous ok" in stdout or not real)
        again = run_cli("cancel", run.run_id, "--runs-dir", str(runs_dir))
        assert again.returncode == 2 and "already ended (CANCELLED)" in again.stderr
        assert run.manifest()["state"] == "CANCELLED"  # the ranks' late stop report did not replace it
    finally:
        subprocess.run(["scancel", job["job_id"]], timeout=30)  # never leave a runaway job behind


def test_logs_follow_returns_when_slurm_drops_the_job_at_its_deadline(slurm_cluster, runs_dir):
    # A job that cannot end before its --deadline never starts: Slurm ends it DEADLINE (no terminal state the ranks
    # could report). The rendered script runs in the run folder made for it, as `submit` would make it.
    recipe = load_recipe(REPO / COMM, profile="local")
    run = new_run(recipe, runs_dir, "sbatch")
    script = run.path / "job.sbatch"
    job_id, out = sbatch(script, run.path, "--time=10", "--deadline=now+1minute",
                         env={"HPC_TOOLS_RUN_DIR": str(run.path)})
    assert out.returncode == 0, out.stderr
    run.update(event="submitted", state="PENDING", job_id=job_id)
    if slurm_cluster.kind == "fake":
        slurm_cluster.settle(job_id, "DEADLINE", exit_code="0:0")
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


@pytest.mark.slurm
def test_the_fake_side_of_a_slurm_test_leaves_the_real_clusters_jobs_alone(tmp_path):
    """The fake side of a ``slurm_cluster`` test runs on another xdist worker while the real Slurm tests run: it must
    not settle the real cluster (tests/conftest.py ``_settled_slurm_cluster``), whose cancel of "leftover" jobs after
    15 s killed a running job of the Slurm worker in two CI runs. A held job stays queued through it."""
    script = tmp_path / "held.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=held\n#SBATCH --time=1\ntrue\n")
    job_id, out = sbatch(script, tmp_path, "--hold")
    assert out.returncode == 0, out.stderr
    try:
        # both sides collected, the real one deselected afterwards, as in the full suite
        fake = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m",
                               "fake_slurm", "-k", "answer_as_the_toolkit", __file__],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert fake.returncode == 0, fake.stdout[-3000:]
        still = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        assert still.stdout.split() == ["PENDING"], (still.stdout, still.stderr)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
