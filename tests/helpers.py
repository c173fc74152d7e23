"""The tests' shared helpers (imported by test modules: ``from tests.helpers import REPO, run_cli``): the repository's
paths, the CLI runner, the integration drivers' runner, polling, a run's step records and loss curve, work shared
once per session across pytest-xdist workers, and whether the Slurm test cluster is up. Fixtures and hooks stay in
tests/conftest.py, which uses these.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INTEGRATION = REPO / "tests" / "integration"
DRIVERS = INTEGRATION
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def run_driver(script: str, out: Path, *args: str, timeout: float) -> dict:
    """Run ``tests/integration/<script>`` (a ``*_driver.py`` that launches its own ranks) with ``--out OUT ARGS``;
    its JSON results, once it exited 0 (else the tail of its output). Prints how long it took (with -s)."""
    import time

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(DRIVERS / script), "--out", str(out), *args], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    print(f"\n{script}: {time.monotonic() - t0:.0f} s")
    return json.loads(Path(out).read_text())


PACED = {"HPC_TOOLS_TEST_SLOW_RANK": "*:data:0.05"}
"""The environment of an endless job a test only waits on (a time limit, a hang, a cancel): every rank sleeps 50 ms in
each step's data loading (profiling.collector.injected_delays) instead of taking the cores from the tests beside it.
The job's own processes take it from the environment its launch inherits (sbatch and submitit pass it on)."""


def in_process(*args: str) -> str:
    """``hpc_tools.cli.main(ARGS)`` in this process, for the commands that only read a run folder (status, analyze,
    report: a fresh interpreter would only add its start-up); its stdout, once it exited 0."""
    from hpc_tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    assert code == 0, err.getvalue()[-3000:]
    return out.getvalue()


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600,
            input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m hpc_tools ARGS` in a fresh process, as a user runs it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "hpc_tools", *args], cwd=cwd or REPO, env=full_env, text=True,
                          capture_output=True, timeout=timeout, input=input)


def sbatch_rendered(tmp: Path, name: str, recipe: str, *render_args: str) -> tuple[str, Path]:
    """Render ``recipe`` (with ``render_args``) to ``tmp/NAME.sbatch`` and submit it with plain sbatch from ``tmp``,
    its runs in ``tmp/runs-NAME``: (the job id, the run folder the script makes, ``<recipe stem>-j<job id>``)."""
    script = tmp / f"{name}.sbatch"
    out = run_cli("render", recipe, *render_args, "-o", str(script))
    assert out.returncode == 0, out.stderr
    runs = tmp / f"runs-{name}"
    sub = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "HPC_TOOLS_RUNS_DIR": str(runs)})
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    return job_id, runs / f"{Path(recipe).stem}-j{job_id}"


def local_rank_pids(run_dir: Path) -> list[int]:
    """The rank processes the local executor started in this run folder, in rank order (its manifest's ``pids``:
    forked ranks carry their server's command line and environment in /proc, so a scan of /proc cannot tell them)."""
    from hpc_tools.registry import RunFolder

    return [int(pid) for pid in RunFolder(run_dir).manifest().get("pids") or []]


def wait_for(predicate, timeout_s: float = 120, what: str = "", poll_s: float = 0.5):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what or predicate}")


def step_records(run_dir: Path) -> dict[int, list[dict]]:
    """rank -> its step records (records/rank<R>.jsonl), read with the project's own reader."""
    from profiling.records import read_jsonl

    return {int(p.stem[4:]): list(read_jsonl(p)) for p in sorted((Path(run_dir) / "records").glob("rank*.jsonl"))}


def loss_curve(run_dir: Path) -> dict[int, float]:
    """step -> loss, from whichever ranks recorded one."""
    return {r["step"]: r["loss"] for recs in step_records(run_dir).values() for r in recs if r["loss"] is not None}


@contextlib.contextmanager
def _locked(path: Path):
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def shared_once(tmp_path_factory, name: str, make) -> dict:
    """``make(folder) -> dict`` (JSON) once per test session, for every pytest-xdist worker of it: the first caller
    runs it under a file lock in the session's temporary folder, later ones (on any worker) wait and reuse it."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    with _locked(root / f"{name}.lock"):
        done = root / f"{name}.json"
        if not done.exists():
            folder = root / name
            folder.mkdir()
            done.write_text(json.dumps(make(folder)))
        return json.loads(done.read_text())


def _slurm_nodes() -> int:
    from hpc_tools.executors.slurm import slurm_available

    ok, _ = slurm_available()
    if not ok:
        return 0
    out = subprocess.run(["sinfo", "-h", "-o", "%D"], capture_output=True, text=True, timeout=10)
    try:
        return sum(int(x) for x in out.stdout.split())
    except ValueError:
        return 0


def settle_cluster(wait_s: float = 60, cancel_after_s: float = 15) -> None:
    """The test cluster as a test module expects to find it (tests/conftest.py calls this before a module with real
    Slurm tests, never between its tests: a module's fixtures may have submitted jobs its later tests read): no node
    left down or drained by an earlier module's fault (a crashed node, a hang's drain) and no earlier module's job
    left (scancel is asynchronous; a job still queued after ``cancel_after_s`` is a leftover that would hold nodes,
    and is cancelled). Waits at most ``wait_s``; what is still not settled then is the tests' to report. Without a
    cluster it returns at once."""
    import time

    start = time.monotonic()
    cancelled = False
    while True:
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=10)
        if nodes.returncode != 0:
            return
        states = dict(line.split(None, 1) for line in nodes.stdout.splitlines() if len(line.split()) == 2)
        unusable = [n for n, st in states.items() if any(w in st for w in ("down", "drain", "fail"))]
        for node in unusable:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True,
                           timeout=10)
        queue = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, timeout=10)
        jobs = queue.stdout.split()
        if states and not unusable and queue.returncode == 0 and not jobs:
            return
        waited = time.monotonic() - start
        if jobs and not cancelled and waited >= cancel_after_s:
            subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
            cancelled = True
        if waited > wait_s:
            return
        time.sleep(1)


def in_queue(job_id: str) -> bool:
    """Slurm job ``job_id`` is still queued or running (an unreachable controller counts as yes: keep waiting)."""
    out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30)
    return bool(out.stdout.strip()) or (out.returncode != 0 and "Invalid job id" not in out.stderr)


def need_slurm(min_nodes: int) -> int:
    """The Slurm test cluster's node count when it has ``min_nodes`` or more; else the test skips (fails under
    HPC_TOOLS_REQUIRE_SLURM=1, as in CI)."""
    nodes = _slurm_nodes()
    if not nodes and os.environ.get("HPC_TOOLS_REQUIRE_SLURM") == "1":  # a controller slow to answer under load
        with contextlib.suppress(AssertionError):
            nodes = wait_for(_slurm_nodes, timeout_s=30, poll_s=2)
    if nodes >= min_nodes:
        return nodes
    why = (f"needs the Slurm test cluster with >= {min_nodes} node(s) (found {nodes}): "
           f"bash environment/slurm-dev/up.sh{' --nodes 2' if min_nodes > 1 else ''}")
    if os.environ.get("HPC_TOOLS_REQUIRE_SLURM") == "1":
        pytest.fail(why)
    pytest.skip(why)


@contextlib.contextmanager
def srun_on_path():
    """The fake Slurm's commands (``hpc_tools.testing.fake_slurm``: its ``srun`` runs nothing) first on PATH while
    submitit's Slurm executor is built (it refuses to start where ``srun`` is missing): rendering its batch script
    needs no Slurm client on this machine."""
    import shutil
    import tempfile

    from hpc_tools.testing.fake_slurm import FakeSlurm

    folder = Path(tempfile.mkdtemp(prefix="fake-slurm-"))
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = FakeSlurm(folder).path
    try:
        yield
    finally:
        os.environ["PATH"] = old
        shutil.rmtree(folder, ignore_errors=True)
