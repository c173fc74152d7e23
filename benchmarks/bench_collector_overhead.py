"""Overhead of the step collectors: the same small data-parallel job (2 ranks, gloo, a 4-layer MLP whose gradients
are all-reduced every step) with the collectors off, with the default set, and with everything on (communication
traced on every step, a torch.profiler window), interleaved in rounds so that machine noise hits all three alike.

Prints the median step time of each and the ratios to "off" (goal: default <= 1.01, everything <= 1.05 on CPU).
The step time is taken by the workload around start_step..end_step, not by the collector under test.

    PYTHONPATH=. python benchmarks/bench_collector_overhead.py [--ranks 2] [--steps 60] [--rounds 3] [--pipeline]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hpc_tools.recipe.profiling import ProfilingConfig  # noqa: E402
from hpc_tools.testing.workload import launch  # noqa: E402

GOALS = {"default": 1.01, "everything": 1.05}  # "sampled": a window every 5 steps, to price one window


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--pipeline", action="store_true",
                        help="the pipeline path: Megatron-core 1F1B over --ranks stages, p2p traced every step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-collector-") as tmp:
        results = launch("bench_pipeline" if args.pipeline else "bench", Path(tmp), args.ranks, "--steps",
                         str(args.steps), "--rounds", str(args.rounds), timeout_s=1800)
    job = "1F1B pipeline, p2p traced every step" if args.pipeline else "data-parallel MLP"
    print(f"collector overhead: {job}, {args.ranks} ranks (gloo), {results[0]['steps_per_config']} steps per "
          "configuration")
    print(f"{'configuration':<12} {'rank':>4} {'median step':>12} {'ratio':>7} {'goal':>6} "
          f"{'collector/step (median, mean)':>30} {'share':>7}")
    for rank, res in enumerate(results):
        for name, median in res["median_step_s"].items():
            ratio = res["ratio"][name]
            goal = f"<={GOALS[name]:.2f}" if name in GOALS else ""
            inside, mean = res["median_collector_s"][name], res["mean_collector_s"][name]
            print(f"{name:<12} {rank:>4} {median * 1e3:>10.3f}ms {ratio:>7.4f} {goal:>6} "
                  f"{inside * 1e6:>15.1f}us {mean * 1e6:>10.1f}us {100 * mean / median:>6.3f}%")
    default_every = ProfilingConfig().trace_sample_interval
    for rank, res in enumerate(results):  # one sampled window: its traced step's start_step + end_step, less default's
        windows = sorted(res["sampled_windows_s"])
        window_s = statistics.median(windows) - res["median_collector_s"]["default"]
        share = window_s / (default_every * res["median_step_s"]["off"]) if default_every else 0.0
        print(f"sampled trace, rank {rank}: one window {window_s * 1e3:.1f} ms (median of {len(windows)}; first "
              f"{res['sampled_windows_s'][0] * 1e3:.0f} ms, max {windows[-1] * 1e3:.0f} ms) = "
              f"{window_s / res['median_step_s']['off']:.2f} median steps; every {default_every} steps "
              f"(profiling.trace_sample_interval default) {100 * share:.3f} % of the run (goal <= 1 %)")
    print("ratio: median step time over 'off' (end to end, sensitive to machine load); collector/step: host time "
          "inside start_step + end_step (mean includes sampled steps and the profiler window), "
          "share = mean / median step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
