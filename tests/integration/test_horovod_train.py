"""backend.kind: horovod through the real CLI: the FSDP recipe (recipes/llama_fsdp.yaml, its local profile on 2 CPU
ranks, fp32) switched with one ``--set backend.kind=horovod`` trains to DDP's losses (``--set
backend.fsdp.strategy=ddp``) over 20 steps within 1e-5; its checkpoint (step 10, through the project's saver) resumes
under Horovod to the uninterrupted losses; and on the Slurm test cluster a Horovod run across both nodes (srun ranks,
Horovod's gloo rendezvous, no ssh) trains with DDP's losses.

Horovod is installed by ``environment/install-horovod.sh`` (environment/test.sh starts it beside the first tests;
the marker ``extra_env`` runs it again before these tests, which waits for it): should it fail, the runs are refused
in one line and these tests fail, they do not skip."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from hpc_tools.registry import RunFolder, list_runs
from tests.helpers import loss_curve, run_cli, shared_once, step_records

pytestmark = [pytest.mark.slow, pytest.mark.extra_env]  # Horovod installs beside the first tests

RECIPE = "recipes/llama_fsdp.yaml"
STEPS = 20
SIZE = ["training.train_iters=20", "checkpoint.interval_iters=10", "training.log_interval=10"]
TOL = 1e-5
"""fp32, the same model, data and AdamW: Horovod's gloo all-reduce and DDP's differ in reduction order only."""


def submit(folder: Path, *sets: str, executor: str = "local", ranks_per_node: int = 2) -> dict:
    extra = ["--wait"] if executor == "slurm" else []
    out = run_cli("submit", RECIPE, "--profile", "local", "--executor", executor, *extra, "--json", "--runs-dir",
                  str(folder), *[x for s in [*SIZE, f"cluster.gpus_per_node={ranks_per_node}", *sets]
                                 for x in ("--set", s)], timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout)
    assert RunFolder(result["run_dir"]).manifest()["state"] == "COMPLETED", result
    return result


def curve(result: dict, first: int = 1) -> np.ndarray:
    losses = loss_curve(Path(result["run_dir"]))
    assert sorted(losses) == list(range(first, STEPS + 1)), sorted(losses)
    return np.array([losses[s] for s in range(first, STEPS + 1)])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    """The DDP reference, once per session (the Slurm test, in another xdist group, compares with it too)."""
    return shared_once(tmp_path_factory, "horovod-ddp-reference",
                       lambda folder: submit(folder, "backend.fsdp.strategy=ddp"))


@pytest.fixture(scope="module")
def horovod(tmp_path_factory) -> dict:
    return submit(tmp_path_factory.mktemp("horovod"), "backend.kind=horovod")


def test_horovod_trains_to_ddps_losses(ddp, horovod):
    reference, got = curve(ddp), curve(horovod)
    np.testing.assert_allclose(got, reference, rtol=0, atol=TOL)
    assert got[-1] < got[0] - 0.3, got  # it trained
    log = "\n".join(p.read_text(errors="replace") for p in (Path(horovod["run_dir"]) / "logs").rglob("*")
                    if p.is_file())
    assert "DistributedOptimizer over 2 ranks" in log and "Horovod 0.28.1 joined" in log


def test_every_rank_records_the_same_loss(horovod):
    per_rank = step_records(Path(horovod["run_dir"]))
    assert sorted(per_rank) == [0, 1]
    losses = [[r["loss"] for r in recs] for recs in per_rank.values()]
    assert losses[0] == losses[1]


def test_horovod_checkpoint_resumes_to_the_uninterrupted_losses(horovod, tmp_path_factory):
    """Step 10's checkpoint (the project's saver: verified, committed; torch Distributed Checkpoint), loaded by a new
    Horovod run: steps 11-20 as the uninterrupted run's."""
    saved = Path(horovod["run_dir"]) / "checkpoints" / "iter_0000010"
    assert (saved / "dcp" / ".metadata").is_file()
    meta = json.loads(next(saved.glob("*.json")).read_text())
    assert meta["backend"] == "horovod" and meta["format"] == "torch_dcp" and meta["step"] == 10
    resumed = submit(tmp_path_factory.mktemp("horovod_resumed"), "backend.kind=horovod",
                     f"checkpoint.load_path={saved}")
    np.testing.assert_allclose(curve(resumed, first=11), curve(horovod)[10:], rtol=0, atol=1e-6)


@pytest.mark.slurm
@pytest.mark.multinode
def test_horovod_across_two_nodes_trains_with_ddps_losses(slurm_multinode, ddp, tmp_path):
    """One rank on each node of the test cluster, started by srun from the rendered batch script (as
    jobs/llama_horovod.sbatch runs); Horovod meets through its gloo rendezvous, no ssh."""
    script = tmp_path / "job.sbatch"
    sets = [*SIZE, "backend.kind=horovod", "cluster.nodes=2", "cluster.gpus_per_node=1"]
    out = run_cli("render", RECIPE, "--profile", "local", *[x for s in sets for x in ("--set", s)], "-o", str(script))
    assert out.returncode == 0, out.stderr
    job = subprocess.run(["sbatch", "--parsable", "--wait", str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs")})
    (run,) = list_runs(tmp_path / "runs")
    assert job.returncode == 0 and run.manifest()["state"] == "COMPLETED", (job.stderr, run.manifest())
    nodes = {rank: recs[0]["node"] for rank, recs in step_records(run.path).items()}
    assert sorted(nodes) == [0, 1] and len(set(nodes.values())) == 2, nodes
    np.testing.assert_allclose(curve({"run_dir": str(run.path)}), curve(ddp), rtol=0, atol=TOL)
