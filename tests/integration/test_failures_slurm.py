"""Every failure recorded with its rank, on the real 2-node test cluster: `kill -9` of a non-zero rank (rendered
sbatch script) and of rank 0 (submitit), one rank per node, and SIGSTOP of one of four ranks (the hang watchdog names
it); then a runs folder on a tiny tmpfs whose disk fills up before a checkpoint save.

The three Slurm jobs (comm_check over 2 nodes, endless steps) are submitted together by one fixture so that they
queue and start side by side; each test injects its fault and reads the manifest only (never `status`) until it is
terminal, then checks what `status` and `list` say. Figures (time from the fault to the manifest's terminal state)
are printed with -s.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpc_tools.registry import RunFolder
from hpc_tools.runstate import is_terminal
from hpc_tools.runtime import heartbeat
from tests.helpers import REPO, run_cli, wait_for

COMM = "recipes/comm_check.yaml"
HANG_S = 15  # cluster.hang_timeout_min=0.25
# A 4-minute limit lets the backfill scheduler start these jobs in gaps of a busy cluster; each ends long before it.
SETS = ["--set", "cluster.nodes=2", "--set", "training.train_iters=100000000", "--set", "training.log_interval=100000",
        "--set", f"cluster.hang_timeout_min={HANG_S / 60}", "--set", "cluster.time_limit=4"]
START_S = 1200  # the shared test cluster may run other jobs first


def submit_sbatch(tmp: Path, name: str, per_node: int) -> tuple[str, RunFolder]:
    script = tmp / f"{name}.sbatch"
    rendered = run_cli("render", COMM, "--profile", "local", *SETS, "--set", f"cluster.gpus_per_node={per_node}", "-o",
                       str(script))
    assert rendered.returncode == 0, rendered.stderr
    runs = tmp / f"runs-{name}"
    out = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HPC_TOOLS_RUNS_DIR": str(runs)})
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    return job_id, RunFolder(runs / f"comm_check-j{job_id}")


def submit_submitit(tmp: Path) -> tuple[str, RunFolder]:
    out = run_cli("submit", COMM, "--profile", "local", "--executor", "slurm", "--json", "--runs-dir",
                  str(tmp / "runs-submitit"), *SETS, "--set", "cluster.gpus_per_node=1")
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    return job["job_id"], RunFolder(job["run_dir"])


FAULTS = {  # job -> (launch, ranks per node, victim rank, signal)
    "stop2": ("sbatch", 2, 2, signal.SIGSTOP),
    "kill1": ("sbatch", 1, 1, signal.SIGKILL),
    "kill0": ("submitit", 1, 0, signal.SIGKILL),
}


@dataclass
class Outcome:
    job_id: str
    run: RunFolder
    victim: heartbeat.Beat | None = None
    injected: float | None = None  # monotonic time of the fault
    took: float | None = None  # seconds from the fault to a terminal manifest with a reason
    manifest: dict | None = None
    gone: float | None = None  # seconds from the fault until the job left the queue


def ready_victim(run: RunFolder, rank: int, world: int) -> heartbeat.Beat | None:
    """Rank ``rank``'s heartbeat once every rank has completed two steps, else None."""
    beats = heartbeat.read_all(run.path) if run.path.is_dir() else {}
    return beats[rank] if len(beats) == world and all(b.step >= 2 for b in beats.values()) else None


def job_gone(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30)
    return out.returncode == 0 and not out.stdout.strip() or "Invalid job id" in out.stderr


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    """Submit the three jobs at once; inject each fault as soon as its job is stepping (no job idles waiting for
    another's turn); watch manifest.json only (nobody runs `status`) until each is terminal with a reason."""
    from tests.helpers import need_slurm

    need_slurm(2)
    tmp = tmp_path_factory.mktemp("failures")
    found: dict[str, Outcome] = {}
    try:
        for name, (launch, per_node, _, _) in FAULTS.items():
            job_id, run = submit_sbatch(tmp, name, per_node) if launch == "sbatch" else submit_submitit(tmp)
            found[name] = Outcome(job_id, run)
        def waiting(o: Outcome) -> bool:  # until the job left the queue and the manifest spoke (or 30 s more)
            return o.gone is None or (o.manifest is None and time.monotonic() - o.injected < o.gone + 30)

        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and any(waiting(o) for o in found.values()):
            for name, o in found.items():
                _, per_node, rank, sig = FAULTS[name]
                if o.injected is None:
                    if victim := ready_victim(o.run, rank, 2 * per_node):
                        os.kill(victim.pid, sig)
                        o.victim, o.injected = victim, time.monotonic()
                    continue
                if o.manifest is None:
                    m = o.run.manifest()
                    if is_terminal(m.get("state")) and m.get("reason"):
                        o.manifest, o.took = m, time.monotonic() - o.injected
                if o.gone is None and job_gone(o.job_id):
                    o.gone = time.monotonic() - o.injected
            time.sleep(0.25)
        for name, o in found.items():
            print(f"\n{name} ({FAULTS[name][0]}): manifest {o.manifest and o.manifest['state']} {o.took or 0:.1f} s "
                  f"after the fault, job gone after {o.gone or 0:.1f} s: {o.manifest and o.manifest['reason']}")
        yield found
    finally:
        for o in found.values():
            subprocess.run(["scancel", o.job_id], timeout=30)


def status_of(run: RunFolder) -> tuple[dict, str]:
    js = run_cli("status", str(run.path), "--json")
    text = run_cli("status", str(run.path))
    assert js.returncode == 0 and text.returncode == 0 and "Traceback" not in text.stderr + js.stderr
    return json.loads(js.stdout), text.stdout


def recorded(o: Outcome, within_s: float) -> dict:
    assert o.injected is not None, f"job {o.job_id} never started stepping"
    assert o.manifest is not None, f"job {o.job_id}: no terminal manifest with a reason; {o.run.manifest()}"
    assert o.took <= within_s, f"the manifest was terminal {o.took:.0f} s after the fault (limit {within_s} s)"
    return o.manifest


@pytest.mark.slurm
@pytest.mark.multinode
@pytest.mark.slow
def test_killed_non_zero_rank_is_recorded_by_the_sbatch_epilogue(outcomes):
    o = outcomes["kill1"]
    manifest, node = recorded(o, 30), o.victim.node
    assert manifest["state"] == "FAILED" and manifest["failed_ranks"] == [1]
    assert manifest["failed_nodes"] == [node] and manifest["exit_code"] == 137
    assert manifest["reason"].startswith(f"rank 1 on {node} was killed by signal 9 (Killed) after step ")
    status, text = status_of(o.run)
    assert status["status"] == "failed" and status["reason"].startswith("rank 1 on ")
    assert f"status   failed: rank 1 on {node} was killed by signal 9" in text
    listed = run_cli("list", "--runs-dir", str(o.run.path.parent))
    assert listed.returncode == 0 and f"rank 1 on {node}" in listed.stdout


@pytest.mark.slurm
@pytest.mark.multinode
@pytest.mark.slow
def test_killed_rank0_is_recorded_by_the_submitit_teardown(outcomes):
    o = outcomes["kill0"]
    manifest = recorded(o, 30)
    assert manifest["state"] == "FAILED" and manifest["failed_ranks"] == [0]
    assert manifest["reason"].startswith(f"rank 0 on {o.victim.node} was killed by signal 9 (Killed) after step ")
    assert any(e["event"] == "batch ended" for e in manifest["events"])
    status, _ = status_of(o.run)
    assert status["status"] == "failed" and status["reason"].startswith("rank 0 on ")


@pytest.mark.slurm
@pytest.mark.multinode
@pytest.mark.slow
def test_stopped_rank_is_named_as_the_hang_culprit(outcomes):
    o = outcomes["stop2"]
    manifest = recorded(o, HANG_S + 15)
    assert o.gone is not None and o.gone <= HANG_S + 30, "the hung job was not torn down"
    with pytest.raises(ProcessLookupError):  # srun's teardown killed the stopped rank too (SIGCONT + SIGKILL)
        os.kill(o.victim.pid, signal.SIGCONT)
    assert manifest["state"] == "HANG" and manifest["failed_ranks"] == [2] and manifest["exit_code"] == 86
    assert manifest["reason"].startswith(f"rank 2 ({o.victim.node}) stopped responding in ")
    waited = {int(r) for m in re.finditer(r"ranks? ([\d,]+) waited in all_reduce", manifest["reason"])
              for r in m.group(1).split(",")}
    assert waited == {0, 1, 3}, manifest["reason"]  # grouped by collective and step: every peer named as waiting
    assert sorted(p.name for p in o.run.path.glob("HANG*.txt")) == ["HANG.txt"]  # one verdict, not one per rank
    verdict = (o.run.path / "HANG.txt").read_text()
    assert verdict.splitlines()[0] == manifest["reason"]
    assert "== stack-rank00000.txt ==" in verdict and "== stack-rank00002.txt ==" not in verdict  # rank 2 was frozen
    status, text = status_of(o.run)
    assert status["status"] == "hang" and status["reason"].startswith("rank 2 (")
    assert "HANG.txt" in text


@pytest.mark.slow
def test_full_disk_fails_the_save_keeps_latest_and_is_told(tmp_path):
    """Local executor (no queue), DeepSpeed ZeRO-2 tiny model, runs folder on a 24 MiB tmpfs: after the first
    checkpoint the ranks are paused, the disk is filled to 512 KiB free, and the next save must fail cleanly."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], check=True, timeout=30)
    proc = None
    try:
        runs = mnt / "runs"
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpc_tools", "submit", "recipes/gpt_zero.yaml", "--executor", "local", "--runs-dir",
             str(runs), "--set", "training.train_iters=100000", "--set", "checkpoint.interval_iters=20"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        run = wait_for(lambda: next((RunFolder(p) for p in runs.glob("gpt_zero-*")
                                     if (p / "checkpoints" / "latest").exists()), None),
                       timeout_s=400, what="the first checkpoint", poll_s=0.5)
        beats = heartbeat.read_all(run.path)
        for b in beats.values():
            os.kill(b.pid, signal.SIGSTOP)
        latest = (run.checkpoints_dir / "latest").read_text()
        st = os.statvfs(mnt)
        with open(mnt / "ballast", "wb") as f:  # leave 512 KiB: room for records, none for a 2.5 MB checkpoint
            f.write(bytes(max(st.f_bavail * st.f_frsize - (512 << 10), 0)))
        t0 = time.monotonic()
        for b in beats.values():
            os.kill(b.pid, signal.SIGCONT)
        output, _ = proc.communicate(timeout=300)
        took = time.monotonic() - t0
        manifest = run.manifest()
        print(f"\nfull disk: manifest {manifest['state']} {took:.1f} s after the disk filled: {manifest.get('reason')}")
        assert proc.returncode != 0 and "Traceback" not in output.splitlines()[-1], output[-2000:]
        assert manifest["state"] == "FAILED", manifest
        assert "No space left" in manifest.get("reason", "") + (manifest.get("error") or ""), manifest
        assert (run.checkpoints_dir / "latest").read_text() == latest  # the last good checkpoint is still latest
        assert (run.checkpoints_dir / latest.strip()).is_dir()
        status = run_cli("status", str(run.path))  # on the still-full disk
        assert status.returncode == 0 and "Traceback" not in status.stderr and "status   failed" in status.stdout
        listed = run_cli("list", "--runs-dir", str(runs))
        assert listed.returncode == 0 and "Traceback" not in listed.stderr
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", "-l", str(mnt)], timeout=30)
