"""``python -m tests.timeline FILE``: where a test run's wall time went, from the lines tests/conftest.py writes
under HPC_TOOLS_TEST_TIMELINE: each xdist worker's busy time and when it finished, and the groups (a Slurm group
runs on one worker, one test at a time) that took the longest."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def summary(lines: list[dict], top: int = 12) -> str:
    if not lines:
        return "test timeline: no tests recorded"
    t0 = min(x["start"] for x in lines)
    out = [f"test timeline: {len(lines)} tests over {max(x['end'] for x in lines) - t0:.0f} s"]
    by_worker: dict[str, list[dict]] = defaultdict(list)
    by_group: dict[str, float] = defaultdict(float)
    by_module: dict[str, float] = defaultdict(float)
    for x in lines:
        by_worker[x["worker"]].append(x)
        by_group[x.get("group") or "-"] += x["end"] - x["start"]
        by_module[x["test"].split("::")[0]] += x["end"] - x["start"]
    for worker, xs in sorted(by_worker.items()):
        busy = sum(x["end"] - x["start"] for x in xs)
        out.append(f"  worker {worker}: {len(xs)} tests, busy {busy:.0f} s, last test ended at "
                   f"{max(x['end'] for x in xs) - t0:.0f} s")
    failed = [x["test"] for x in lines if x.get("outcome") == "failed"]
    if failed:
        out.append("  failed: " + ", ".join(failed))
    out.append("  longest groups: " + ", ".join(f"{g} {s:.0f} s" for g, s in
                                                 sorted(by_group.items(), key=lambda kv: -kv[1])[:top]))
    out.append("  longest modules: " + ", ".join(f"{m.split('/')[-1]} {s:.0f} s" for m, s in
                                                  sorted(by_module.items(), key=lambda kv: -kv[1])[:top]))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    print(summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
