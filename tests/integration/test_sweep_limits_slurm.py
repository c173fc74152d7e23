"""A sweep larger than Slurm's array limit on the test cluster: 9 tiny cells with sweep.max_parallel=2 all complete,
in arrays of at most 4 (three chunks: the first submitted at once, the rest as cells end), never more than 2 at once
(from sacct's start and end times), and `sweep status` shows 9 completed. (It ran 25 cells against a limit of 10, with
4 at once: the same three chunks for 16 more rank starts.)

The limit is set for this module in slurm.conf and applied with `scontrol reconfigure` (slurmctld re-reads its file
and keeps running jobs; no daemon restarts): `MaxArraySize=4`, which `scontrol show config` reports at once and the
sweep reads, though Slurm 22.05's slurmctld goes on enforcing the old value until it restarts (an array 0-1000 is
still accepted); and `SchedulerParameters=...,max_array_tasks=4`, which it enforces from the reconfigure on (an
array of 9 is refused), so the test runs against a limit Slurm holds for real. Both lines are removed afterwards.
"""

from __future__ import annotations

import json
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from hpc_tools.slurm_client import show_config
from tests.helpers import REPO, run_cli, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.multinode]
CELLS, MAX_ARRAY, THROTTLE = 9, 4, 2  # CELLS > 2 x MAX_ARRAY: three chunks
MARK = "# hpc_tools test_sweep_limits_slurm: removed after the test"


def _reconfigure() -> None:
    subprocess.run(["scontrol", "reconfigure"], check=True, capture_output=True, timeout=60)


def _limited(text: str) -> str:
    """slurm.conf with the module's limits: max_array_tasks added to SchedulerParameters, MaxArraySize appended."""
    lines = text.splitlines()
    sched = [i for i, ln in enumerate(lines) if ln.split("=", 1)[0].strip().lower() == "schedulerparameters"]
    if sched:
        lines[sched[-1]] = f"{lines[sched[-1]].rstrip()},max_array_tasks={MAX_ARRAY} {MARK}"
    else:
        lines.append(f"SchedulerParameters=max_array_tasks={MAX_ARRAY} {MARK}")
    return "\n".join([*lines, f"MaxArraySize={MAX_ARRAY} {MARK}"]) + "\n"


def _restored(text: str) -> str:
    """slurm.conf without the module's limits (only the marked lines change: another edit meanwhile stays)."""
    out = []
    for ln in text.splitlines(keepends=True):
        if MARK not in ln:
            out.append(ln)
        elif ln.lower().startswith("schedulerparameters=") and f",max_array_tasks={MAX_ARRAY} " in ln:
            out.append(ln.split(f",max_array_tasks={MAX_ARRAY} ")[0] + "\n")
    return "".join(out)


@pytest.fixture(scope="module")
def array_limit():
    conf = Path(show_config()["SLURM_CONF"])
    original = conf.read_text()
    assert MARK not in original and _restored(_limited(original)) == original
    conf.write_text(_limited(original))
    try:
        _reconfigure()
        config = show_config()
        assert config["MaxArraySize"] == str(MAX_ARRAY), config["MaxArraySize"]
        assert f"max_array_tasks={MAX_ARRAY}" in config["SchedulerParameters"], config["SchedulerParameters"]
        yield
    finally:
        conf.write_text(_restored(conf.read_text()))
        _reconfigure()


def _ended(jobs: list[str]) -> dict[str, list[str]] | None:
    """sacct's rows for the jobs once none is running: a cell's run records its end (what `sweep status` reads)
    just before its Slurm job ends."""
    sacct = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State,Start,End", "-j", ",".join(jobs)],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    rows = {ln.split("|")[0]: ln.split("|") for ln in sacct.splitlines() if ln}
    return rows if all(rows.get(j, ["", "RUNNING"])[1] not in ("RUNNING", "PENDING", "COMPLETING") for j in jobs) \
        else None


def _max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """The most intervals [start, end) open at one time."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda x: (x[0], x[1]))
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def test_cells_past_max_array_size_all_complete_within_the_throttle(slurm_multinode, array_limit, tmp_path):
    # Slurm itself refuses one array of CELLS now: the limit is live.
    whole = subprocess.run(["sbatch", "--parsable", "--hold", f"--array=0-{CELLS - 1}", "-o", "/dev/null",
                            "--wrap", "true"], capture_output=True, text=True, timeout=60)
    if whole.returncode == 0:
        subprocess.run(["scancel", whole.stdout.strip().split(";")[0]], timeout=30)
    assert whole.returncode != 0 and "array" in whole.stderr.lower(), whole.stderr

    raw = yaml.safe_load((REPO / "recipes/comm_check.yaml").read_text())
    raw["sweep"] = {"grid": {"training.seed": list(range(CELLS))}, "max_parallel": THROTTLE}
    recipe = tmp_path / f"cc{CELLS}.yaml"
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = run_cli("sweep", str(recipe), "--profile", "local", "--executor", "slurm", "--set", "cluster.gpus_per_node=1",
                  "--set", "training.train_iters=2", "--set", "training.log_interval=1000",
                  "--runs-dir", str(tmp_path / "runs"), "--json")
    assert out.returncode == 0, out.stderr
    note = f"{CELLS} cells exceed Slurm's limits (MaxArraySize {MAX_ARRAY}, max_array_tasks {MAX_ARRAY}"
    assert note in out.stderr, out.stderr
    start = json.loads(out.stdout)
    submitted = [c for c in start["cells"] if c["job_id"]]
    assert len(start["cells"]) == CELLS and len(submitted) == MAX_ARRAY, [c["job_id"] for c in start["cells"]]

    # `sweep status --wait` submits the rest as earlier cells end, and returns when every cell has.
    done = run_cli("sweep", "status", start["sweep"], "--wait", "--json", timeout=900)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["summary"] == {"completed": CELLS} and data["waiting"] == 0, data["summary"]
    chunks = data["chunks"]
    assert sum(len(c["cells"]) for c in chunks) == CELLS and all(len(c["cells"]) <= MAX_ARRAY for c in chunks)
    assert len({c["job"] for c in chunks}) == len(chunks) >= CELLS // MAX_ARRAY + 1

    jobs = [c["job_id"] for c in data["cells"]]
    rows = wait_for(lambda: _ended(jobs), timeout_s=60, what="sacct to report every cell's job ended", poll_s=2)
    sacct = "\n".join("|".join(r) for r in rows.values())
    assert set(jobs) <= set(rows) and all(rows[j][1] == "COMPLETED" for j in jobs), sacct
    assert all(int(j.split("_")[1]) < MAX_ARRAY for j in jobs if "_" in j), jobs  # indices 0..MAX_ARRAY-1
    spans = [(datetime.fromisoformat(rows[j][2]), datetime.fromisoformat(rows[j][3])) for j in jobs]
    assert _max_overlap(spans) <= THROTTLE, sacct

    text = run_cli("sweep", "status", start["sweep"])
    assert text.returncode == 0 and f"completed {CELLS}" in text.stdout.splitlines()[0], text.stdout
