"""Wall time of every light command as a user types it (fresh processes, median of N), over a bare interpreter start
(``python -c pass``, measured in the same run, alternating), and the import time of the recipe schema. Goals: each
light command at most 0.45 s over the bare start, ``--help`` at most 0.1 s over it (bytecode cached: the first of
the N runs writes it).

    python benchmarks/bench_cli_speed.py [--repeats 5] [--json]

``status`` and ``list`` run against an empty runs folder (the no-runs path). A command that exits non-zero is timed
all the same and its exit code printed (``status`` with no runs says so and exits 2).
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

REPO = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
"""As a user's shell runs them: bytecode written once and read after (a session that sets PYTHONDONTWRITEBYTECODE
would compile every module at every start, ~0.1 s here)."""
HELP_GOAL_S = 0.10  # over a bare interpreter start
LIGHT_GOAL_S = 0.45


def light_commands(runs_dir: str) -> dict[str, list[str]]:
    """The light commands, by label: none of them may import torch, pandas or start a job."""
    return {
        "--help": ["--help"],
        "validate": ["validate", "recipes/gpt_3d.yaml"],
        "render": ["render", "recipes/gpt_3d.yaml", "-o", "-"],
        "plan": ["plan", "recipes/gpt_3d.yaml"],
        "list": ["list", "--runs-dir", runs_dir],
        "status": ["status", "--runs-dir", runs_dir],
        "explain": ["validate", "--explain", "parallel.tensor_size"],
    }


def wall(argv: list[str]) -> tuple[float, int]:
    """Seconds from process start to exit of ``python -m hpc_tools ARGV``, and its exit code."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hpc_tools", *argv], cwd=REPO, capture_output=True, env=ENV)
    return time.perf_counter() - t0, proc.returncode


def schema_import_s() -> float:
    """Import time of hpc_tools.recipe.schema measured inside a fresh interpreter (interpreter start excluded)."""
    code = ("import time; t0 = time.perf_counter(); import hpc_tools.recipe.schema; "
            "print(time.perf_counter() - t0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, env=ENV)
    return float(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    python = [sys.executable, "-c", "pass"]
    with tempfile.TemporaryDirectory() as runs:
        for name, argv in light_commands(runs).items():
            wall(argv)  # writes the bytecode
            runs_, bares = [], []
            for _ in range(args.repeats):  # alternating, so both sides see the same machine load
                bares.append(_timed(python))
                runs_.append(wall(argv))
            times = [t for t, _ in runs_]
            goal = HELP_GOAL_S if name == "--help" else LIGHT_GOAL_S
            bare = statistics.median(bares)
            results[name] = {"median_s": statistics.median(times), "min_s": min(times), "exit": runs_[-1][1],
                             "bare_s": bare, "over_bare_s": statistics.median(times) - bare, "goal_over_bare_s": goal}
    imports = [schema_import_s() for _ in range(args.repeats)]
    results["import hpc_tools.recipe.schema"] = {"median_s": statistics.median(imports), "min_s": min(imports)}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, r in results.items():
        goal = r.get("goal_over_bare_s")
        code = f"  exit {r['exit']}" if r.get("exit") else ""
        if goal is None:
            print(f"{name:<32} median {r['median_s']:.3f} s  min {r['min_s']:.3f} s  (n={args.repeats})")
            continue
        verdict = "ok" if r["over_bare_s"] <= goal else f"OVER the {goal} s goal"
        print(f"{name:<32} median {r['median_s']:.3f} s  = bare start {r['bare_s']:.3f} s + {r['over_bare_s']:.3f} s"
              f"  (n={args.repeats}){code}  {verdict}")


def _timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, capture_output=True, check=True, env=ENV)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
