"""Cost of the health checks while training (``profiling.health_interval_min``, hpc_tools/runtime/health.py): the same
local run (the recipe's local profile, each local rank standing for a node: ``HPC_TOOLS_PREFLIGHT_RANKS_PER_NODE=1``)
with the checks off and with a short interval, in alternating rounds so that machine noise hits both alike.

Prints per configuration the run's wall time and median step time, and for the checks their number, the mean seconds
of one check, their measured share of the run (``health.json``: the checks' own time over the start's wall time), and
that share projected to the default interval (one check's seconds over the interval; goal: <= 1 %). The step time is
the records' (a check runs between two steps, outside every step's record); the wall times show what the checks add
on top, within this machine's noise.

    PYTHONPATH=. python benchmarks/bench_health_overhead.py [--recipe recipes/gpt_3d.yaml] [--interval-min 0.05]
        [--steps 30] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hpc_tools.recipe.profiling import ProfilingConfig  # noqa: E402
from hpc_tools.registry import list_runs  # noqa: E402
from hpc_tools.runtime import health_verdict  # noqa: E402

GOAL = 0.01


def one_run(recipe: str, runs_dir: Path, interval_min: float, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPC_TOOLS_PREFLIGHT_RANKS_PER_NODE": "1"}
    before = {r.path for r in list_runs(runs_dir)} if runs_dir.is_dir() else set()
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "hpc_tools", "submit", recipe, "--runs-dir", str(runs_dir),
                          "--executor", "local", "--set", f"profiling.health_interval_min={interval_min}",
                          "--set", f"training.train_iters={steps}"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"the run failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    [run] = [r for r in list_runs(runs_dir) if r.path not in before]
    summary = json.loads((run.path / "summary.json").read_text())
    health = health_verdict.read_report(run.path) or {}
    return {"wall_s": wall, "step_s": summary.get("step_time_median_s"), "checks": health.get("checks", 0),
            "check_s": health.get("seconds", 0.0), "share": health.get("share"),
            "named": [e["node"] for e in health.get("named", [])]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/gpt_3d.yaml")
    parser.add_argument("--interval-min", type=float, default=0.05, help="the checks' interval in the 'on' runs")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    default_min = ProfilingConfig().health_interval_min
    results: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="bench-health-") as tmp:
        for _ in range(args.rounds):
            for name, interval in (("off", 0.0), ("on", args.interval_min)):
                results[name].append(one_run(args.recipe, Path(tmp) / name, interval, args.steps))
    off, on = results["off"], results["on"]
    med = statistics.median
    print(f"health check overhead: {args.recipe} (local profile, each rank a node), {args.steps} steps, "
          f"{args.rounds} round(s)")
    for name, rows in results.items():
        print(f"  {name:3s}: wall {med(r['wall_s'] for r in rows):.1f} s, median step "
              f"{med(r['step_s'] for r in rows):.4f} s" + (f", {med(r['checks'] for r in rows):.0f} checks every "
                                                          f"{args.interval_min:g} min" if name == "on" else ""))
    checks = sum(r["checks"] for r in on)
    per_check = sum(r["check_s"] for r in on) / checks if checks else 0.0
    shares = [r["share"] for r in on if r["share"] is not None]
    projected = per_check / (default_min * 60)
    print(f"  one check: {per_check:.3f} s (mean of {checks}); measured share of the run at {args.interval_min:g} "
          f"min: {100 * med(shares) if shares else float('nan'):.2f} %; wall on/off "
          f"{med(r['wall_s'] for r in on) / med(r['wall_s'] for r in off):.3f}")
    print(f"  projected share at the default interval ({default_min:g} min): {100 * projected:.3f} % "
          f"(goal <= {100 * GOAL:g} %): {'ok' if projected <= GOAL else 'OVER'}")
    named = sorted({n for r in on for n in r["named"]})
    if named:
        print(f"  note: the checks named {', '.join(named)} on this machine (no fault was injected)")
    return 0 if projected <= GOAL else 1


if __name__ == "__main__":
    sys.exit(main())
