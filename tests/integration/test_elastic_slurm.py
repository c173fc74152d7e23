"""Elastic training (issue 32 item 1, cluster.min_nodes) on the real 2-node test cluster: a node lost for good, no
spare, and the run goes on on the node that remains, in the same Slurm job.

Two rendered sbatch scripts run in turn on n1 and n2 (2 ranks each, cluster.min_nodes=1, cluster.restarts=2, no spare):
`megatron` (recipes/gpt_3d.yaml's local profile: Megatron-core TP2 x PP2, the plain optimizer, whose state reshards
across TP/PP) and `fsdp` (recipes/llama_fsdp.yaml's local profile: FSDP2 over 4 ranks). Once a job has done step
FAULT_AT, every process of n2 is killed (slurmd, slurmstepd, the ranks) and n2 stays down until the job ends. The job's
restart controller gives up on n2 after WAIT_S (HPC_TOOLS_ELASTIC_WAIT_S; the default is 30 s) and starts a step on n1
alone, whose ranks train in the layout the planner chose for one node (the run folder's elastic.json) from the newest
checkpoint resharded into it. The global batch and the data order are the recipe's, so every loss must stay within
LOSS_ATOL of an uninterrupted local run of the same recipe (fp32; measured within 5e-7 here), which runs beside the job.
The Megatron job trains the local profile's steps (30), so its uninterrupted run is the README's main command that the
session shares (tests/conftest.py ``main_command``: the same recipe, global batch, data order and learning-rate
schedule; its distributed optimizer and TP2 x PP2 order the fp32 sums otherwise, within LOSS_ATOL): four rank starts
fewer. The FSDP job (40 steps, no shared run of llama_fsdp) has its own.
Figures (the time from the step's end to the first step on fewer nodes) are printed with -s. Preflight is off: here the
node is lost mid-run (preflight leaving a node out before step 1 is test_preflight_leave_out_ranks.py's); with it on, a
loaded machine once had it leave n1 out, and n2 was never crashed. (The jobs once ran side by side under one crash; the
Megatron job then needed 150 steps to be still training when the slower FSDP job reached FAULT_AT, several times the CPU
of this order.)
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hpc_tools.recipe.load import load_recipe
from hpc_tools.registry import RunFolder
from tests.helpers import loss_curve, run_cli, sbatch_rendered
from tests.integration.test_restarts_slurm import in_queue, newest_step, sacct_lines

FAULT_AT, EVERY = 12, 5
WAIT_S = 5  # the restart controller's waits for the lost node and for its tasks (hpc_tools.job.restarts)
LOSS_ATOL = 1e-4  # the bound; fp32 reductions in another order differ by a few ulps
COMMON = ["--profile", "local", "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=2",
          "--set", "cluster.min_nodes=1", "--set", "cluster.restarts=2", "--set", f"checkpoint.interval_iters={EVERY}",
          "--set", 'cluster.setup.env.OMP_NUM_THREADS="1"',
          "--set", "cluster.hang_timeout_min=0.5", "--set", "cluster.time_limit=15", "--set", "cluster.preflight=off",
          # n2 stays down and its tasks never report: waiting for either the default 30 s and 20 s changes nothing
          "--set", f'cluster.setup.env.HPC_TOOLS_ELASTIC_WAIT_S="{WAIT_S}"',
          "--set", f'cluster.setup.env.HPC_TOOLS_STUCK_STEP_S="{WAIT_S}"']
# name -> (recipe, its settings, steps, whether the uninterrupted run is the session's main_command)
JOBS = {"megatron": ("recipes/gpt_3d.yaml", ["--set", "backend.megatron.distributed_optimizer=false"], 30, True),
        "fsdp": ("recipes/llama_fsdp.yaml", [], 40, False)}
DEADLINE_S = 900

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.megatron, pytest.mark.slow]


@dataclass
class Job:
    name: str
    job_id: str
    run: RunFolder
    crashed_at_step: int | None = None
    done: bool = False
    reference: dict = field(default_factory=dict)


def submit(tmp: Path, name: str) -> Job:
    recipe, sets, iters, _ = JOBS[name]
    job_id, run = sbatch_rendered(tmp, name, recipe, *COMMON, *sets, "--set", f"training.train_iters={iters}")
    return Job(name, job_id, RunFolder(run))


def reference(tmp: Path, name: str, box: dict, main_command) -> None:
    """The uninterrupted run, on the local executor (4 ranks on this machine): (returncode, run folder, stderr)."""
    recipe, sets, iters, shared = JOBS[name]
    if shared:
        assert load_recipe(recipe, profile="local").training.train_iters == iters  # the shared run's steps
        out = main_command(recipe)
        box[name] = (out["returncode"], out["result"].get("run_dir"), out["stderr"])
        return
    out = run_cli("submit", recipe, *COMMON, *sets, "--set", f"training.train_iters={iters}",
                  "--executor", "local", "--json", "--runs-dir", str(tmp / f"reference-{name}"), timeout=DEADLINE_S)
    box[name] = (out.returncode, out.returncode == 0 and json.loads(out.stdout)["run_dir"], out.stderr)


@pytest.fixture(scope="module", params=list(JOBS))
def job(request, tmp_path_factory, main_command) -> Job:
    """One job, n2 crashed once it has done FAULT_AT steps, and brought back after the job ended."""
    from hpc_tools.testing.slurm_faults import crash_node, node_state, restart_slurmd
    from tests.helpers import need_slurm, wait_for

    need_slurm(2)
    name = request.param
    tmp = tmp_path_factory.mktemp(f"elastic-{name}")
    box: dict = {}
    ref = threading.Thread(target=reference, args=(tmp, name, box, main_command), daemon=True)
    ref.start()
    j = submit(tmp, name)
    crashed = False
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and not j.done:
            if not crashed and newest_step(j.run, 0) >= FAULT_AT:
                j.crashed_at_step = newest_step(j.run, 0)
                crash_node("n2")  # and it stays down: no spare, nothing comes back
                crashed = True
            j.done = not in_queue(j.job_id)
            time.sleep(0.2)
        ref.join(timeout=max(deadline - time.monotonic(), 1))
        for entry in j.run.manifest().get("restarts") or []:
            print(f"\n{name} (job {j.job_id}): {entry.get('cause')} on {entry.get('node')}, continued on "
                  f"{entry.get('nodes')} from iteration {entry.get('from_iteration')}, first step on fewer nodes "
                  f"{entry.get('time_to_first_step_s')} s after the failed step ended")
        j.reference = box
        yield j
    finally:
        subprocess.run(["scancel", j.job_id], timeout=30)
        if crashed:
            restart_slurmd("n2")
            subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], capture_output=True, timeout=10)
            wait_for(lambda: node_state("n2") in ("idle", "mixed", "allocated"), timeout_s=120, what="n2 back")


def test_a_lost_node_without_a_spare_leaves_the_run_training_on_the_other(job):
    j: Job = job
    name = j.name
    assert j.crashed_at_step is not None, f"{name}: n2 was never crashed (job {j.job_id})"
    assert j.done, f"{name}: job {j.job_id} still queued: {j.run.manifest().get('state')}"
    m = j.run.manifest()
    assert m["state"] == "COMPLETED", (m["state"], m.get("reason"), m["events"][-4:])
    # one Slurm life, no requeue. Slurm's accounting shows the job resized off n2, then completed on n1, once
    # slurmctld has marked n2 DOWN (SlurmdTimeout, not the job's doing): a job that ends sooner completes on n[1-2]
    records = [x for x in sacct_lines(j.job_id) if x[0] == j.job_id]
    assert [x[1] for x in records] in (["RESIZING", "COMPLETED"], ["COMPLETED"]), records
    assert records[-1][2] == ("n1" if len(records) == 2 else "n[1-2]"), records
    [entry] = m["restarts"]
    assert entry["kind"] == "in-job" and entry["decision"] == "fewer nodes" and entry["nodes"] == ["n1"], entry
    assert entry["node"] == "n2" and entry["layout_nodes"] == 1, entry
    assert 0 < entry["from_iteration"] <= j.crashed_at_step and entry["from_iteration"] % EVERY == 0, entry
    assert 0 < entry["time_to_first_step_s"] < DEADLINE_S
    # both layouts in the manifest and status: the recipe's on 2 nodes, the planner's on 1 from the resumed step
    full, fewer = m["layouts"]
    assert (full["nodes"], full["from_iteration"], full["cause"]) == (2, 0, "recipe")
    assert (fewer["nodes"], fewer["from_iteration"], fewer["cause"]) == (1, entry["from_iteration"], "fewer nodes")
    assert "on 1x2 ranks" in fewer["layout"] and fewer["layout"] != full["layout"]
    elastic = json.loads((j.run.path / "elastic.json").read_text())
    assert elastic["layouts"]["1"] and "1" not in elastic["unplanned"]
    text = run_cli("status", str(j.run.path)).stdout
    assert f"layout   from step {entry['from_iteration']}: {fewer['layout']} (fewer nodes)" in text, text
    assert "on fewer nodes" in text  # the goodput line's degraded time
    # the global batch and the data order are the recipe's: the uninterrupted run's losses at every step
    out = j.reference.get(name)
    assert out is not None and out[0] == 0 and out[1], out and out[2][-3000:]
    want = loss_curve(Path(out[1]))
    got = loss_curve(j.run.path)
    assert sorted(got) == sorted(want) == list(range(1, JOBS[name][2] + 1))
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= LOSS_ATOL, {s: (got[s], want[s]) for s in want if abs(got[s] - want[s]) > LOSS_ATOL}
