"""In-job restarts (cluster.restarts, cluster.spare_nodes): the decision after a failed rank step, the nodes of the new
step, the record in the manifest, and what the rendered script and the Slurm flags become. The real thing (kill -9,
SIGSTOP, a crashed node on the 2-node test cluster) is tests/integration/test_restarts_slurm.py."""

from __future__ import annotations

import json
import os
import shlex
import subprocess

import pytest

from hpc_tools.job import restarts
from hpc_tools.recipe.load import dump_resolved, load_recipe
from hpc_tools.registry import RunFolder
from hpc_tools.render.envsetup import rank_srun_args
from hpc_tools.render.sbatch import render_sbatch
from hpc_tools.render.slurm_params import SlurmSpec
from hpc_tools.runtime import heartbeat
from hpc_tools.runtime.heartbeat import Beat
from hpc_tools.runtime.recovery import first_step
from tests.helpers import REPO

RECIPE = REPO / "recipes" / "gpt_zero.yaml"
TWO_NODES = ["cluster.nodes=2", "cluster.gpus_per_node=1"]


def recipe(*sets: str):
    return load_recipe(RECIPE, overrides=[*TWO_NODES, *sets], profile="local")


def run_folder(tmp_path, *sets: str, **manifest) -> RunFolder:
    text = dump_resolved(recipe(*sets))
    run = RunFolder.create(tmp_path, "r", text, "", {"executor": "sbatch", "state": "RUNNING", "world_size": 2,
                                                     "job_id": "77", **manifest})
    run.update(event="started", state="RUNNING", restart_count=0)
    return run


def kill_report(run: RunFolder, node: str = "n2", rank: int = 1) -> None:
    """What srun wrote into the batch log when rank ``rank`` was killed, and the heartbeats of that start."""
    log = run.path / "batch.out"
    log.write_text(f"hpc_tools: run folder {run.path}\nsrun: error: {node}: task {rank}: Killed\n"
                   "srun: error: n1: task 0: Killed\n")
    run.update(batch_log=str(log))
    heartbeat.write(run.path, Beat(rank=0, node="n1", pid=1, restart=0, step=12))
    heartbeat.write(run.path, Beat(rank=rank, node=node, pid=2, restart=0, step=12))


ENV = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-3]"}


@pytest.fixture
def cluster(monkeypatch):
    """Slurm's view, played: the job's nodes and which of them answer a probe step."""
    state = {"nodes": ["n1", "n2"], "down": set(), "requeued": []}
    monkeypatch.setattr(restarts.nodes, "allocation_nodes", lambda job, env: list(state["nodes"]))
    return state


def decide(run, cluster, exit_code=137, env=ENV, wait_s=0.0):
    return restarts.next_step(run.path, exit_code, dict(env), prober=lambda n: n not in cluster["down"],
                              wait_s=wait_s, requeue=lambda job: cluster["requeued"].append(job) or True)


def exported(line: str) -> dict[str, str]:
    words = shlex.split(line)
    assert words[0] == "export"
    return dict(w.split("=", 1) for w in words[1:])


def test_a_killed_rank_gets_a_new_step_on_the_same_nodes_and_is_recorded(tmp_path, cluster):
    run = run_folder(tmp_path, "cluster.restarts=2")
    kill_report(run)
    env = exported(decide(run, cluster))
    assert env["HPC_TOOLS_NODELIST"] == "n1,n2" and env["MASTER_ADDR"] == "n1"
    assert env["HPC_TOOLS_RESTART_BASE"] == "1" and env["HPC_TOOLS_EXCLUDED"] == ""
    assert int(env["MASTER_PORT"]) != restarts.step_port("77", 0)  # the ended step's store may hold its port
    m = run.manifest()
    assert m["state"] == "STARTING" and m["restart_count"] == 1 and m["reason"] is None
    [entry] = m["restarts"]
    assert entry["cause"] == "killed" and entry["rank"] == 1 and entry["node"] == "n2" and entry["kind"] == "in-job"
    assert entry["reason"] == "rank 1 on n2 was killed by signal 9 (Killed) after step 12"
    assert entry["from_iteration"] is None and entry["time_to_first_step_s"] is None
    # rank 0 of the new start fills in where it resumed and how long the fault took to the first step
    first_step(run, 1, 11)
    [entry] = run.manifest()["restarts"]
    assert entry["from_iteration"] == 10 and 0 <= entry["time_to_first_step_s"] < 60
    events = [json.loads(x) for x in (run.records_dir / "events_rank00000.jsonl").read_text().splitlines()]
    assert [(e["event"], e["restart"], e["seconds"]) for e in events] == [("recovery", 1,
                                                                           entry["time_to_first_step_s"])]


def test_the_budget_is_spent_then_the_failure_ends_the_job(tmp_path, cluster):
    run = run_folder(tmp_path, "cluster.restarts=1")
    kill_report(run)
    assert decide(run, cluster) is not None
    run.update(event="started", state="RUNNING", restart_count=1)
    kill_report(run)
    assert decide(run, cluster, env={**ENV, "HPC_TOOLS_RESTART_BASE": "1"}) is None
    assert len(run.manifest()["restarts"]) == 1
    assert decide(run_folder(tmp_path / "off"), cluster) is None  # restarts: 0 (the default): never


def test_no_restart_after_a_stop_signal_or_success(tmp_path, cluster):
    run = run_folder(tmp_path, "cluster.restarts=2")
    assert decide(run, cluster, exit_code=0) is None
    run.update(event="preempted", state="REQUEUED")  # the time-limit signal: the ranks checkpointed and requeued
    assert decide(run, cluster) is None and "restarts" not in run.manifest()


def test_a_spare_node_replaces_the_failed_one(tmp_path, cluster):
    cluster["nodes"] = ["n1", "n2", "n3"]
    run = run_folder(tmp_path, "cluster.restarts=2", "cluster.spare_nodes=1")
    kill_report(run)
    env = exported(decide(run, cluster))
    assert env["HPC_TOOLS_NODELIST"] == "n1,n3" and env["HPC_TOOLS_EXCLUDED"] == "n2"
    assert run.manifest()["restarts"][0]["nodes"] == ["n1", "n3"]


def test_without_a_spare_the_failed_node_is_waited_for_and_then_the_job_requeued(tmp_path, cluster):
    run = run_folder(tmp_path, "cluster.restarts=2")
    kill_report(run)
    cluster["down"] = {"n2"}  # its slurmd does not answer (a crashed node)
    assert decide(run, cluster) is None
    assert cluster["requeued"] == ["77"]
    m = run.manifest()
    assert m["state"] == "REQUEUED" and m["restarts"][0]["kind"] == "requeue"


def test_a_node_that_comes_back_is_used_again(tmp_path, cluster, monkeypatch):
    run = run_folder(tmp_path, "cluster.restarts=2")
    kill_report(run)
    answers = iter([False, False, True])  # n2's slurmd answers the third probe
    monkeypatch.setattr(restarts.nodes.time, "sleep", lambda s: None)
    line = restarts.next_step(run.path, 137, dict(ENV), prober=lambda n: n == "n1" or next(answers), wait_s=60)
    assert exported(line)["HPC_TOOLS_NODELIST"] == "n1,n2"


def test_a_hang_verdict_is_the_cause_and_is_set_aside(tmp_path, cluster):
    run = run_folder(tmp_path, "cluster.restarts=2")
    run.update(state="HANG", reason="rank 1 (n2) stopped responding in all_reduce", failed_ranks=[1],
               failed_nodes=["n2"])
    (run.path / "HANG.txt").write_text("rank 1 (n2) stopped responding in all_reduce\n")
    assert decide(run, cluster, exit_code=86) is not None
    entry = run.manifest()["restarts"][0]
    assert entry["cause"] == "hang" and entry["rank"] == 1 and entry["node"] == "n2"
    assert not (run.path / "HANG.txt").exists() and (run.path / "hang" / "HANG-restart0.txt").is_file()
    assert run.manifest()["state"] == "STARTING"


def test_a_requeued_life_numbers_its_start_above_the_in_job_restarts(tmp_path, monkeypatch):
    # the allocation as scontrol would give it (no Slurm client needed here; the Slurm tests ask the real one)
    monkeypatch.setattr(restarts.nodes, "allocation_nodes", lambda job, env: ["n1"])
    run = run_folder(tmp_path, "cluster.restarts=2")
    run.update(event="started", state="RUNNING", restart_count=1)  # an in-job restart of the first life
    line = restarts.begin(run.path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1", "SLURM_JOB_NODELIST": "n1"})
    env = exported(line)
    assert env["HPC_TOOLS_RESTART_BASE"] == "1"  # 1 (Slurm's count) + 1 = start 2, not a second start 1


def test_slurm_flags_and_the_rendered_loop():
    spec = SlurmSpec.from_recipe(recipe("cluster.restarts=2", "cluster.spare_nodes=1"))
    assert ("nodes", "3") in spec.sbatch_options() and ("no-kill", None) in spec.sbatch_options()
    assert spec.submitit_parameters()["nodes"] == 3 and spec.submitit_parameters()["additional_parameters"]["no-kill"]
    assert rank_srun_args(recipe("cluster.restarts=2", "cluster.spare_nodes=1").cluster)[-2:] == ["--nodes=2",
                                                                                                   "--ntasks=2"]
    plain = render_sbatch(recipe())
    assert "job.restarts next" not in plain and "--no-kill" not in plain and "#SBATCH --nodes=2" in plain
    assert "hpc_tools.job.restarts watch" in plain  # restarts: 0 too: a crashed node's step must end (issue 48)
    script = render_sbatch(recipe("cluster.restarts=2"))
    assert "while :; do" in script and "hpc_tools.job.restarts next" in script
    assert '--overlap ${HPC_TOOLS_NODELIST:+"--nodelist=$HPC_TOOLS_NODELIST"}' in script
    assert "hpc_tools.job.restarts watch" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_the_rendered_loop_of_an_elastic_job():
    """--no-kill, elastic.json planned before the first step, the controller told min_nodes, and the rank step sized
    by the counts the controller exports (two srun words when set, none when not)."""
    from hpc_tools.recipe.load import load_recipe

    elastic = load_recipe(REPO / "recipes" / "llama_fsdp.yaml", [*TWO_NODES, "cluster.restarts=2",
                                                                "cluster.min_nodes=1"], profile="local")
    spec = SlurmSpec.from_recipe(elastic)
    assert ("no-kill", None) in spec.sbatch_options() and spec.submitit_parameters()["additional_parameters"]["no-kill"]
    script = render_sbatch(elastic)
    assert 'python3 -m hpc_tools.planner.elastic --run-dir "$RUN_DIR"' in script
    assert script.index("hpc_tools.planner.elastic") < script.index("hpc_tools.job.restarts begin")
    assert "--min-nodes 1 --ranks-per-node 1" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    [srun] = [line for line in script.splitlines() if "-m hpc_tools.runtime.rank" in line]
    words = srun.split(" -m hpc_tools.runtime.rank")[0].strip()
    expand = 'for w in ' + words.split(" ", 1)[1] + '; do echo "[$w]"; done'
    out = subprocess.run(["bash", "-c", expand], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "HPC_TOOLS_STEP_NODES": "1", "HPC_TOOLS_STEP_TASKS": "4",
                              "HPC_TOOLS_NODELIST": "n1"})
    assert "[--nodes=1]" in out.stdout and "[--ntasks=4]" in out.stdout and "[--nodelist=n1]" in out.stdout, out
    unset = subprocess.run(["bash", "-c", expand], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert "--nodes" not in unset.stdout and "--ntasks" not in unset.stdout
    assert "HPC_TOOLS_STEP_NODES" not in render_sbatch(recipe("cluster.restarts=2"))  # not elastic: no counts


def test_spares_without_restarts_are_refused(cli):
    out = cli("validate", str(RECIPE), "--profile", "local", "--set", "cluster.spare_nodes=1")
    assert out.returncode != 0
    assert "cluster.spare_nodes=1 are only used by in-job restarts" in out.stdout + out.stderr


def test_a_step_that_outlives_a_failed_rank_is_cancelled(tmp_path, monkeypatch):
    """After a node crash srun waits for the lost node's tasks forever: the watcher cancels the step."""
    run = run_folder(tmp_path, "cluster.restarts=2")
    heartbeat.write(run.path, Beat(rank=0, node="n1", pid=1, restart=0, step=12,
                                   exit={"code": 1, "error": "RuntimeError: Connection closed by peer", "time": 1.0}))
    heartbeat.write(run.path, Beat(rank=1, node="n2", pid=2, restart=0, step=12))
    monkeypatch.setattr(restarts.stuck, "rank_steps", lambda job: ["77.0"])
    cancelled = []
    line = restarts.watch(run.path, dict(ENV), grace_s=0.0, poll_s=0.01, cancel=cancelled.append)
    assert cancelled == ["77.0"] and "rank 0 failed" in line


def test_the_stuck_step_wait_comes_from_the_environment(tmp_path, monkeypatch):
    """HPC_TOOLS_STUCK_STEP_S (a site's setting, cluster.setup.env) replaces STUCK_STEP_S; not a number: the default."""
    run = run_folder(tmp_path, "cluster.restarts=2")
    heartbeat.write(run.path, Beat(rank=0, node="n1", pid=1, restart=0, step=12,
                                   exit={"code": 1, "error": "RuntimeError: Connection closed by peer", "time": 1.0}))
    monkeypatch.setattr(restarts.stuck, "rank_steps", lambda job: ["77.0"])
    line = restarts.watch(run.path, {**ENV, restarts.STUCK_STEP_ENV: "0.05"}, poll_s=0.01, cancel=lambda s: None)
    assert line.startswith("the rank step did not end 0 s after rank 0 failed"), line
    assert restarts.seconds_from({restarts.STUCK_STEP_ENV: "soon"}, restarts.STUCK_STEP_ENV, 20.0) == 20.0
    assert restarts.seconds_from({restarts.STUCK_STEP_ENV: "-1"}, restarts.STUCK_STEP_ENV, 20.0) == 20.0
    assert restarts.seconds_from({}, restarts.ELASTIC_WAIT_ENV, 30.0) == 30.0


def test_an_elastic_job_waits_for_a_lost_node_as_long_as_its_environment_says(tmp_path, cluster, monkeypatch):
    """HPC_TOOLS_ELASTIC_WAIT_S bounds the wait for the lost node (the probes' wait) in place of ELASTIC_WAIT_S."""
    waits = []
    real = restarts.choose_nodes
    monkeypatch.setattr(restarts.nodes, "choose_nodes",
                        lambda *a, **k: waits.append(k["wait_s"]) or real(*a, **{**k, "wait_s": 0.0}))
    cluster["down"] = {"n2"}
    run = run_folder(tmp_path, "cluster.restarts=2")
    (run.path / "elastic.json").write_text(json.dumps({"layouts": {"1": []}}))
    kill_report(run)
    policy = restarts.Policy(nodes=2, budget=2, requeue=True, min_nodes=1, ranks_per_node=1)
    for env, want in (({restarts.ELASTIC_WAIT_ENV: "5"}, 5.0), ({}, restarts.ELASTIC_WAIT_S)):
        waits.clear()
        restarts.next_step(run.path, 137, {**ENV, **env}, prober=lambda n: n not in cluster["down"],
                           wait_s=restarts.PROBE_WAIT_S, requeue=lambda job: True, policy=policy)
        assert waits and waits[0] == want, waits


def test_status_lists_the_restarts(tmp_path, cluster, cli):
    run = run_folder(tmp_path, "cluster.restarts=2")
    kill_report(run)
    decide(run, cluster)
    first_step(run, 1, 11)
    (run.path / "HANG.txt").write_text("rank 1 (n2) stopped responding\n")  # status reads hang markers after them
    out = cli("status", str(run.path))
    assert out.returncode == 0, out.stderr
    assert "restart 1 (in-job on n1,n2) at " in out.stdout
    assert ": killed: rank 1 on n2 was killed by signal 9 (Killed) after step 12; resumed from iteration 10" \
        in out.stdout
    js = json.loads(cli("status", str(run.path), "--json").stdout)
    assert js["restarts"][0]["from_iteration"] == 10


def elastic_cases():
    """(cluster.nodes, cluster.min_nodes, the counts elastic.json plans, the lost node's index, Slurm removed it)."""
    for need in (2, 3, 4):
        for fewest in range(1, need):
            for planned in ([fewest], list(range(fewest, need))):
                for lost in range(1, need):  # the batch host (index 0) going down ends the job with it
                    yield need, fewest, planned, lost, (need + lost) % 2 == 0


@pytest.mark.parametrize("need, fewest, planned, lost, removed", list(elastic_cases()))
def test_an_elastic_job_goes_on_with_the_nodes_that_answer(tmp_path, cluster, need, fewest, planned, lost, removed):
    """cluster.min_nodes and no spare: a lost node that does not answer is left out, and the next step runs on the
    most answering nodes among the counts the planner found a layout for, with its node and task counts."""
    nodes = [f"n{i}" for i in range(1, need + 1)]
    dead = nodes[lost]
    cluster["nodes"] = [n for n in nodes if not (removed and n == dead)]  # Slurm may have removed it already
    cluster["down"] = {dead}
    run = run_folder(tmp_path, "cluster.restarts=2")
    (run.path / "elastic.json").write_text(json.dumps({"layouts": {str(k): [] for k in planned}}))
    kill_report(run, node=dead, rank=lost)
    policy = restarts.Policy(nodes=need, budget=2, requeue=True, min_nodes=fewest, ranks_per_node=4)
    line = restarts.next_step(run.path, 137, dict(ENV), prober=lambda n: n not in cluster["down"], wait_s=0.0,
                              requeue=lambda job: cluster["requeued"].append(job) or True, policy=policy)
    k = max(c for c in planned if c <= need - 1)
    env = exported(line)
    assert env["HPC_TOOLS_NODELIST"].split(",") == [n for n in nodes if n != dead][:k]
    assert (env["HPC_TOOLS_STEP_NODES"], env["HPC_TOOLS_STEP_TASKS"]) == (str(k), str(4 * k))
    assert not cluster["requeued"]
    [entry] = run.manifest()["restarts"]
    assert (entry["kind"], entry["decision"], entry["layout_nodes"], entry["node"]) == ("in-job", "fewer nodes", k,
                                                                                      dead)


def test_an_elastic_job_below_its_fewest_nodes_is_requeued(tmp_path, cluster):
    cluster["nodes"], cluster["down"] = ["n1", "n2", "n3"], {"n2", "n3"}
    run = run_folder(tmp_path, "cluster.restarts=2")
    (run.path / "elastic.json").write_text(json.dumps({"layouts": {"2": []}}))
    kill_report(run, node="n2", rank=1)
    policy = restarts.Policy(nodes=3, budget=2, requeue=True, min_nodes=2, ranks_per_node=1)
    assert restarts.next_step(run.path, 137, dict(ENV), prober=lambda n: n not in cluster["down"], wait_s=0.0,
                              requeue=lambda job: cluster["requeued"].append(job) or True, policy=policy) is None
    assert cluster["requeued"] == ["77"] and run.manifest()["state"] == "REQUEUED"


def test_a_job_that_is_not_elastic_exports_no_step_counts(tmp_path, cluster):
    run = run_folder(tmp_path, "cluster.restarts=2")
    kill_report(run)
    env = exported(decide(run, cluster))
    assert "HPC_TOOLS_STEP_NODES" not in env and "HPC_TOOLS_STEP_TASKS" not in env
