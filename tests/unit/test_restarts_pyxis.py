"""In-job restarts of a pyxis job (issue 31 item 6): an image has no Slurm client, so the steps that call Slurm's
commands (the restart controller's ``begin``, ``watch`` and ``next``, the batch log's lookup) run on the batch host,
with the host's Python and the standard library, while the steps that read the recipe run in the container.

The rendered script runs here against stand-ins: Slurm's commands on the host's PATH (recording each call), a host
Python that refuses every import outside the standard library and hpc_tools, and an ``srun`` whose container steps run
their command with a PATH holding no Slurm command (a stock image). The first rank step fails as a killed rank does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_tools.recipe.load import resolve
from hpc_tools.registry import RunFolder
from hpc_tools.render.sbatch import render_sbatch
from tests.helpers import REPO
from tests.unit.test_render import small_recipe

pytestmark = pytest.mark.slurm_client

SLURM_COMMANDS = ("scontrol", "srun", "squeue", "scancel")

RECORD = """import json, os, sys
def record(**row):
    with open(os.environ["FAKE_CALLS"], "a") as f:
        f.write(json.dumps({"where": "container" if os.environ.get("FAKE_IN_CONTAINER") else "host", **row}) + "\\n")
"""

SCONTROL = RECORD + """
record(cmd="scontrol", argv=sys.argv[1:])
args = sys.argv[1:]
if args[:2] == ["show", "job"]:
    print(f"JobId={args[-1]} JobState=RUNNING NodeList=node[1-2] StdOut={os.environ['FAKE_BATCH_LOG']}")
elif args[:2] == ["show", "hostnames"]:
    print("node1\\nnode2")
"""

SQUEUE = RECORD + "record(cmd='squeue', argv=sys.argv[1:])\n"
SCANCEL = RECORD + "record(cmd='scancel', argv=sys.argv[1:])\n"

# srun: a container step (pyxis' options) runs its command as a stock image would, with no Slurm command on PATH; the
# rank step is played (the first one ends as a killed rank does, srun's report in the batch log); the others (probe
# steps, the container's removal) are the host's.
SRUN = RECORD + """
args = sys.argv[1:]
container = any(a.startswith("--container-image=") for a in args)
if "hpc_tools.runtime.rank" in args:
    counter = os.environ["FAKE_CALLS"] + ".ranks"
    n = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(n + 1))
    record(cmd="srun", argv=args, step="rank")
    if n == 0:  # the watcher beside the step has started (the batch shell kills it when the step ends)
        import time
        deadline = time.monotonic() + 60
        while '"watch"' not in open(os.environ["FAKE_CALLS"]).read() and time.monotonic() < deadline:
            time.sleep(0.05)
        print("srun: error: node2: task 1: Killed", file=sys.stderr, flush=True)
        sys.exit(137)
    sys.exit(0)
if not container:
    record(cmd="srun", argv=args, step="host")
    sys.exit(0)
options = [a for a in args[:next(i for i, a in enumerate(args) if not a.startswith("--"))]]
command = args[len(options):]
workdir = next(a.split("=", 1)[1] for a in options if a.startswith("--container-workdir="))
record(cmd="srun", argv=args, step="container", module=command[2] if command[1:2] == ["-m"] else None)
env = {**os.environ, "PATH": os.environ["FAKE_IMAGE_PATH"], "FAKE_IN_CONTAINER": "1"}
sys.exit(__import__("subprocess").run(command, env=env, cwd=workdir).returncode)
"""

# The batch host's Python: the standard library and the repository's packages only (no pydantic, yaml or torch).
HOST_PYTHON = RECORD + """
import importlib.abc, runpy
ALLOWED = set(sys.stdlib_module_names) | {"hpc_tools", "profiling"}
class StandardLibraryOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in ALLOWED:
            raise ImportError(f"{name} is not on the batch host")
sys.meta_path.insert(0, StandardLibraryOnly())
assert sys.argv[1] == "-m", sys.argv
record(cmd="host-python", module=sys.argv[2], argv=sys.argv[3:])
sys.argv = [sys.argv[2], *sys.argv[3:]]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _script(path: Path, text: str) -> None:
    path.write_text(f"#!{sys.executable}\n{text}")
    path.chmod(0o755)


def calls(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def pyxis_host(tmp_path):
    """The batch host's environment: Slurm's stand-ins on PATH, the host Python, an image PATH without Slurm."""
    host_bin, image_bin = tmp_path / "host-bin", tmp_path / "image-bin"
    host_bin.mkdir()
    image_bin.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("squeue", SQUEUE), ("scancel", SCANCEL)):
        _script(host_bin / name, text)
    _script(tmp_path / "host-python", HOST_PYTHON)
    env = {**os.environ, "PATH": f"{host_bin}:{os.environ['PATH']}", "FAKE_CALLS": str(tmp_path / "calls"),
           "FAKE_BATCH_LOG": str(tmp_path / "batch.out"), "FAKE_IMAGE_PATH": str(image_bin),
           "HPC_TOOLS_HOST_PYTHON": str(tmp_path / "host-python"), "HPC_TOOLS_REPO": str(REPO),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURMD_NODENAME": "node1",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(tmp_path), "HPC_TOOLS_RUNS_DIR": str(tmp_path / "runs"),
           "PYTHONPATH": str(REPO)}
    for name in ("HPC_TOOLS_RUN_DIR", "HPC_TOOLS_RESTART_BASE", "SLURM_RESTART_COUNT", "HPC_TOOLS_NODELIST"):
        env.pop(name, None)
    assert subprocess.run(["/bin/bash", "-c", "command -v scontrol"], env={**env, "PATH": str(image_bin)}).returncode, \
        "the image stand-in must have no Slurm command"
    return env


def test_a_pyxis_job_restarts_with_its_controller_on_the_batch_host(tmp_path, pyxis_host):
    recipe = resolve(small_recipe(restarts=1, setup={"container": {"kind": "pyxis", "image": "nvcr.io#img"}}))
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(recipe, "pyxis.yaml"))
    with open(tmp_path / "batch.out", "w") as log:  # Slurm writes the batch script's output there
        out = subprocess.run(["bash", str(script)], env=pyxis_host, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                             timeout=180)
    batch_log = (tmp_path / "batch.out").read_text()
    assert out.returncode == 0, batch_log[-3000:]
    seen = calls(tmp_path / "calls")

    # the restart happened: two rank steps, the second on the node the controller chose (the killed rank's node left
    # out: the allocation holds a spare), recorded with the culprit srun reported in the batch log
    ranks = [c["argv"] for c in seen if c.get("step") == "rank"]
    assert len(ranks) == 2, batch_log[-3000:]
    assert "--nodelist=node1" in ranks[0] and "--nodelist=node1" in ranks[1]
    run = RunFolder(tmp_path / "runs" / "setup-j4242")
    manifest = run.manifest()
    [entry] = manifest["restarts"]
    assert (entry["kind"], entry["cause"], entry["node"], entry["nodes"]) == ("in-job", "killed", "node2", ["node1"])
    assert manifest["batch_log"] == str(tmp_path / "batch.out")  # found on the host, recorded by the container step
    assert "hpc_tools: restart 1 of 1 in this run (killed: " in batch_log

    # where each step ran: Slurm's commands on the host only (the image has none), the controller in the host
    # Python (standard library only), the steps that read the recipe in the container
    slurm = [c for c in seen if c["cmd"] in SLURM_COMMANDS and c.get("step") != "container"]
    assert {c["where"] for c in slurm} == {"host"}
    assert any(c["cmd"] == "scontrol" and c["argv"][:2] == ["show", "job"] for c in slurm)
    assert any(c["cmd"] == "srun" and c["argv"][-1] == "true" for c in slurm)  # the probe of the new step's node
    host = [(c["module"], c["argv"][0] if c["module"] == "hpc_tools.job.restarts" else None)
            for c in seen if c["cmd"] == "host-python"]
    assert host[:3] == [("hpc_tools.job.batch_log", None), ("hpc_tools.job.restarts", "begin"),
                        ("hpc_tools.job.restarts", "watch")], host
    # the second step's watcher may be killed before it starts: the step it watches ends at once; the job's last
    # host step is the time-limit requeue's (nothing asked for here)
    assert host[-1] == ("hpc_tools.job.requeue", None), host
    assert host.count(("hpc_tools.job.restarts", "next")) == 1 and set(host[3:-1]) <= {
        ("hpc_tools.job.restarts", "next"), ("hpc_tools.job.restarts", "watch")}, host
    assert [c["module"] for c in seen if c.get("step") == "container"] == ["hpc_tools.job.open_run",
                                                                           "hpc_tools.job.epilogue"]


@pytest.mark.parametrize("module, args", [("hpc_tools.job.restarts", ["next", "--help"]),
                                          ("hpc_tools.job.epilogue", ["--help"]), ("hpc_tools.job.batch_log", []),
                                          ("hpc_tools.job.placement", ["--help"]),
                                          ("hpc_tools.job.requeue", ["--help"])])
def test_the_batch_host_steps_import_the_standard_library_only(tmp_path, module, args):
    """What a batch host runs imports nothing outside the standard library and hpc_tools (run as the host Python runs
    it); the guard does refuse a package outside them (yaml)."""
    _script(tmp_path / "host-python", HOST_PYTHON)
    env = {**os.environ, "FAKE_CALLS": str(tmp_path / "calls"), "PYTHONPATH": str(REPO)}
    env.pop("SLURM_JOB_ID", None)
    clean = subprocess.run([str(tmp_path / "host-python"), "-m", module, *args], env=env, capture_output=True,
                           text=True, timeout=60)
    assert clean.returncode == 0, clean.stderr[-2000:]
    planted = subprocess.run([str(tmp_path / "host-python"), "-m", "yaml"], env=env, capture_output=True, text=True,
                             timeout=60)
    assert planted.returncode != 0 and "yaml is not on the batch host" in planted.stderr
