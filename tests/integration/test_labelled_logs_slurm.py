"""Scripts on the real Slurm test cluster: a plain `sbatch` of a rendered comm_check job, 2 ranks on 2 nodes, with an
extra #SBATCH directive. Every rank's lines reach the one batch log labelled with the rank (srun --label), `logs
--rank N` prints only rank N's lines, srun gets the CPUs per task that sbatch got, and the run folder is readable by
the group and others (0755 / 0644)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from hpc_tools.registry import RunFolder
from tests.helpers import REPO, run_cli

pytestmark = [pytest.mark.slurm, pytest.mark.multinode]
COMM = "recipes/comm_check.yaml"


def test_two_rank_job_labels_each_rank_and_logs_picks_one(slurm_multinode, tmp_path):
    # The rank interpreter is a wrapper that says which rank it is, so rank 1 (silent in comm_check) has a line too.
    python = tmp_path / "python-wrapper"
    python.write_text('#!/bin/bash\necho "hello from rank ${SLURM_PROCID:-batch}" >&2\nexec python3 "$@"\n')
    python.chmod(0o755)
    script, runs = tmp_path / "labelled.sbatch", tmp_path / "runs"
    sets = ["cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.cpus_per_task=2", f"cluster.python={python}",
            "cluster.sbatch_extra=[--comment=hpc_tools-labelled-logs]"]
    rendered = run_cli("render", COMM, "--profile", "local", *[w for s in sets for w in ("--set", s)], "-o",
                       str(script))
    assert rendered.returncode == 0, rendered.stderr
    assert "#SBATCH --comment=hpc_tools-labelled-logs" in script.read_text()
    out = subprocess.run(["sbatch", "--parsable", "--wait", str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HPC_TOOLS_RUNS_DIR": str(runs), "PYTHONPATH": str(REPO)})
    job_id = out.stdout.strip().split(";")[0]
    try:
        assert out.returncode == 0, out.stderr
        run = RunFolder(runs / f"comm_check-j{job_id}")
        log = Path(run.manifest()["batch_log"]).read_text()
        assert "0: hello from rank 0" in log and "1: hello from rank 1" in log, log
        assert re.search(r"^0: .*rendezvous ok: 2 ranks", log, re.MULTILINE), log

        one = run_cli("logs", job_id, "--rank", "1", "--runs-dir", str(runs))
        assert one.returncode == 0, one.stderr
        lines = one.stdout.splitlines()
        assert lines[0] == "hello from rank 1", one.stdout  # rank 1's lines only, the label removed
        assert not [ln for ln in lines if "rank 0" in ln or "rendezvous" in ln or "hpc_tools: run" in ln], lines
        zero = run_cli("logs", job_id, "--rank", "0", "--runs-dir", str(runs))
        assert "rendezvous ok: 2 ranks" in zero.stdout and "rank 1" not in zero.stdout
        assert "hpc_tools: run folder" not in zero.stdout  # the batch shell's own lines belong to no rank
        outside = run_cli("logs", job_id, "--rank", "2", "--runs-dir", str(runs))
        assert outside.returncode == 2 and "--rank 2 is not a rank of run" in outside.stderr and not outside.stdout

        # srun -c 2: the rank step holds 2 CPUs per task on each node (22.05's srun would give 1 without it)
        step = subprocess.run(["sacct", "-j", f"{job_id}.0", "-n", "-P", "-o", "AllocCPUS"], capture_output=True,
                              text=True, timeout=30)
        assert step.stdout.split() == ["4"], step.stdout

        # a plain sbatch job's run folder (made by the open_run step) is readable by the group and others
        assert stat.S_IMODE(run.path.stat().st_mode) == 0o755 & ~_umask()
        for name in ("manifest.json", "recipe.yaml", "job.sbatch"):
            assert stat.S_IMODE((run.path / name).stat().st_mode) == 0o644 & ~_umask(), name
    finally:
        if job_id:
            subprocess.run(["scancel", job_id], timeout=30)


def _umask() -> int:
    from profiling.files import current_umask

    return current_umask()
