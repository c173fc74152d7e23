"""CPU seconds and wall time of a whole local run with its ranks forked from the fork server
(``hpc_tools.runtime.forkserver``: the libraries imported once) and with each rank importing for itself
(``HPC_TOOLS_FORKSERVER=0``, as srun's ranks do). Each figure is one ``hpc_tools submit --executor local`` of the
recipe's local profile (the launcher, the server and every rank: the CPU time of all the processes it waited for);
the two ways alternate, so both see the same load.

    PYTHONPATH=. python benchmarks/bench_local_start.py [--recipe recipes/gpt_3d.yaml] [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time


def one_run(recipe: str, steps: int, forked: bool) -> tuple[float, float]:
    """(CPU seconds of every process of the run, wall seconds) of one local run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory(prefix="bench_local_start_") as runs:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "hpc_tools", "submit", recipe, "--executor", "local",
                               "--runs-dir", runs, "--set", f"training.train_iters={steps}"],
                              env={**os.environ, "HPC_TOOLS_FORKSERVER": "1" if forked else "0"},
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}{proc.stdout[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/gpt_3d.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for forked in (False, True):
            got[forked].append(one_run(args.recipe, args.steps, forked))
    for forked, label in ((False, "each rank imports"), (True, "forked ranks     ")):
        cpu = statistics.median(c for c, _ in got[forked])
        wall = statistics.median(w for _, w in got[forked])
        print(f"{label}: {cpu:6.1f} CPU-s, {wall:5.1f} s wall (median of {args.repeats}; {args.recipe}, "
              f"{args.steps} steps, local profile)")
    ratio = statistics.median(c for c, _ in got[True]) / statistics.median(c for c, _ in got[False])
    print(f"forked / each imports, CPU-s: {ratio:.2f}")


if __name__ == "__main__":
    main()
