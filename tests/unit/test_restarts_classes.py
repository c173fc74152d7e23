"""Failure classes in the rendered restart loop (issue 34 item 3): the job.sbatch script runs here against stand-ins
of Slurm's commands (as tests/unit/test_restarts_pyxis.py does) with an ``srun`` whose rank steps fail as scripted:
the heartbeats and srun's report a real step leaves, and rank 0's fill-in of the restart it follows. The classifier's
table is tests/unit/test_failure_class.py; the real thing on the test cluster is tests/integration."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpc_tools.recipe.load import resolve
from hpc_tools.registry import RunFolder
from hpc_tools.render.sbatch import render_sbatch
from tests.helpers import REPO
from tests.unit.test_render import small_recipe
from tests.unit.test_restarts_pyxis import RECORD, SCANCEL, SCONTROL, SQUEUE, _script, calls

pytestmark = pytest.mark.slurm_client

# srun: a rank step plays the next entry of FAKE_SCENARIO (the last one again when they run out): "ok", "killed"
# (a rank killed by a signal: no exit record, srun's report), an exception record (what hpc_tools.runtime.rank writes
# into the heartbeat, srun's exit report); "from_iteration" plays rank 0 of a restarted start resuming from that
# checkpoint iteration. Rank 1 leaves no exit record, as a peer that srun's --kill-on-bad-exit killed: the rank that
# raised is still the culprit. Other steps (probes) succeed.
SRUN = RECORD + """
args = sys.argv[1:]
if "hpc_tools.runtime.rank" not in args:
    record(cmd="srun", argv=args, step="host")
    sys.exit(0)
from hpc_tools.registry import RunFolder
from hpc_tools.runtime import heartbeat
from hpc_tools.runtime.distenv import restart_count
from hpc_tools.runtime.recovery import first_step
counter = os.environ["FAKE_CALLS"] + ".ranks"
n = int(open(counter).read()) if os.path.exists(counter) else 0
open(counter, "w").write(str(n + 1))
record(cmd="srun", argv=args, step="rank")
scenario = json.loads(os.environ["FAKE_SCENARIO"])
play = scenario[min(n, len(scenario) - 1)]
run_dir = args[args.index("--run-dir") + 1]
start = restart_count(os.environ)
node = (os.environ.get("HPC_TOOLS_NODELIST") or "node1").split(",")[0]
if play == "ok":
    sys.exit(0)
if n and play.get("from_iteration") is not None:  # rank 0 of this start completed its first step after the resume
    first_step(RunFolder(run_dir), start, play["from_iteration"] + 1)
step = play.get("at_step", 12)
if play.get("exception"):
    play["exception"]["time"] = __import__("time").time()  # it raised; srun then killed its peer (beating until then)
heartbeat.write(run_dir, heartbeat.Beat(rank=0, node=node, pid=1, restart=start, step=step,
                                        exit=play.get("exception")))
heartbeat.write(run_dir, heartbeat.Beat(rank=1, node=node, pid=2, restart=start, step=step))
if play.get("exception"):
    print(f"srun: error: {node}: task 0: Exited with exit code 1", file=sys.stderr, flush=True)
    sys.exit(1)
if play.get("oom_kill"):  # the kernel's OOM killer: slurmstepd's note, then srun's report of the killed task
    print(f"slurmstepd: error: Detected 1 oom_kill event in StepId={os.environ['SLURM_JOB_ID']}.{n}. Some of the "
          "step tasks have been OOM Killed.", file=sys.stderr, flush=True)
print(f"srun: error: {node}: task 1: Killed", file=sys.stderr, flush=True)
sys.exit(137)
"""


def exception(types, message, step=5, **extra) -> dict:
    return {"code": 1, "error": f"{types[0]}: {message}", "time": 1.0, "types": types,
            "where": "fault.py:7 in inject", "step": step - 1, "started": True, **extra}


INJECTED = exception(["ValueError"], "injected fault at step 5")
OOM = exception(["OutOfMemoryError", "RuntimeError"], "CUDA out of memory. Tried to allocate 2.00 GiB",
                knobs={"training.micro_batch_size": 4, "training.recompute_granularity": None})


def run_job(tmp_path, scenario: list, restarts: int = 3):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("squeue", SQUEUE), ("scancel", SCANCEL)):
        _script(bin_dir / name, text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_CALLS": str(tmp_path / "calls"),
           "FAKE_BATCH_LOG": str(tmp_path / "batch.out"), "FAKE_SCENARIO": json.dumps(scenario),
           "SLURM_JOB_ID": "4343", "SLURM_JOB_NODELIST": "node[1-2]", "SLURMD_NODENAME": "node1",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path), "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs"),
           "PYTHONPATH": str(REPO)}
    for name in ("HPC_TOOLS_RUN_DIR", "HPC_TOOLS_RESTART_BASE", "SLURM_RESTART_COUNT", "HPC_TOOLS_NODELIST"):
        env.pop(name, None)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(resolve(small_recipe(restarts=restarts)), "classes.yaml"))
    with open(tmp_path / "batch.out", "w") as log:
        out = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                             timeout=240)
    batch_log = (tmp_path / "batch.out").read_text()
    ranks = [c for c in calls(tmp_path / "calls") if c.get("step") == "rank"]
    manifest = RunFolder(tmp_path / "runs" / "setup-j4343").manifest()
    return out.returncode, batch_log, len(ranks), manifest


def stop_lines(batch_log: str) -> list[str]:
    return [line for line in batch_log.splitlines() if line.startswith("hpc_tools: no restart: ")]


def test_an_exception_at_a_fixed_step_spends_no_restart(tmp_path):
    rc, log, steps, manifest = run_job(tmp_path, [{"exception": INJECTED, "at_step": 4}])
    assert rc != 0 and steps == 1, log[-3000:]
    [entry] = manifest["restarts"]
    assert (entry["kind"], entry["class"], entry["decision"]) == ("stop", "user error", "stop")
    assert stop_lines(log) == ["hpc_tools: no restart: user error: ValueError: injected fault at step 5 after step 4 "
                               "(fault.py:7 in inject)"], log[-3000:]
    assert "hpc_tools: restart " not in log


def test_an_oom_stops_with_a_fix_line(tmp_path):
    rc, log, steps, manifest = run_job(tmp_path, [{"exception": OOM}])
    assert rc != 0 and steps == 1, log[-3000:]
    [entry] = manifest["restarts"]
    assert (entry["kind"], entry["class"], entry["decision"]) == ("stop", "oom", "stop")
    [line] = stop_lines(log)
    assert line.startswith("hpc_tools: no restart: oom: OutOfMemoryError: CUDA out of memory.")
    assert "; try --set training.micro_batch_size=2 or --set training.recompute_granularity=full" in line
    status = subprocess.run([sys.executable, "-m", "hpc_tools", "status", str(tmp_path / "runs" / "setup-j4343")],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "oom: stop (OutOfMemoryError: CUDA out of memory." in status.stdout, status.stdout + status.stderr


def test_a_rank_the_kernel_oom_killer_ended_stops_with_a_fix_line(tmp_path):
    rc, log, steps, manifest = run_job(tmp_path, [{"oom_kill": True}])
    assert rc != 0 and steps == 1, log[-3000:]
    [entry] = manifest["restarts"]
    assert (entry["kind"], entry["cause"], entry["class"]) == ("stop", "killed", "oom")
    [line] = stop_lines(log)
    assert line.startswith("hpc_tools: no restart: oom: the kernel's OOM killer ended a rank") and "; try " in line


def test_a_fault_repeated_from_the_same_checkpoint_stops_after_two_restarts(tmp_path):
    rc, log, steps, manifest = run_job(tmp_path, [{"from_iteration": 10}], restarts=5)
    assert rc != 0 and steps == 3, log[-3000:]
    first, second, refused = manifest["restarts"]
    assert [e["kind"] for e in (first, second)] == ["in-job", "in-job"]
    assert [e["from_iteration"] for e in (first, second)] == [10, 10]
    assert (refused["kind"], refused["class"], refused["decision"]) == ("stop", "infrastructure", "stop")
    [line] = stop_lines(log)
    assert line.startswith("hpc_tools: no restart: no progress: the last two restarts both resumed from checkpoint "
                           "iteration 10"), line


def test_a_killed_rank_still_restarts(tmp_path):
    rc, log, steps, manifest = run_job(tmp_path, [{"from_iteration": None}, "ok"])
    assert rc == 0 and steps == 2, log[-3000:]
    [entry] = manifest["restarts"]
    assert (entry["kind"], entry["cause"], entry["class"], entry["decision"]) == \
        ("in-job", "killed", "infrastructure", "restart")
    assert (entry["node"], entry["nodes"]) == ("node1", ["node2"])  # left out: the allocation holds a spare
    assert "hpc_tools: restart 1 of 3 in this run (killed: " in log and not stop_lines(log)


@pytest.mark.parametrize("peer_stale_s, cls, rank", [(0.0, "user error", 0), (30.0, "infrastructure", 1)])
def test_a_rank_that_raised_is_the_culprit_only_while_its_silent_peer_was_alive(tmp_path, peer_stale_s, cls, rank):
    """Rank 0 raised an error of its own; rank 1 left no exit record. Beating until rank 0 raised, rank 1 was killed
    after it (srun's --kill-on-bad-exit): the user error stops. Silent for 30 s before, rank 1 died first and rank 0's
    error (whatever its words) followed from it: infrastructure, restart."""
    import time

    from hpc_tools.job import restarts
    from hpc_tools.runtime import heartbeat
    from tests.unit.test_restarts import run_folder

    run = run_folder(tmp_path)
    now = time.time()
    raised = {"code": 1, "error": "RuntimeError: an error in words no pattern knows", "time": now,
              "types": ["RuntimeError"], "step": 12, "started": True}
    for beat, at in ((heartbeat.Beat(rank=0, node="n1", pid=1, step=12, exit=raised), now),
                     (heartbeat.Beat(rank=1, node="n2", pid=2, step=12), now - peer_stale_s)):
        path = heartbeat.heartbeat_path(run.path, beat.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**beat.__dict__, "time": at}))
    found = {"cause": "lost", "rank": 1, "node": "n2", "reason": "rank 1 on n2 ended without an exit record"}
    verdict = restarts.judge(run, found, 0, run.manifest())
    assert (verdict["class"], verdict.get("rank", found["rank"])) == (cls, rank), verdict
    assert verdict["decision"] == ("stop" if cls == "user error" else "restart")
