"""Fixtures and hooks only (the shared helpers are tests/helpers.py): the repository, a CLI runner, the README's main
command run once per session, and the Slurm test cluster (environment/slurm-dev); and the tiers.

Tiers (``pytest_collection_modifyitems`` below): every test under tests/integration is marked ``integration`` and
``slow`` (they start ranks, clusters, browsers), but for the fake-Slurm side of a ``slurm_cluster`` test, and every
test that uses the Slurm cluster is marked ``slurm`` and ``slow``, so that ``pytest -m "not slow"`` is the
developer's loop of a few minutes. Under pytest-xdist (setup.cfg: ``-n auto --dist loadgroup``) the Slurm tests share
one group, so one worker submits to the test cluster at a time, the ``gpu``-marked tests share one group, so two GPU
modules never run at once on one GPU, and each other integration module is a group of its own, so its module-scoped
launch runs once; a launch that tests of several modules read runs once per session
(``shared_once``, ``main_command``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import INTEGRATION, REPO, need_slurm, run_cli, settle_cluster, shared_once, wait_for
from tests.timeline import own_cpu_s, read_cpu

# Hermetic recipes: a developer's site file (~/.config/hpc_tools/site.yaml) must not change what the tests resolve;
# tests of the site file set HPC_TOOLS_SITE themselves.
os.environ["HPC_TOOLS_SITE"] = "none"
# pytest-xdist's workers run with COLUMNS=80, which the commands read as a terminal's width (hpc_tools/cli/_screen.py):
# their output into the tests' pipes is whole lines, as a user's pipe gets; tests of the width set COLUMNS themselves.
for _var in ("COLUMNS", "LINES"):
    os.environ.pop(_var, None)


@pytest.hookimpl(tryfirst=True)  # before -m deselects and before xdist reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        fixtures = set(item.fixturenames) - set(callspec.params if callspec else ())  # not a parameter named "slurm"
        on_slurm = bool({"slurm", "slurm_multinode"} & fixtures) or any(
            item.get_closest_marker(m) for m in ("slurm", "multinode"))
        if on_slurm and not item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.slurm)
        fake = item.get_closest_marker("fake_slurm") is not None  # the fast side of a slurm_cluster test
        if INTEGRATION in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.integration)
            if not fake:
                item.add_marker(pytest.mark.slow)
            group = "slurm" if on_slurm else "gpu" if item.get_closest_marker("gpu") else Path(str(item.path)).stem
            item.add_marker(pytest.mark.xdist_group(group))
        elif on_slurm:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group("slurm"))
    # The Slurm tests that also read a shared local run last: by then the other worker has usually made it, so the
    # Slurm worker (the longest group) does not. After them, the tests of an environment that environment/test.sh
    # installs beside the first tests (marker extra_env): by then it is there.
    items.sort(key=lambda item: (item.get_closest_marker("extra_env") is not None,
                                 "main_command" in item.fixturenames and item.get_closest_marker("slurm") is not None))


_OUTCOMES: dict[str, str] = {}


def pytest_runtest_logreport(report) -> None:
    if report.outcome != "passed" and _OUTCOMES.get(report.nodeid) != "failed":
        _OUTCOMES[report.nodeid] = report.outcome


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With HPC_TOOLS_TEST_TIMELINE=FILE (environment/test.sh sets it), one JSON line per test: its xdist worker and
    group, and when its setup began and its teardown ended, and the machine's CPU counters then (how busy the CPUs
    were while it ran), and the CPU seconds of this test's own processes (the worker and every process it waited
    for: CLI calls, local ranks; not what Slurm's daemons start); ``python -m tests.timeline FILE`` sums them up
    (which worker, and which group, the suite's wall time waits for, whether the CPUs had time to spare, and which
    modules spent the CPU)."""
    path = os.environ.get("HPC_TOOLS_TEST_TIMELINE")
    start, cpu_start = time.time(), read_cpu() if path else None
    own_start = own_cpu_s()
    yield
    if path:
        group = next((m.args[0] for m in item.iter_markers("xdist_group") if m.args), None)
        cpu_end = read_cpu()
        line = json.dumps({"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                           "group": group, "start": start, "end": time.time(),
                           "outcome": _OUTCOMES.pop(item.nodeid, "passed"),
                           "cpu": [cpu_start, cpu_end] if cpu_start and cpu_end else None,
                           "own_cpu_s": round(own_cpu_s() - own_start, 2)})
        with open(path, "a") as f:
            f.write(line + "\n")


SLURM_FIXTURES = {"slurm", "slurm_multinode", "slurm_cluster"}
EXTRA_ENV_SCRIPTS = ("install-serve.sh", "install-horovod.sh")


@pytest.fixture(autouse=True, scope="module")
def _extra_envs_for_the_module(request) -> None:
    """A module marked ``extra_env`` (its pytestmark): the installs before its module-scoped fixtures, which already
    run what they need (autouse fixtures come first within their scope)."""
    if request.node.get_closest_marker("extra_env") is not None:
        _install_extra_envs()


@pytest.fixture(autouse=True)
def _extra_envs_installed(request) -> None:
    """A test marked ``extra_env`` needs the serving venv and Horovod: their install scripts run first, once per
    test process. Under environment/test.sh they are already installing beside the tests: each script then waits
    for the other's lock and finds the install complete (seconds); on a fresh checkout this is the install."""
    if request.node.get_closest_marker("extra_env") is not None:
        _install_extra_envs()


@functools.cache
def _install_extra_envs() -> None:
    for script in EXTRA_ENV_SCRIPTS:
        out = subprocess.run(["bash", str(REPO / "environment" / script)], capture_output=True, text=True,
                             timeout=3600)
        assert out.returncode == 0, f"environment/{script} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


@pytest.fixture(autouse=True)
def _attention_environment_restored():
    """Megatron-core writes NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN into os.environ when it builds a
    model in-process (``LanguageModule``, for the attention backend it was given), and a rank refuses to start when
    its environment pins another backend (``layers.attention_environment_check``): a test that builds a model leaves
    them for the next test's subprocesses in the same worker. Each test starts and ends with the NVTE_* variables it
    began with."""
    before = {k: v for k, v in os.environ.items() if k.startswith("NVTE_")}
    yield
    for key in [k for k in os.environ if k.startswith("NVTE_") and k not in before]:
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(autouse=True)
def _no_slurm_unless_asked(request, monkeypatch) -> None:
    """Hermetic about this machine's Slurm: a test that asks for no Slurm cluster (its fixtures or markers ``slurm``,
    ``multinode``) nor puts its own Slurm stand-ins on PATH (marker ``slurm_client``) runs with HPC_TOOLS_SLURM=off, so
    that its commands see "no Slurm here" whether this machine has no Slurm client, a client and no controller, or
    the test cluster up (hpc_tools/slurm_client.py); the others run with it unset, as Slurm's users do."""
    callspec = getattr(request.node, "callspec", None)  # a parameter named "slurm" is no cluster; slurm_cluster's
    fixtures = set(request.fixturenames) - set(callspec.params if callspec else ())  # own params: its markers
    if SLURM_FIXTURES & fixtures or any(request.node.get_closest_marker(m) for m in ("slurm", "multinode", "fake_slurm",
                                                                                      "slurm_client")):
        monkeypatch.delenv("HPC_TOOLS_SLURM", raising=False)
    else:
        monkeypatch.setenv("HPC_TOOLS_SLURM", "off")


def real_slurm_test(item) -> bool:
    """A test of the real Slurm test cluster: marked ``slurm`` (by itself or ``pytest_collection_modifyitems``), not
    the fake side of ``slurm_cluster``."""
    return item.get_closest_marker("slurm") is not None and item.get_closest_marker("fake_slurm") is None


@pytest.fixture(autouse=True, scope="module")
def _settled_slurm_cluster(request) -> None:
    """Before a module's first real Slurm test (``real_slurm_test``), the test cluster is settled (tests/helpers.py
    ``settle_cluster``): what an earlier module's faults and jobs left behind is not this module's to meet. Autouse
    at module scope, so it is set up before the module's own fixtures submit anything, on the worker that runs the
    test that asked for it first; it settles only when that test is a real Slurm test. Under xdist the real Slurm
    tests are one group on one worker; the others (a module's local or fake-Slurm tests) run on another worker at the
    same time, where a settle's cancel of "leftover" jobs killed the Slurm worker's running ones. (It used to be put
    into each real Slurm test's fixture names, a list that parametrized tests share: the fake side of a
    ``slurm_cluster`` test got it too, and cancelled a running job from the other worker in two CI runs.)"""
    item = getattr(request, "_pyfuncitem", None)  # the test that set this module-scoped fixture up
    if item is not None and real_slurm_test(item):
        settle_cluster()


@pytest.fixture(autouse=True, scope="session")
def _own_calibration_file(tmp_path_factory) -> None:
    """One planner calibration file per test process (per xdist worker): a measured search stores what it fitted
    there, never in a developer's ~/.config/hpc_tools/calibration.json, nor where another worker reads it."""
    os.environ["HPC_TOOLS_CALIBRATION"] = str(tmp_path_factory.mktemp("calibration") / "calibration.json")


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def main_command(tmp_path_factory):
    """``main_command("recipes/gpt_3d.yaml")``: the README's main command (``submit RECIPE``, here with ``--executor
    local --json``) run once per test session and shared by the tests that read the same run: returncode, stdout,
    stderr, the result (``run_dir``, ``state``) when it printed one, and its wall time."""

    def run(recipe: str) -> dict:
        def submit(folder: Path) -> dict:
            import time

            t0 = time.monotonic()
            out = run_cli("submit", recipe, "--executor", "local", "--json", "--runs-dir", str(folder), timeout=900)
            result = json.loads(out.stdout) if out.stdout.strip().startswith("{") else {}
            return {"returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr[-6000:],
                    "result": result, "wall_s": time.monotonic() - t0}

        return shared_once(tmp_path_factory, "main-" + Path(recipe).stem, submit)

    return run


@pytest.fixture
def slurm() -> int:
    """A live Slurm cluster (number of nodes). Skips without one, but fails under HPC_TOOLS_REQUIRE_SLURM=1 (CI)."""
    return need_slurm(1)


@pytest.fixture
def slurm_multinode() -> int:
    return need_slurm(2)


class RealCluster:
    """The Slurm test cluster, as ``slurm_cluster`` hands it to a test: Slurm itself moves its jobs on."""

    kind = "real"

    def __init__(self, nodes: int):
        self.nodes = nodes

    def settle(self, job_id: str, state: str, timeout_s: float = 120, **_) -> None:
        """Wait until sacct reports ``state`` for the job (Slurm gets there by itself)."""
        from hpc_tools.runstate import SacctReader

        reader = SacctReader(max_age_s=0)
        wait_for(lambda: (job := reader.job(job_id)) and job.slurm_state == state, timeout_s,
                 f"job {job_id} to be {state}")


class FakeCluster:
    """``hpc_tools.testing.fake_slurm`` on PATH, as ``slurm_cluster`` hands it to a test: the test sets the states."""

    kind = "fake"

    def __init__(self, fake):
        self.fake, self.nodes = fake, len(fake.state()["nodes"])

    def settle(self, job_id: str, state: str, **fields) -> None:
        """sacct reports ``state`` (with ``fields``: exit_code, elapsed, nodelist) from now on."""
        self.fake.set_state(job_id, state, **fields)


@pytest.fixture(params=[pytest.param("fake", marks=pytest.mark.fake_slurm),
                        pytest.param("real", marks=pytest.mark.slurm)])
def slurm_cluster(request, tmp_path_factory, monkeypatch):
    """The same test body twice: against the fake Slurm (hpc_tools/testing/fake_slurm.py, fast tier, the test sets
    the job states) and against the real test cluster (slow tier, Slurm moves the jobs), so that the fake is only
    ever used beneath a real test of the same path. Job-state logic that only the fake side can hold fixed runs in
    milliseconds; what only Slurm can show (ranks, signals, its own verdicts) is asserted on the real side."""
    if request.param == "real":
        yield RealCluster(need_slurm(1))
        return
    from hpc_tools.runstate import READER
    from hpc_tools.testing.fake_slurm import FakeSlurm

    fake = FakeSlurm(tmp_path_factory.mktemp("fake_slurm"))
    monkeypatch.setenv("PATH", fake.path)  # this process and every CLI it starts
    READER.clear()  # the fake's job ids start at 1 again
    yield FakeCluster(fake)
    READER.clear()


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs"
