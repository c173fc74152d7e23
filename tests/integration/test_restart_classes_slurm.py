"""Failure classes on the real test cluster (issue 34 item 3): what a restart can fix, and what it cannot.

Three rendered sbatch scripts run side by side (recipes/llama_fsdp.yaml's local profile, 2 nodes x 1 rank,
cluster.restarts=3, a checkpoint every 5 steps), each with a fault injected into its real rank program at step
FAULT_AT on rank 1, in every start of the ranks (the fault recurs, as a deterministic bug does):

- `exception`: a ValueError (a user's error): no restart is spent; the job fails with the traceback's last line;
- `oom`: ``torch.OutOfMemoryError("CUDA out of memory. ...")``: no restart; the batch log says how to fit (a `--set`);
- `repeat`: rank 1 kills itself with SIGKILL (infrastructure: a restart may fix it): restarted twice from the same
  checkpoint, then the no-progress guard stops the job.

The fault is injected from outside the package: the job's PYTHONPATH (``cluster.setup.env``) holds a
``sitecustomize`` that wraps ``hpc_tools.train.loop._Steps.run`` when (and only when) a rank imports that module,
and raises or kills at the given step. A killed node still restarts: tests/integration/test_restarts_slurm.py.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpc_tools.registry import RunFolder
from tests.helpers import run_cli, sbatch_rendered
from tests.integration.test_restarts_slurm import in_queue

RECIPE = "recipes/llama_fsdp.yaml"
FAULT_AT, ITERS = 7, 20
COMMON = ["--profile", "local", "--set", "cluster.nodes=2", "--set", "cluster.gpus_per_node=1",
          "--set", "cluster.restarts=3", "--set", f"training.train_iters={ITERS}",
          "--set", "checkpoint.interval_iters=5", "--set", "cluster.time_limit=15",
          "--set", "cluster.hang_timeout_min=0.5", "--set", "cluster.preflight=off"]
FAULTS = ("exception", "oom", "repeat")
DEADLINE_S = 600
SITECUSTOMIZE = '''
import importlib.abc
import importlib.util
import os
import signal
import sys

FAULT = os.environ.get("HPC_TOOLS_TEST_FAULT")  # kind:step:rank


def _patch(module):
    kind, step, rank = FAULT.split(":")
    run = module._Steps.run

    def faulty(self, at, startup):
        if at == int(step) and os.environ.get("RANK", os.environ.get("SLURM_PROCID")) == rank:
            if kind == "exception":
                raise ValueError(f"injected at step {at}")
            if kind == "oom":
                import torch

                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            os.kill(os.getpid(), signal.SIGKILL)
        return run(self, at, startup)

    module._Steps.run = faulty


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "hpc_tools.train.loop":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if FAULT:
    sys.meta_path.insert(0, _Finder())
'''

pytestmark = [pytest.mark.slurm, pytest.mark.multinode, pytest.mark.slow]


@dataclass
class Job:
    name: str
    job_id: str
    run: RunFolder
    log: Path


def submit(tmp: Path, fault: str) -> Job:
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    job_id, run = sbatch_rendered(tmp, fault, RECIPE, *COMMON, "--set", f"cluster.setup.env.PYTHONPATH={hook}",
                                  "--set", f"cluster.setup.env.HPC_TOOLS_TEST_FAULT={fault}:{FAULT_AT}:1")
    return Job(fault, job_id, RunFolder(run), tmp / f"llama_fsdp-{job_id}.out")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, Job]:
    from tests.helpers import need_slurm

    need_slurm(2)
    tmp = tmp_path_factory.mktemp("classes")
    found = {fault: submit(tmp, fault) for fault in FAULTS}
    try:
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline and any(in_queue(j.job_id) for j in found.values()):
            time.sleep(1)
        yield found
    finally:
        for j in found.values():
            subprocess.run(["scancel", j.job_id], timeout=30)


def hpc_lines(job: Job) -> list[str]:
    return [line for line in job.log.read_text(errors="replace").splitlines() if line.startswith("hpc_tools: ")]


@pytest.mark.parametrize("fault, cls", [("exception", "user error"), ("oom", "oom")])
def test_a_fault_a_restart_cannot_fix_spends_no_restart(jobs, fault, cls):
    j = jobs[fault]
    m = j.run.manifest()
    assert m["state"] == "FAILED", (m["state"], m.get("reason"))
    [entry] = m["restarts"]
    assert (entry["kind"], entry["class"], entry["decision"], entry["rank"]) == ("stop", cls, "stop", 1), entry
    assert entry["restart"] is None and not [e for e in m["restarts"] if e.get("kind") == "in-job"]
    [stop] = [line for line in hpc_lines(j) if line.startswith("hpc_tools: no restart: ")]
    if fault == "exception":
        assert stop.startswith(f"hpc_tools: no restart: user error: ValueError: injected at step {FAULT_AT}"), stop
    else:
        assert stop.startswith("hpc_tools: no restart: oom: OutOfMemoryError: CUDA out of memory.") and "--set" in stop
        assert entry["fix"] and "--set" in entry["fix"]
    assert not [line for line in hpc_lines(j) if line.startswith("hpc_tools: restart ")]  # no new step was started
    status = run_cli("status", str(j.run.path))
    assert f"{cls}: stop" in status.stdout, status.stdout


def test_a_fault_repeated_at_the_same_step_stops_after_two_restarts(jobs):
    j = jobs["repeat"]
    m = j.run.manifest()
    assert m["state"] == "FAILED", (m["state"], m.get("reason"))
    first, second, stop = m["restarts"]
    for entry in (first, second):
        assert (entry["kind"], entry["class"], entry["decision"]) == ("in-job", "infrastructure", "restart"), entry
        assert entry["cause"] == "killed" and entry["rank"] == 1
    assert first["from_iteration"] == second["from_iteration"] == 5  # both resumed from the same checkpoint
    assert (stop["kind"], stop["decision"]) == ("stop", "stop")
    assert stop["why"].startswith("no progress: the last two restarts both resumed from checkpoint iteration 5")
    [line] = [x for x in hpc_lines(j) if x.startswith("hpc_tools: no restart: ")]
    assert line.startswith("hpc_tools: no restart: no progress"), line
    assert len([x for x in hpc_lines(j) if x.startswith("hpc_tools: restart ")]) == 2
