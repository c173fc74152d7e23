"""A node preflight named, left out of the run (issue 34 item 1; docs/preflight.md, docs/fault-tolerance.md).

Three levels: the restart controller's decision over generated allocations (node counts, spares, which node is named,
restarts left, requeue on or off, auto or strict), with Slurm played as in tests/unit/test_restarts.py; the rank side
(``preflight.run.decide``) on a report; and the rendered restart loop against stand-ins of Slurm's commands (as in
tests/unit/test_restarts_classes.py), where the stand-in rank step decides with the real ``leave_out.replacement``
from what the controller exported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hpc_tools.job import restarts
from hpc_tools.job.failure_class import INFRA, STOP, classify
from hpc_tools.recipe.load import resolve
from hpc_tools.registry import RunFolder
from hpc_tools.render.sbatch import render_sbatch
from hpc_tools.runtime.preflight import leave_out
from hpc_tools.runtime.preflight.verdict import NodeRow, PreflightFailed, Report
from tests.helpers import REPO
from tests.unit.test_render import small_recipe
from tests.unit.test_restarts import exported, run_folder
from tests.unit.test_restarts_pyxis import RECORD, SCANCEL, SQUEUE, _script, calls

REASON = "GEMM 0.1 TFLOP/s is 0.2x the node median 0.5 (below 0.7x)"
PARTITION = [f"n{i}" for i in range(1, 9)]  # the stand-in partition: room for a requeue to leave nodes out


@pytest.fixture(autouse=True)
def _partition(monkeypatch):
    """In-process controller calls see an 8-node partition (``restarts.partition_nodes``: sinfo)."""
    monkeypatch.setattr(restarts.nodes, "partition_nodes", lambda env: list(PARTITION))


def rows(nodes: list[str], bad: str) -> list[NodeRow]:
    out = []
    for i, n in enumerate(nodes):
        row = NodeRow(node=n, ranks=[i], gemm_tflops=0.1 if n == bad else 0.5, mem_gbps=10.0)
        if n == bad:
            row.name("slow", REASON)
        out.append(row)
    return out


def marker(run: RunFolder, named: str, step: list[str], mode: str = "auto", start: int = 0) -> None:
    table = rows(step, named)
    line = f"preflight (cluster.preflight={mode}): node {named} slow: {REASON}"
    leave_out.write(run.path, start, [named], mode, line, leave_out.SPARE, leave_out.details(table, [named]))


def cases():
    """(nodes in the layout, spare nodes, index of the named node, cluster.restarts, requeue, mode)."""
    for need in (2, 3, 4):
        for spares in (0, 1, 2):
            for bad in range(need):
                for budget in (0, 1):
                    for requeue in (True, False):
                        for mode in ("auto", "strict"):
                            if (bad + spares + budget + int(requeue)) % 2 == 0 or need == 2:  # a spread, not all
                                yield need, spares, bad, budget, requeue, mode


@pytest.mark.parametrize("need, spares, bad, budget, requeue, mode", list(cases()))
def test_the_controller_leaves_a_named_node_out(tmp_path, monkeypatch, need, spares, bad, budget, requeue, mode):
    allocation = [f"n{i}" for i in range(1, need + spares + 1)]
    step, named = allocation[:need], allocation[bad]
    policy = restarts.Policy(nodes=need, budget=budget, requeue=requeue)
    run = run_folder(tmp_path, "cluster.restarts=2")
    monkeypatch.setattr(restarts.nodes, "allocation_nodes", lambda job, env: list(allocation))
    updates, requeued, said = [], [], []
    monkeypatch.setattr(restarts.action, "exclude_from_job", lambda job, nodes: updates.append((job, nodes)))
    monkeypatch.setattr(restarts.action, "say", lambda line, restart=False: said.append(line))
    # what the controller exported before the step: the rank side decides from it
    hints = restarts.preflight_hints(allocation, step, [], policy, run.manifest(), "77")
    env = {"SLURM_JOB_ID": "77", "HPC_TOOLS_NODELIST": ",".join(step), "HPC_TOOLS_EXCLUDED": "",
           **{k: str(v) for k, v in hints.items()}}
    how = leave_out.replacement([named], env)
    marker(run, named, step, mode)
    line = restarts.next_step(run.path, leave_out.EXIT_CODE, env, prober=lambda n: True, wait_s=0.0,
                              requeue=lambda job: requeued.append(job) or True, policy=policy)
    m = run.manifest()
    [entry] = m["restarts"]
    assert (entry["cause"], entry["class"], entry["node"], entry["nodes_named"]) == ("preflight", INFRA, named,
                                                                                     [named])
    assert entry["preflight"][named]["reasons"] == [REASON] and entry["preflight"][named]["gemm_tflops"] == 0.1
    assert REASON in entry["reason"] and named in entry["reason"]
    if budget and spares:
        assert how == leave_out.SPARE
        out = exported(line)
        assert out["HPC_TOOLS_NODELIST"].split(",") == [n for n in allocation if n != named][:need]
        assert out["HPC_TOOLS_EXCLUDED"] == named and out["MASTER_ADDR"] == out["HPC_TOOLS_NODELIST"].split(",")[0]
        assert (entry["kind"], entry["decision"], entry["restart"]) == ("in-job", "leave out", 1)
        assert m["state"] == "STARTING" and not requeued and not updates
        assert out[leave_out.SPARES_ENV] == "0"  # the budget of one is spent: the next step trains on
        assert said == [f"1 of 1 in this run (preflight named {named} slow ({REASON}); infrastructure): {named} left "
                        f"out, a new step on {out['HPC_TOOLS_NODELIST']}"]
    elif budget and requeue:
        assert how == leave_out.REQUEUE and line is None
        assert updates == [("77", [named])] and requeued == ["77"]
        assert (entry["kind"], entry["decision"], m["state"]) == ("requeue", "requeue", "REQUEUED")
        assert len(said) == 1 and f"job requeued with ExcNodeList={named}" in said[0]
    else:  # nothing can replace it: the rank would not have ended the step; played anyway, the controller copes
        assert how is None
        assert not requeued and not updates and len(said) == 1
        if mode == "strict":
            assert line is None and (entry["kind"], entry["decision"]) == ("stop", STOP)
            assert said[0].startswith(f"no restart: infrastructure: preflight (cluster.preflight=strict) named "
                                      f"{named} slow ({REASON}); nothing could replace it")
        else:
            out = exported(line)
            assert out["HPC_TOOLS_NODELIST"] == ",".join(step) and out[leave_out.ACCEPT_ENV] == named
            assert (entry["kind"], entry["decision"], entry["nodes"]) == ("preflight", "train on", step)
            assert said == [f"preflight named {named} slow ({REASON}); nothing could replace it (no spare node outside "
                            f"the step, no in-job restart or requeue left): training goes on with {named} "
                            "(cluster.preflight=auto)"]
            assert leave_out.replacement([named], out) is None  # the next step trains on


def elastic_cases():
    """(nodes in the layout, cluster.min_nodes, the node counts the elastic plan holds, index of the named node,
    requeue)."""
    for need in (2, 3, 4):
        for fewest in range(1, need):
            for planned in ({fewest}, set(range(fewest, need))):
                for bad in range(need):
                    yield need, fewest, sorted(planned), bad, (need + bad) % 2 == 0


@pytest.mark.parametrize("need, fewest, planned, bad, requeue", list(elastic_cases()))
def test_an_elastic_job_without_a_spare_goes_on_without_the_named_node(tmp_path, monkeypatch, need, fewest, planned,
                                                                       bad, requeue):
    """cluster.min_nodes and no spare: the named node is left out and the next step runs on the most nodes that
    remain among the counts elastic.json plans for, before any requeue (issue 34 item 1, issue 32 item 1)."""
    allocation = [f"n{i}" for i in range(1, need + 1)]
    named = allocation[bad]
    policy = restarts.Policy(nodes=need, budget=1, requeue=requeue, min_nodes=fewest, ranks_per_node=2)
    run = run_folder(tmp_path, "cluster.restarts=2")
    (run.path / "elastic.json").write_text(json.dumps({"layouts": {str(k): [f"cluster.nodes={k}"] for k in planned}}))
    monkeypatch.setattr(restarts.nodes, "allocation_nodes", lambda job, env: list(allocation))
    monkeypatch.setattr(restarts.action, "say", lambda line, restart=False: None)
    hints = restarts.preflight_hints(allocation, allocation, [], policy, run.manifest(), "77", run_dir=run.path)
    assert hints[leave_out.SPARES_ENV] == 0 and hints[leave_out.FEWER_ENV] == need - min(planned)
    env = {"SLURM_JOB_ID": "77", "HPC_TOOLS_NODELIST": ",".join(allocation), "HPC_TOOLS_EXCLUDED": "",
           **{k: str(v) for k, v in hints.items()}}
    assert leave_out.replacement([named], env) == leave_out.FEWER
    marker(run, named, allocation)
    line = restarts.next_step(run.path, leave_out.EXIT_CODE, env, prober=lambda n: True, wait_s=0.0,
                              requeue=lambda job: pytest.fail("requeued although fewer nodes can train"),
                              policy=policy)
    k = max(c for c in planned if c <= need - 1)
    out = exported(line)
    assert out["HPC_TOOLS_NODELIST"].split(",") == [n for n in allocation if n != named][:k]
    assert (out["HPC_TOOLS_STEP_NODES"], out["HPC_TOOLS_STEP_TASKS"]) == (str(k), str(2 * k))
    [entry] = run.manifest()["restarts"]
    assert (entry["kind"], entry["decision"], entry["layout_nodes"]) == ("in-job", "leave out", k)
    assert named not in out["HPC_TOOLS_NODELIST"].split(",") and out[leave_out.FEWER_ENV] == "0"  # budget spent


def test_the_exclusion_follows_the_requeue_with_sigterm_ignored(tmp_path, monkeypatch):
    """Slurm takes ExcNodeList for a pending job only, and the requeue ends the batch script (SIGTERM first): the
    update comes after the requeue, while SIGTERM is ignored, and the handler is restored after."""
    import signal

    run = run_folder(tmp_path)
    monkeypatch.setattr(restarts.nodes, "allocation_nodes", lambda job, env: ["n1", "n2"])
    order = []
    monkeypatch.setattr(restarts.action, "exclude_from_job",
                        lambda job, nodes: order.append(("update", nodes, signal.getsignal(signal.SIGTERM))))
    marker(run, "n2", ["n1", "n2"])
    before = signal.getsignal(signal.SIGTERM)
    env = {"SLURM_JOB_ID": "77", "HPC_TOOLS_NODELIST": "n1,n2"}
    restarts.next_step(run.path, leave_out.EXIT_CODE, env, prober=lambda n: True, wait_s=0.0,
                       requeue=lambda job: order.append(("requeue", job, signal.getsignal(signal.SIGTERM))) or True,
                       policy=restarts.Policy(nodes=2, budget=1, requeue=True))
    assert order == [("requeue", "77", signal.SIG_IGN), ("update", ["n2"], signal.SIG_IGN)]
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_marker_of_an_earlier_start_is_not_this_steps(tmp_path):
    run = run_folder(tmp_path)
    marker(run, "n2", ["n1", "n2"], start=0)
    assert leave_out.read(run.path, 0)["nodes"] == ["n2"] and leave_out.read(run.path, 1) is None


def test_the_next_life_leaves_out_what_a_requeue_excluded(tmp_path, monkeypatch):
    """Should Slurm give the requeued job the named node again, ``begin`` keeps it out while enough others remain."""
    run = run_folder(tmp_path)
    run.update(restarts=[{"cause": "preflight", "kind": "requeue", "nodes_named": ["n2"]}])
    policy = restarts.Policy(nodes=2, budget=2, requeue=True)
    for allocation, nodes, excluded in ((["n1", "n2", "n3"], "n1,n3", "n2"), (["n1", "n2"], "n1,n2", "")):
        monkeypatch.setattr(restarts.nodes, "allocation_nodes", lambda job, env, a=allocation: list(a))
        out = exported(restarts.begin(run.path, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, policy))
        assert (out["HPC_TOOLS_NODELIST"], out["HPC_TOOLS_EXCLUDED"]) == (nodes, excluded)
        assert out[leave_out.SPARES_ENV] == "0" and out[leave_out.REQUEUE_ENV] == "1"  # one of 2 spent: 1 left


def test_a_strict_preflight_failure_is_infrastructure_and_stops_naming_the_node():
    line = f"preflight (cluster.preflight=strict): node n2 slow: {REASON}; nothing can replace it"
    record = {"code": 1, "error": line, "types": ["PreflightFailed"], "where": "preflight", "step": None}
    verdict = classify("exited", record, [])
    assert (verdict.cls, verdict.decision, verdict.why) == (INFRA, STOP, line)


def test_leaving_a_node_out_is_no_fault_for_the_no_progress_guard():
    from hpc_tools.job.failure_class import no_progress

    left = {"kind": "in-job", "cause": "preflight", "from_iteration": 10}
    fault = {"kind": "in-job", "cause": "killed", "from_iteration": 10}
    assert no_progress([left, fault]) is None and no_progress([fault, left]) is None
    assert no_progress([left, fault, fault]) == 10  # two faults from one checkpoint still stop


# -- the rank side -----------------------------------------------------------------------------------------------


def context(tmp_path, mode: str, infos: list) -> SimpleNamespace:
    from hpc_tools.registry import MANIFEST

    (tmp_path / MANIFEST).write_text("{}")
    return SimpleNamespace(is_rank0=True, run_dir=tmp_path, run=RunFolder(tmp_path),
                           dist=SimpleNamespace(restart_count=3), info=lambda msg, *a: infos.append(msg % a))


@pytest.mark.parametrize("mode", ["auto", "strict"])
@pytest.mark.parametrize("nodes, bad", [(2, 0), (2, 1), (3, 2), (5, 3)])
@pytest.mark.parametrize("hints", [{}, {leave_out.SPARES_ENV: "1"}, {leave_out.REQUEUE_ENV: "1"},
                                   {leave_out.SPARES_ENV: "1", leave_out.ACCEPT_ENV: "BAD"}])
def test_the_rank_side_ends_the_step_trains_on_or_stops(tmp_path, monkeypatch, mode, nodes, bad, hints):
    from hpc_tools.runtime.preflight import run as preflight

    names = [f"node{i}" for i in range(nodes)]
    hints = {k: (names[bad] if v == "BAD" else v) for k, v in hints.items()}
    for k in (leave_out.SPARES_ENV, leave_out.REQUEUE_ENV, leave_out.ACCEPT_ENV, "HPC_TOOLS_EXECUTOR"):
        monkeypatch.delenv(k, raising=False)
    for k, v in hints.items():
        monkeypatch.setenv(k, v)
    infos: list[str] = []
    report = Report(mode=mode, budget_s=60, seconds=1.0, rows=rows(names, names[bad]))
    replaceable = bool(hints) and leave_out.ACCEPT_ENV not in hints
    if replaceable:
        import torch.distributed as dist

        at_barrier: list = []  # what the manifest and the marker held when the ranks met, before any ended the step
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "barrier", lambda: at_barrier.append(
            (RunFolder(tmp_path).manifest().get("events"), leave_out.read(tmp_path, 3))))
        with pytest.raises(leave_out.LeaveOut) as left:
            preflight.decide(context(tmp_path, mode, infos), report, mode)
        assert left.value.exit_code == leave_out.EXIT_CODE and names[bad] in str(left.value)
        [(events, marked)] = at_barrier  # srun may stop rank 0 as soon as a peer ends: both were written before
        assert [(e["event"], e["reason"]) for e in events] == [(leave_out.LeaveOut.event, str(left.value))]
        assert marked and marked["nodes"] == [names[bad]]
        saved = leave_out.read(tmp_path, 3)
        assert saved["nodes"] == [names[bad]] and saved["mode"] == mode
        assert saved["details"][names[bad]]["reasons"] == [REASON]
    elif mode == "strict":
        with pytest.raises(PreflightFailed) as failed:
            preflight.decide(context(tmp_path, mode, infos), report, mode)
        text = str(failed.value)
        assert "\n" not in text and f"node {names[bad]} slow: {REASON}" in text and "nothing" in text
        assert not (tmp_path / leave_out.MARKER).exists()
    else:
        preflight.decide(context(tmp_path, mode, infos), report, mode)
        [line] = infos
        assert f"node {names[bad]} slow: {REASON}" in line and "training goes on" in line
        assert ("nothing could replace it" if hints else "nothing can replace it") in line
        assert not (tmp_path / leave_out.MARKER).exists()


def test_local_ranks_are_never_left_out(tmp_path, monkeypatch):
    from hpc_tools.runtime.preflight import run as preflight

    monkeypatch.setenv(leave_out.SPARES_ENV, "2")
    monkeypatch.setenv("HPC_TOOLS_EXECUTOR", "local")  # what the local executor gives its ranks
    infos: list[str] = []
    ctx = context(tmp_path, "auto", infos)
    preflight.decide(ctx, Report(mode="auto", budget_s=60, seconds=1.0, rows=rows(["local0", "local1"], "local1")),
                     "auto")
    assert len(infos) == 1 and "training goes on" in infos[0] and not (tmp_path / leave_out.MARKER).exists()


def test_job_level_problems_name_no_node_to_leave_out(tmp_path, monkeypatch):
    from hpc_tools.runtime.preflight import run as preflight

    monkeypatch.setenv(leave_out.SPARES_ENV, "2")
    report = Report(mode="auto", budget_s=60, seconds=1.0, rows=rows(["a", "b"], "none"), problems=["uplink slow"])
    infos: list[str] = []
    preflight.decide(context(tmp_path, "auto", infos), report, "auto")
    assert len(infos) == 1 and "uplink slow" in infos[0] and not (tmp_path / leave_out.MARKER).exists()


# -- the rendered restart loop against stand-ins of Slurm ----------------------------------------------------------

SCONTROL = RECORD + """
record(cmd="scontrol", argv=sys.argv[1:])
args = sys.argv[1:]
if args[:2] == ["show", "job"]:
    print(f"JobId={args[-1]} JobState=RUNNING NodeList=node[1-2] StdOut={os.environ['FAKE_BATCH_LOG']}")
elif args[:2] == ["show", "hostnames"]:
    print("node1\\nnode2")
"""

# srun: a rank step decides as the rank program does (the real leave_out.replacement on the environment the
# controller exported) whether preflight's named node FAKE_NAMED ends the step; other steps (probes) succeed.
SRUN = RECORD + """
args = sys.argv[1:]
if "hpc_tools.runtime.rank" not in args:
    record(cmd="srun", argv=args, step="host")
    sys.exit(0)
from hpc_tools.runtime.distenv import restart_count
from hpc_tools.runtime.preflight import leave_out
named = os.environ["FAKE_NAMED"]
step = (os.environ.get("HPC_TOOLS_NODELIST") or "").split(",")
record(cmd="srun", argv=args, step="rank", nodes=step, spares=os.environ.get(leave_out.SPARES_ENV))
how = leave_out.replacement([named], os.environ) if named in step else None
if how:
    run_dir = args[args.index("--run-dir") + 1]
    leave_out.write(run_dir, restart_count(os.environ), [named], "auto", "preflight: node " + named + " slow", how,
                    {named: {"verdict": "slow", "reasons": ["GEMM 0.1 TFLOP/s"]}})
    sys.exit(leave_out.EXIT_CODE)
sys.exit(0)
"""


# sinfo -N -o %N: the partition's nodes, one a line (FAKE_PARTITION, comma-separated)
SINFO = RECORD + """
record(cmd="sinfo", argv=sys.argv[1:])
print("\\n".join(os.environ["FAKE_PARTITION"].split(",")))
"""


def run_job(tmp_path, partition="node1,node2,node3", **cluster):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("squeue", SQUEUE), ("scancel", SCANCEL),
                       ("sinfo", SINFO)):
        _script(bin_dir / name, text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_CALLS": str(tmp_path / "calls"),
           "FAKE_BATCH_LOG": str(tmp_path / "batch.out"), "FAKE_NAMED": "node1", "FAKE_PARTITION": partition,
           "SLURM_JOB_ID": "4343", "SLURM_JOB_NODELIST": "node[1-2]", "SLURMD_NODENAME": "node1",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path), "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs"),
           "PYTHONPATH": str(REPO)}
    for name in ("HPC_TOOLS_RUN_DIR", "HPC_TOOLS_RESTART_BASE", "SLURM_RESTART_COUNT", "HPC_TOOLS_NODELIST",
                 leave_out.SPARES_ENV, leave_out.REQUEUE_ENV, leave_out.ACCEPT_ENV):
        env.pop(name, None)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(resolve(small_recipe(**cluster)), "leave.yaml"))
    with open(tmp_path / "batch.out", "w") as log:
        out = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                             timeout=240)
    made = calls(tmp_path / "calls")
    manifest = RunFolder(tmp_path / "runs" / "setup-j4343").manifest()
    return out.returncode, (tmp_path / "batch.out").read_text(), made, manifest


@pytest.mark.slurm_client
def test_the_rendered_loop_moves_to_the_spare(tmp_path):
    rc, log, made, manifest = run_job(tmp_path, restarts=1, spare_nodes=1)
    ranks = [c for c in made if c.get("step") == "rank"]
    assert rc == 0 and [c["nodes"] for c in ranks] == [["node1"], ["node2"]], log[-3000:]
    assert [c["spares"] for c in ranks] == ["1", "0"]
    [entry] = manifest["restarts"]
    assert (entry["kind"], entry["decision"], entry["node"], entry["nodes"]) == ("in-job", "leave out", "node1",
                                                                                 ["node2"])
    assert "hpc_tools: restart 1 of 1 in this run (preflight named node1 slow (GEMM 0.1 TFLOP/s); " \
           "infrastructure): node1 left out, a new step on node2" in log
    status = subprocess.run([sys.executable, "-m", "hpc_tools", "status", str(tmp_path / "runs" / "setup-j4343")],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert "restart 1 (in-job on node2) at " in status.stdout and ": preflight: preflight named node1 slow " \
        "(GEMM 0.1 TFLOP/s); infrastructure: leave out" in status.stdout, status.stdout + status.stderr


@pytest.mark.slurm_client
def test_the_rendered_loop_never_requeues_a_job_its_partition_cannot_hold_without_the_node(tmp_path):
    """A 2-node job on a 2-node partition (the test cluster): excluding the named node would leave it pending for
    ever, so no requeue is offered and auto trains on."""
    rc, log, made, manifest = run_job(tmp_path, partition="node1,node2", nodes=2, restarts=1)
    ranks = [c for c in made if c.get("step") == "rank"]
    assert rc == 0 and len(ranks) == 1, log[-3000:]
    assert not [c for c in made if c["cmd"] == "scontrol" and c["argv"][0] in ("update", "requeue")]
    assert manifest["state"] == "COMPLETED" and not manifest.get("restarts")


@pytest.mark.slurm_client
def test_the_rendered_loop_requeues_without_the_node(tmp_path):
    rc, log, made, manifest = run_job(tmp_path, nodes=2, restarts=1)
    scontrol = [c["argv"] for c in made if c["cmd"] == "scontrol" and c["argv"][0] in ("update", "requeue")]
    assert scontrol == [["requeue", "4343"], ["update", "JobId=4343", "ExcNodeList=node1"]], log[-3000:]
    [entry] = manifest["restarts"]
    assert (entry["kind"], entry["decision"], manifest["state"]) == ("requeue", "requeue", "REQUEUED")
    assert json.dumps(entry["preflight"]["node1"]["reasons"]) == '["GEMM 0.1 TFLOP/s"]'


@pytest.mark.parametrize("named", [1, 2, 3])
@pytest.mark.parametrize("room", [0, 1, 2, 3])
def test_a_requeue_leaves_out_no_more_nodes_than_the_partition_has_room_for(named, room):
    nodes = [f"n{i}" for i in range(named)]
    env = {leave_out.REQUEUE_ENV: "1", leave_out.ROOM_ENV: str(room)}
    assert leave_out.replacement(nodes, env) == (leave_out.REQUEUE if room >= named else None)


@pytest.mark.parametrize("partition,job_nodes,excluded,room", [
    (8, 2, 0, 6), (2, 2, 0, 0), (3, 2, 0, 1), (3, 2, 1, 0), (4, 4, 0, 0), (0, 2, 0, 0)])
def test_the_requeue_room_is_the_partition_beyond_the_job_less_earlier_exclusions(monkeypatch, partition, job_nodes,
                                                                                 excluded, room):
    monkeypatch.setattr(restarts.nodes, "partition_nodes", lambda env: [f"n{i}" for i in range(partition)])
    manifest = {"restarts": [{"cause": "preflight", "kind": "requeue", "nodes_named": [f"n{i}"]}
                             for i in range(excluded)]}
    policy = restarts.Policy(nodes=job_nodes, budget=3, requeue=True)
    assert restarts.requeue_room(policy, manifest, {}) == room
    hints = restarts.preflight_hints([], [], [], policy, manifest, "77", env={})
    assert (hints[leave_out.REQUEUE_ENV], hints[leave_out.ROOM_ENV]) == (int(room > 0), room)
