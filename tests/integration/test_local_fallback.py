"""With no Slurm on the machine, `submit` runs the same job locally and says so in one line."""

from __future__ import annotations

import sys

from hpc_tools.registry import list_runs
from tests.helpers import REPO, run_cli, step_records

COMM = "recipes/comm_check.yaml"


def test_local_fallback_when_no_slurm_answers(tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH without sbatch/scontrol: this machine as a laptop
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    out = run_cli("submit", COMM, "--runs-dir", str(tmp_path / "runs"),
                  env={"PATH": str(bin_dir), "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    notes = [ln for ln in out.stderr.splitlines() if ln.startswith("no Slurm here")]
    assert len(notes) == 1 and "--executor slurm" in notes[0]
    (run,) = list_runs(tmp_path / "runs")
    assert run.manifest()["state"] == "COMPLETED" and run.manifest()["executor"] == "local"
    assert sorted(step_records(run.path)) == [0, 1]
    # Every run writes TensorBoard files as it trains (docs/tracking.md): rank 0's scalars, up to the last step.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run.path / "tensorboard"))
    events.Reload()
    last = max(r["step"] for r in step_records(run.path)[0])
    assert events.Scalars("throughput/tokens_per_s")[-1].step == last

