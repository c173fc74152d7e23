"""`data prepare --executor slurm` on the real Slurm test cluster: the same datasets as a local prepare, byte for
byte, written by one CPU job with --workers CPUs; bad input fails before anything is queued."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import REPO, run_cli, wait_for

pytestmark = [pytest.mark.slurm]
RECIPE = str(REPO / "recipes" / "comm_check.yaml")


def _corpus(path):
    line = "the quick brown fox jumps over the lazy dog "
    rows = [{"text": f"document {i}: " + line * (1 + i % 7)} for i in range(300)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prepare_as_a_slurm_job_equals_the_local_prepare(slurm, tmp_path):
    corpus = _corpus(tmp_path / "web.jsonl")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # The local prepare runs beside the Slurm job (which mostly waits for its turn and its start-up).
    local = ThreadPoolExecutor(1).submit(run_cli, "data", "prepare", str(corpus), "--out", str(tmp_path / "local"),
                                         "--workers", "2", "--json", env=env)
    before = set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())
    queued = run_cli("data", "prepare", str(corpus), "--out", str(tmp_path / "slurm"), "--workers", "2", "--recipe",
                     RECIPE, "--executor", "slurm", "--partition", "debug", "--time-min", "10", "--json", env=env,
                     cwd=tmp_path, timeout=300)
    try:
        assert queued.returncode == 0, queued.stderr
        result = json.loads(queued.stdout)
        assert result["documents"] == 300 and result["workers"] == 2

        def sacct() -> str:
            return subprocess.run(["sacct", "-n", "-X", "-P", "-j", result["job_id"], "-o", "State,AllocCPUS,JobName"],
                                  capture_output=True, text=True).stdout.strip()

        local = local.result(timeout=300)
        assert local.returncode == 0, local.stderr
        # submitit hands the result over as the job's task ends; the job itself completes a moment later
        wait_for(lambda: not sacct().startswith(("RUNNING", "PENDING", "COMPLETING")), 60, "the prepare job to end")
        assert sacct() == "COMPLETED|2|comm_check-prepare"
        for suffix in (".bin", ".idx"):
            slurm_bytes = (tmp_path / "slurm" / f"web{suffix}").read_bytes()
            assert slurm_bytes == (tmp_path / "local" / f"web{suffix}").read_bytes(), suffix
        assert json.loads(local.stdout)["tokens"] == result["tokens"]
    finally:
        after = set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())
        for job in after - before:
            subprocess.run(["scancel", job], check=False)


def test_bad_input_fails_before_anything_is_queued(slurm, tmp_path):
    before = subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], capture_output=True, text=True).stdout.split()
    out = run_cli("data", "prepare", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o"), "--recipe", RECIPE,
                  "--executor", "slurm", "--partition", "debug", env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 2 and "missing.jsonl" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    after = subprocess.run(["sacct", "-n", "-X", "-o", "JobID"], capture_output=True, text=True).stdout.split()
    assert after == before
    no_recipe = run_cli("data", "prepare", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o"),
                        "--executor", "slurm")
    assert no_recipe.returncode == 2 and "--recipe" in no_recipe.stderr
