"""Control-plane latency: wall time of `--help`, `validate` and `render` (fresh processes, as a user types them),
and, when a Slurm cluster answers, submit -> COMPLETED through the project for the comm_check recipe's local profile.

    python benchmarks/bench_control_plane.py [--repeats 5] [--slurm-jobs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def wall(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hpc_tools", *args], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slurm-jobs", type=int, default=5)
    args = parser.parse_args()
    commands = {"--help": ["--help"], "validate": ["validate", "recipes/gpt_3d.yaml"],
                "render": ["render", "recipes/gpt_3d.yaml", "-o", "-"]}
    for name, argv in commands.items():
        times = [wall(argv) for _ in range(args.repeats)]
        print(f"{name:<10} median {statistics.median(times):.3f} s  min {min(times):.3f} s  (n={args.repeats})")
    sys.path.insert(0, str(REPO))
    from hpc_tools.executors.slurm import slurm_available

    ok, why = slurm_available()
    if not ok:
        print(f"slurm      skipped: {why}")
        return
    latencies = []
    with tempfile.TemporaryDirectory() as runs:
        for _ in range(args.slurm_jobs):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "hpc_tools", "submit", "recipes/comm_check.yaml", "--profile",
                                  "local", "--executor", "slurm", "--wait", "--json", "--runs-dir", runs], cwd=REPO,
                                 capture_output=True, text=True, check=True)
            latencies.append(time.perf_counter() - t0)
            assert json.loads(out.stdout)["state"] == "COMPLETED", out.stdout
    print(f"submit->COMPLETED (comm_check local, 2 ranks, 5 steps, incl. torch import and rendezvous) median "
          f"{statistics.median(latencies):.2f} s  min {min(latencies):.2f} s  (n={args.slurm_jobs})")


if __name__ == "__main__":
    main()
