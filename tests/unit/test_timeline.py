"""tests/timeline.py: the suite's timeline says how busy the machine's CPUs were, over the run and during the longest
groups' tests (does a waiting group leave a core idle that another xdist worker could use?), from /proc/stat's
counters that tests/conftest.py records when each test begins and ends."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO
from tests.timeline import cpu_counters, own_cpu_s, read_cpu, summary

STAT = "cpu  100 5 20 300 40 0 3 2 7 0\ncpu0 50 2 10 150 20 0 1 1 3 0\nintr 1 2 3\n"


def test_counters_are_busy_and_total_jiffies_of_the_cpu_line():
    # user+nice+system+irq+softirq+steal = 130 busy; idle+iowait = 340; guest (7) is inside user already
    assert cpu_counters(STAT) == [130, 470]


def test_this_machine_has_counters_that_grow():
    first = read_cpu()
    assert first is not None and 0 <= first[0] <= first[1]
    sum(i * i for i in range(200000))  # some CPU time
    second = read_cpu()
    assert second[1] >= first[1] and second[0] >= first[0]


def line(test, group, start, end, cpu, worker="gw0"):
    return {"test": test, "worker": worker, "group": group, "start": start, "end": end, "outcome": "passed",
            "cpu": cpu}


def test_the_summary_gives_the_runs_and_each_groups_busy_share():
    lines = [
        # the slurm group waits: 25 of 100 jiffies busy, then 15 of 100
        line("a::slurm1", "slurm", 0, 10, [[0, 0], [25, 100]], worker="gw1"),
        line("a::slurm2", "slurm", 10, 20, [[25, 100], [40, 200]], worker="gw1"),
        # a training module on the other worker, over the same time: its spans overlap the slurm ones
        line("b::train", "test_train", 0, 20, [[0, 0], [40, 200]]),
        line("c::old", "-", 0, 1, None),  # a line written before the counters were recorded
    ]
    text = summary(lines)
    assert "CPU busy: 20% of the machine over the run" in text, text  # 40 of 200 from first start to last end
    assert "CPU busy during the longest groups' tests: slurm 20%, test_train 20%" in text, text


def test_each_modules_own_cpu_seconds_are_summed_and_ranked():
    lines = [{**line("a.py::t1", "-", 0, 1, None), "own_cpu_s": 2.5}, {**line("a.py::t2", "-", 1, 2, None),
                                                                        "own_cpu_s": 1.0},
             {**line("b.py::t", "-", 2, 3, None), "own_cpu_s": 9.0}, line("c.py::old", "-", 3, 4, None)]
    text = summary(lines)
    assert "CPU-s of the tests' own processes (not the ranks Slurm starts): 12; most: b.py 9, a.py 4" in text, text


def test_own_cpu_seconds_count_a_child_that_was_waited_for():
    before = own_cpu_s()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True, timeout=60)
    assert own_cpu_s() - before > 0.05


def test_a_timeline_without_counters_says_nothing_about_the_cpu():
    text = summary([line("a::t", "slurm", 0, 5, None)])
    assert "CPU" not in text and "longest groups: slurm 5 s" in text


def test_the_command_prints_the_cpu_lines(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        line("a::s", "slurm", 0, 10, [[10, 100], [30, 300]]),
        line("b::t", "test_x", 10, 20, [[30, 300], [230, 500]])]) + "\n")
    out = subprocess.run([sys.executable, "-m", "tests.timeline", str(path)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "CPU busy: 55% of the machine over the run" in out.stdout  # (230-10) of (500-100)
    assert "slurm 10%" in out.stdout and "test_x 100%" in out.stdout, out.stdout
