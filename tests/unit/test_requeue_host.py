"""The time-limit requeue of a container job (issue 46 item 3): an image has no Slurm client, so rank 0 only asks for
the requeue (a marker in the run folder) and the batch shell runs ``scontrol requeue`` on the batch host, after the
epilogue, as the job's last command.

Both launch paths run here against stand-ins (``tests/unit/test_restarts_pyxis.py``'s: Slurm's commands on the
host's PATH recording each call, a host Python that refuses every import outside the standard library and
hpc_tools, an image PATH with no Slurm command). The rank step plays a time-limit stop: the real ``StopFlag``
receives SIGUSR2 and the real ``RankContext.finish_preempted`` runs, inside the image's PATH."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpc_tools.job.requeue import requeue
from hpc_tools.recipe.load import resolve
from hpc_tools.registry import RunFolder
from hpc_tools.render.sbatch import render_sbatch
from hpc_tools.runtime.preemption import REQUEUE_MARKER
from tests.unit import test_restarts_pyxis
from tests.unit.test_render import small_recipe, submitit_script
from tests.unit.test_restarts_pyxis import RECORD, SCONTROL, _script, calls

pyxis_host = test_restarts_pyxis.pyxis_host  # the batch host's stand-ins (a fixture)

pytestmark = pytest.mark.slurm_client

# scontrol: the pyxis stand-in's answers, and a requeue refused when the test says so
HOST_SCONTROL = SCONTROL + """
if args[:1] == ["requeue"] and os.environ.get("FAKE_REQUEUE_REFUSED"):
    print("scontrol: error: Job is no longer running", file=sys.stderr)
    sys.exit(1)
"""

# The rank step (the rendered script's rank program, or submitit's task): rank 0's time-limit stop, in the image
# (no Slurm command on PATH). Other steps: a container step runs its command in the image, a host step is recorded.
SRUN = RECORD + """
import subprocess
args = sys.argv[1:]
rank = "hpc_tools.runtime.rank" in args or "submitit.core._submit" in args
image = {**os.environ, "PATH": os.environ["FAKE_IMAGE_PATH"], "FAKE_IN_CONTAINER": "1"}
if rank:
    record(cmd="srun", argv=args, step="rank")
    run_dir = args[args.index("--run-dir") + 1] if "--run-dir" in args else os.environ["FAKE_RUN_DIR"]
    sys.exit(subprocess.run([sys.executable, "-c", os.environ["FAKE_RANK"], run_dir], env=image).returncode)
if not any(a.startswith("--container-image=") for a in args):
    record(cmd="srun", argv=args, step="host")
    sys.exit(0)
options = args[:next(i for i, a in enumerate(args) if not a.startswith("--"))]
command = args[len(options):]
record(cmd="srun", argv=args, step="container", module=command[2] if command[1:2] == ["-m"] else None)
workdir = next(a.split("=", 1)[1] for a in options if a.startswith("--container-workdir="))
sys.exit(subprocess.run(command, env=image, cwd=workdir).returncode)
"""

# Rank 0 at the time-limit signal: the loop's last call after the stop's checkpoint (hpc_tools.train.loop).
RANK = """import os, signal, sys
from types import SimpleNamespace
from hpc_tools.registry import RunFolder
from hpc_tools.runtime.context import RankContext
from hpc_tools.runtime.preemption import StopFlag
stop = StopFlag().install()
os.kill(os.getpid(), signal.SIGUSR2)
assert stop.requested
ctx = SimpleNamespace(is_rank0=True, stop=stop, recipe=SimpleNamespace(cluster=SimpleNamespace(requeue=True)),
                      run=RunFolder(sys.argv[1]))
RankContext.finish_preempted(ctx, 7)
"""

CONTAINERS = {"pyxis": {"kind": "pyxis", "image": "nvcr.io#img"}, "apptainer": {"kind": "apptainer", "image": "x.sif"}}


def batch_job(tmp_path, env, path: str, container: str, monkeypatch,
              **cluster) -> tuple[subprocess.CompletedProcess, RunFolder]:
    """Run the job's batch script (``path``: the rendered one or submitit's) with the stand-ins; its output is the
    batch log."""
    from hpc_tools.submission import new_run

    _script(tmp_path / "host-bin" / "srun", SRUN)
    _script(tmp_path / "host-bin" / "scontrol", HOST_SCONTROL)
    _script(tmp_path / "host-bin" / "apptainer", "import sys\nsys.exit(0)\n")  # its presence is checked only
    recipe = resolve(small_recipe(setup={"container": CONTAINERS[container]}, **cluster))
    if path == "sbatch":
        script, run = render_sbatch(recipe, "job.yaml"), RunFolder(tmp_path / "runs" / "setup-j4242")
    else:
        run = new_run(recipe, tmp_path / "runs", "slurm", "job.yaml")
        monkeypatch.setenv("PATH", env["PATH"])  # submitit looks for srun (the stand-in) when it is set up
        script = submitit_script(recipe, run.path)
    (tmp_path / "job.sbatch").write_text(script)
    env = {**env, "FAKE_RANK": RANK, "FAKE_RUN_DIR": str(run.path)}
    with open(tmp_path / "batch.out", "w") as log:
        out = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, cwd=tmp_path, stdout=log,
                             stderr=subprocess.STDOUT, timeout=180)
    return out, run


@pytest.mark.parametrize("path, container, restarts", [("sbatch", "pyxis", 0), ("sbatch", "pyxis", 1),
                                                       ("sbatch", "apptainer", 0), ("submitit", "apptainer", 0)])
def test_a_container_job_is_requeued_from_the_batch_host_after_the_time_limit_stop(tmp_path, pyxis_host, path,
                                                                                   container, restarts, monkeypatch):
    out, run = batch_job(tmp_path, pyxis_host, path, container, monkeypatch, restarts=restarts)
    batch_log = (tmp_path / "batch.out").read_text()
    assert out.returncode == 0, batch_log[-3000:]
    seen = calls(tmp_path / "calls")
    requeues = [c for c in seen if c["cmd"] == "scontrol" and c["argv"][:1] == ["requeue"]]
    assert [(c["where"], c["argv"]) for c in requeues] == [("host", ["requeue", "4242"])], seen
    assert seen[-1] == requeues[0] or all(c["cmd"] == "srun" and c.get("step") == "host"  # the container's removal
                                          for c in seen[seen.index(requeues[0]) + 1:]), "the requeue comes last"
    manifest = run.manifest()
    events = [e["event"] for e in manifest["events"]]
    assert manifest["state"] == "REQUEUED" and manifest["last_step"] == 7, manifest
    assert events.index("preempted") < events.index("batch ended"), events  # the epilogue ran before the requeue
    assert not (run.path / REQUEUE_MARKER).exists(), "a stale request would requeue the next life"
    assert "hpc_tools: job 4242 requeued after the time-limit stop" in batch_log


def test_a_refused_requeue_is_recorded_and_said(tmp_path, pyxis_host, monkeypatch):
    out, run = batch_job(tmp_path, {**pyxis_host, "FAKE_REQUEUE_REFUSED": "1"}, "sbatch", "pyxis", monkeypatch)
    batch_log = (tmp_path / "batch.out").read_text()
    assert out.returncode == 0, batch_log[-3000:]
    manifest = run.manifest()
    assert manifest["state"] == "PREEMPTED", manifest
    assert manifest["reason"] == "scontrol requeue 4242 failed on the batch host: scontrol: error: Job is no longer " \
                                 "running"
    assert f"hpc_tools: {manifest['reason']}; resume it with `hpc_tools resume`" in batch_log


def test_a_request_of_another_job_is_not_honoured(tmp_path):
    """A marker left by an earlier job id (the run resumed under a new job) is removed and requeues nothing."""
    from hpc_tools.submission import new_run

    run = new_run(resolve(small_recipe()), tmp_path / "runs", "slurm", "job.yaml")
    (run.path / REQUEUE_MARKER).write_text("1111\n")
    ran = []
    assert requeue(run.path, {"SLURM_JOB_ID": "2222"}, run_command=lambda *a, **k: ran.append(a)) is None
    assert ran == [] and not (run.path / REQUEUE_MARKER).exists()


def test_no_request_outside_slurm(tmp_path):
    from hpc_tools.runtime.preemption import request_requeue

    assert request_requeue(tmp_path, {}) is False and not (tmp_path / REQUEUE_MARKER).exists()
    assert request_requeue(tmp_path, {"SLURM_JOB_ID": "9"}) is True
    assert (tmp_path / REQUEUE_MARKER).read_text() == "9 0 time-limit\n"  # job id, Slurm life, why
    assert sys.modules["hpc_tools.job.requeue"].REQUEUE_MARKER == REQUEUE_MARKER
