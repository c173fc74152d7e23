"""A peer of a SIGKILLed rank says which rank it lost and where (issue 47): the README's main job (recipes/gpt_3d.yaml's
local profile, Megatron-core TP2 x PP2 on 4 CPU ranks) with rank 2 killed mid-run. The ranks that see the broken
collective end their log with one line naming rank 2, its node, pid and last step; none ends in the AttributeError
the engine's close used to leave behind (the schedule still inside DDP's no_sync: engine._release_model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from hpc_tools.registry import RunFolder
from tests.helpers import REPO, step_records, wait_for

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
VICTIM, KILL_AFTER = 2, 6


def test_the_peers_of_a_killed_rank_name_it_last_in_their_logs(tmp_path):
    runs = tmp_path / "runs"
    submit = subprocess.Popen([sys.executable, "-m", "hpc_tools", "submit", "recipes/gpt_3d.yaml", "--executor",
                               "local", "--runs-dir", str(runs), "--set", "training.train_iters=200",
                               "--set", "checkpoint.interval_iters=0"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        def ready():
            if submit.poll() is not None:
                raise AssertionError(f"ended before step {KILL_AFTER}: {submit.stdout.read()[-3000:]}")
            found = [p for p in runs.glob("*/manifest.json")] if runs.is_dir() else []
            if not found:
                return None
            run = RunFolder(found[0].parent)
            steps = step_records(run.path).get(0, [])
            return run if len(steps) >= KILL_AFTER and run.manifest().get("pids") else None

        run = wait_for(ready, timeout_s=300, what=f"step {KILL_AFTER}", poll_s=0.05)
        pid = run.manifest()["pids"][VICTIM]
        os.kill(pid, signal.SIGKILL)
        out, _ = submit.communicate(timeout=180)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode != 0, out[-2000:]
    logs = {r: (run.logs_dir / f"rank{r:05d}.out").read_text(errors="replace") for r in range(4) if r != VICTIM}
    for rank, text in logs.items():
        assert "has no attribute 'bucket_groups'" not in text, (rank, text[-3000:])
        assert "Exception ignored in" not in text, (rank, text[-3000:])
    named = {}
    for rank, text in logs.items():
        errors = [ln for ln in text.splitlines() if " ERROR hpc_tools: " in ln]
        if errors:
            named[rank] = errors[-1].split(" ERROR hpc_tools: ", 1)[1]
    assert named, {r: t[-1500:] for r, t in logs.items()}  # at least the ranks in a collective with it saw it go
    for rank, line in named.items():
        assert line.startswith(f"lost rank {VICTIM} (node ") and f"pid {pid}, last step " in line, (rank, line)
        assert "its process is gone; this rank's collective failed at step " in line, (rank, line)
        last = [ln for ln in logs[rank].splitlines() if ln.strip()][-1]
        assert last.endswith(line), (rank, last)  # the log's last line
    beats = json.loads((run.path / "heartbeats" / f"rank{min(named):05d}.json").read_text())
    assert beats["exit"]["code"] == 1 and "RuntimeError" in beats["exit"]["types"]  # the record the classifier reads
