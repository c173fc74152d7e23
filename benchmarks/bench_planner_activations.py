"""Benchmark: the planner's activation bytes vs what autograd saves in the real Megatron-core model (CPU, gloo).

    python benchmarks/bench_planner_activations.py                  # 300 random configurations, seed 15
    python benchmarks/bench_planner_activations.py --cases 60 --before HEAD --markdown table.md

Draws random configurations of the space the Megatron job supports (``hpc_tools.testing.activations.sample_cases``),
measures them in one launch of two gloo ranks (TP 1 and 2), and prints config -> measured vs predicted bytes per
layer and per chunk (one microbatch), with the worst relative error of the current formulas and of the ones in
``--before`` (a git revision: ``git show REV:hpc_tools/planner/memory.py`` loaded as a module of its own).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hpc_tools.planner.memory as memory  # noqa: E402
from hpc_tools.testing.activations import compare, predict_case, sample_cases  # noqa: E402
from hpc_tools.testing.spawn import spawn_ranks  # noqa: E402


def memory_at(rev: str, tmp: Path):
    """``hpc_tools/planner/memory.py`` as it was at git revision ``rev``, imported as a separate module."""
    text = subprocess.run(["git", "show", f"{rev}:hpc_tools/planner/memory.py"], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout
    path = tmp / "memory_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("memory_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_before"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def worst(rows: list[dict], key: str) -> float:
    values = [abs(r[key]) for r in rows if r[key] is not None]
    return max(values) if values else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--before", default="HEAD", help="git revision whose memory.py is 'before' (default HEAD)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    args = ap.parse_args()
    cases = sample_cases(args.cases, args.seed)
    with tempfile.TemporaryDirectory(prefix="bench_acts_") as tmp_name:
        tmp = Path(tmp_name)
        before = memory_at(args.before, tmp)
        (tmp / "cases.json").write_text(json.dumps([c.as_dict() for c in cases]))
        started = time.perf_counter()
        ranks = spawn_ranks([sys.executable, "-m", "hpc_tools.testing.activations", tmp / "cases.json",
                             tmp / "measured"], 2, env={"HF_HUB_OFFLINE": "1"}, timeout_s=1800)
        if not all(r.ok for r in ranks):
            print(ranks[0].log[-3000:])
            return 1
        elapsed = time.perf_counter() - started
        measured = json.loads((tmp / "measured.json").read_text())
        now = [compare(c, m, predict_case(c, memory)) for c, m in zip(cases, measured)]
        old = [compare(c, m, predict_case(c, before)) for c, m in zip(cases, measured)]
    lines = ["| # | configuration | layer measured | layer predicted (before) | chunk measured | chunk predicted "
             "| error | error before |", "|---|---|---|---|---|---|---|---|"]
    for i, (row, prev) in enumerate(zip(now, old), 1):
        layer = "-" if row["measured_layer"] is None else f"{row['measured_layer']:,}"
        pred = ("-" if row["predicted_layer"] is None else
                f"{row['predicted_layer']:,.0f} ({prev['predicted_layer'] or 0:,.0f})")
        lines.append(f"| {i} | {row['case']} | {layer} | {pred} | {row['measured_total']:,} | "
                     f"{row['predicted_total']:,.0f} | {row['total_error']:+.2%} | {prev['total_error']:+.2%} |")
    exact = sum(1 for r in now if r["predicted_total"] == r["measured_total"])
    summary = [
        f"{len(cases)} configurations (seed {args.seed}), measured in {elapsed:.1f} s (one launch, 2 gloo ranks)",
        f"per layer, worst |error|: now {worst(now, 'layer_error'):.2%}, before ({args.before}) "
        f"{worst(old, 'layer_error'):.2%}",
        f"per chunk, worst |error|: now {worst(now, 'total_error'):.2%}, before {worst(old, 'total_error'):.2%}",
        f"exact per chunk: {exact} of {len(cases)} now, "
        f"{sum(1 for r in old if r['predicted_total'] == r['measured_total'])} before",
    ]
    text = "\n".join(lines + [""] + summary)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
