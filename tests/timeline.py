"""``python -m tests.timeline FILE``: where a test run's wall time went, from the lines tests/conftest.py writes
under HPC_TOOLS_TEST_TIMELINE: each xdist worker's busy time and when it finished, and the groups (a Slurm group
runs on one worker, one test at a time) that took the longest; and how busy the machine's CPUs were, over the run and
during each of the longest groups' tests (``cpu``: /proc/stat's counters when a test began and ended): the share a
waiting group leaves idle is what another xdist worker could use; and the CPU seconds of each module's own
processes (``own_cpu_s``: the worker and what it waited for, local ranks included, Slurm's ranks not)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def own_cpu_s() -> float:
    """CPU seconds of this process and of every child process it has waited for (theirs, recursively)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def cpu_counters(stat_text: str) -> list[int]:
    """[busy, total] jiffies of every CPU together, from /proc/stat's text (its first, ``cpu`` line): idle and
    iowait are not busy; guest time is counted within user time already, so only the first eight fields add up."""
    fields = [int(x) for x in stat_text.split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return [sum(fields) - idle, sum(fields)]


def read_cpu() -> list[int] | None:
    """This machine's counters now; None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return cpu_counters(f.read())
    except (OSError, ValueError, IndexError):
        return None


def _busy_share(spans: list[tuple[list[int], list[int]]]) -> float | None:
    busy = sum(end[0] - start[0] for start, end in spans)
    total = sum(end[1] - start[1] for start, end in spans)
    return busy / total if total > 0 else None


def cpu_lines(lines: list[dict], groups: list[str]) -> list[str]:
    """The machine's busy share over the whole run (first start to last end) and, per group, over its tests' spans
    (a group's tests run one at a time, on one worker: their spans do not overlap; the other worker's load is in
    them too)."""
    spans = [tuple(x["cpu"]) for x in lines if x.get("cpu")]
    if not spans:
        return []
    first = min(spans, key=lambda s: s[0][1])[0]
    last = max(spans, key=lambda s: s[1][1])[1]
    whole = _busy_share([(first, last)])
    out = [f"  CPU busy: {whole:.0%} of the machine over the run" if whole is not None else "  CPU busy: unknown"]
    per_group = []
    for g in groups:
        share = _busy_share([tuple(x["cpu"]) for x in lines if x.get("cpu") and (x.get("group") or "-") == g])
        if share is not None:
            per_group.append(f"{g} {share:.0%}")
    if per_group:
        out.append("  CPU busy during the longest groups' tests: " + ", ".join(per_group))
    return out


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
    out.extend(cpu_lines(lines, [g for g, _ in sorted(by_group.items(), key=lambda kv: -kv[1])[:5]]))
    own: dict[str, float] = defaultdict(float)
    for x in lines:
        if x.get("own_cpu_s") is not None:
            own[x["test"].split("::")[0]] += x["own_cpu_s"]
    if own:
        out.append(f"  CPU-s of the tests' own processes (not the ranks Slurm starts): {sum(own.values()):.0f}; "
                   "most: " + ", ".join(f"{m.split('/')[-1]} {s:.0f}" for m, s in
                                        sorted(own.items(), key=lambda kv: -kv[1])[:top]))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    print(summary(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
