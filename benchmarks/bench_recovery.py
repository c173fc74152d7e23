"""Time from a rank's kill -9 to the first new step on the Slurm test cluster: in-job restart vs requeue.

Two jobs of recipes/gpt_zero.yaml's local profile (a tiny LLaMA under ZeRO-2, 2 nodes x 1 rank, a checkpoint every 5
steps), submitted side by side through the rendered sbatch script so that both see the same load:

- ``in-job``: ``cluster.restarts=2``; rank 1 is killed with SIGKILL after step 12 and the job starts a new srun step in
  the same allocation (``hpc_tools.job.restarts``);
- ``requeue``: ``cluster.restarts=0``; rank 1 is killed the same way and the job is requeued at once with
  ``scontrol requeue`` (what a recovery through the queue does: Slurm's own requeue after a node failure, or the
  restart tool's fallback when the allocation cannot hold the layout); the requeued life resumes from the same
  checkpoint.

For each: seconds from the kill to the end of the first step of the new start (the step record's ``time``), the part
of it before the new ranks started (their first event ``start``'s process start), and the step it resumed from.
Needs the 2-node test cluster (``bash environment/slurm-dev/up.sh --nodes 2``). Run with
``PYTHONPATH=$PWD python3 benchmarks/bench_recovery.py [--repeat N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpc_tools.registry import RunFolder  # noqa: E402
from hpc_tools.runtime import heartbeat  # noqa: E402

SETS = ["cluster.nodes=2", "cluster.gpus_per_node=1", "training.train_iters=40", "checkpoint.interval_iters=5",
        'cluster.setup.env.OMP_NUM_THREADS="1"', "cluster.time_limit=15"]
FAULT_AT = 12


def records(run: RunFolder, name: str) -> list[dict]:
    path = run.records_dir / name
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def rank0_step(run: RunFolder) -> int:
    recs = records(run, "rank00000.jsonl")
    return recs[-1]["step"] if recs else 0


def submit(tmp: Path, name: str, restarts: int) -> tuple[str, RunFolder]:
    script = tmp / f"{name}.sbatch"
    sets = [x for s in [*SETS, f"cluster.restarts={restarts}"] for x in ("--set", s)]
    subprocess.run([sys.executable, "-m", "hpc_tools", "render", "recipes/gpt_zero.yaml", "--profile", "local", *sets,
                    "-o", str(script)], cwd=REPO, check=True, capture_output=True)
    out = subprocess.run(["sbatch", "--parsable", str(script)], cwd=tmp, capture_output=True, text=True, check=True,
                         env={**os.environ, "HPC_TOOLS_RUNS_DIR": str(tmp / f"runs-{name}"),
                              "PYTHONPATH": str(REPO)})
    job_id = out.stdout.strip().split(";")[0]
    return job_id, RunFolder(tmp / f"runs-{name}" / f"gpt_zero-j{job_id}")


def measure(repeat_tmp: Path) -> dict[str, dict]:
    jobs = {"in-job": submit(repeat_tmp, "injob", 2), "requeue": submit(repeat_tmp, "requeue", 0)}
    killed: dict[str, float] = {}
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline:
            for name, (job_id, run) in jobs.items():
                if name not in killed and run.path.is_dir() and rank0_step(run) >= FAULT_AT:
                    victim = heartbeat.read_all(run.path, 0).get(1)
                    if victim is None:
                        continue
                    os.kill(victim.pid, signal.SIGKILL)
                    killed[name] = time.time()
                    if name == "requeue":
                        subprocess.run(["scontrol", "requeue", job_id], capture_output=True, timeout=30)
            if len(killed) == 2 and all(run.manifest().get("state") == "COMPLETED" for _, run in jobs.values()):
                break
            time.sleep(0.05)
        else:
            raise SystemExit(f"timed out: {[(n, r.manifest().get('state')) for n, (_, r) in jobs.items()]}")
    finally:
        for job_id, _ in jobs.values():
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    found = {}
    for name, (job_id, run) in jobs.items():
        first = next(r for r in records(run, "rank00000.jsonl") if r["restart"] >= 1)
        start = next(e for e in records(run, "events_rank00000.jsonl")
                     if e["event"] == "start" and e["restart"] >= 1)
        found[name] = {"job": job_id, "kill_to_first_step_s": round(first["time"] - killed[name], 1),
                       "kill_to_rank_start_s": round(start["process_start"] - killed[name], 1),
                       "resumed_from": first["step"] - 1,
                       "manifest_time_to_first_step_s": ((run.manifest().get("restarts") or [{}])[-1]
                                                         .get("time_to_first_step_s"))}
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_recovery-") as tmp:
        for i in range(args.repeat):
            folder = Path(tmp) / f"r{i}"
            folder.mkdir()
            rows.append(measure(folder))
            for name, row in rows[-1].items():
                print(f"{name:8s} kill -9 -> first new step {row['kill_to_first_step_s']:6.1f} s "
                      f"(-> new ranks started {row['kill_to_rank_start_s']:5.1f} s), resumed from step "
                      f"{row['resumed_from']} (job {row['job']})", flush=True)
    for name in ("in-job", "requeue"):
        values = sorted(r[name]["kill_to_first_step_s"] for r in rows)
        starts = sorted(r[name]["kill_to_rank_start_s"] for r in rows)
        print(f"{name}: kill -9 -> first new step median {values[len(values) // 2]:.1f} s (min {values[0]:.1f}, "
              f"max {values[-1]:.1f}); -> new ranks started median {starts[len(starts) // 2]:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
