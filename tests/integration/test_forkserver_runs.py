"""Local CPU ranks forked from the fork server (``hpc_tools.runtime.forkserver``, the local executor's default) train
exactly as ranks that each start their own interpreter (``HPC_TOOLS_FORKSERVER=0``, as srun's ranks do): the same
losses to the last bit on every rank, the same library warnings in each rank's log (the server's import warnings are
raised again in every rank), and each rank's log its own."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import run_cli, step_records

pytestmark = [pytest.mark.slow, pytest.mark.megatron]

STEPS = 4


def local_run(tmp_path: Path, forked: bool) -> Path:
    out = run_cli("submit", "recipes/gpt_3d.yaml", "--executor", "local", "--json", "--runs-dir",
                  str(tmp_path / ("forked" if forked else "own")), "--set", f"training.train_iters={STEPS}",
                  env={"HPC_TOOLS_FORKSERVER": "1" if forked else "0"})
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    return Path(json.loads(out.stdout)["run_dir"])


def warnings_of(log: str) -> list[str]:
    """The distinct library warnings of a rank's log, without the time stamp."""
    return sorted({line.split("py.warnings: ", 1)[1] for line in log.splitlines() if "py.warnings: " in line})


def test_forked_ranks_train_as_ranks_with_their_own_interpreter(tmp_path):
    forked, own = local_run(tmp_path, True), local_run(tmp_path, False)
    got, reference = step_records(forked), step_records(own)
    assert sorted(got) == sorted(reference) == [0, 1, 2, 3]
    for rank in reference:
        assert [r["step"] for r in got[rank]] == list(range(1, STEPS + 1))
        assert [r.get("loss") for r in got[rank]] == [r.get("loss") for r in reference[rank]], rank
    assert all(r.get("loss") is not None for r in got[3])  # the last stage computes the loss
    for rank in range(4):
        log = (forked / "logs" / f"rank{rank:05d}.out").read_text()
        assert warnings_of(log) == warnings_of((own / "logs" / f"rank{rank:05d}.out").read_text()), rank
        assert warnings_of(log)  # Megatron-core's import warnings on CPU, raised again in the rank
        assert set(re.findall(r"\[rank (\d+)\]", log)) == {str(rank)}  # only this rank's lines
