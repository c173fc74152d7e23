"""``profiling.stall.StallClock``: a process stopped from outside (SIGSTOP/SIGCONT) counts the stop as stalled time;
one that computes or sleeps counts only what the machine's other load takes from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.helpers import REPO

CHILD = """
import sys, time
from profiling.stall import StallClock
clock = StallClock()
print("ready", flush=True)
sys.stdin.readline()          # the parent stops and continues this process meanwhile
x = 0
t0 = time.monotonic()
while time.monotonic() - t0 < 0.3:  # compute, holding the GIL in Python between switches
    x += 1
time.sleep(0.2)               # sleep: not a stall
print(f"{clock.stalled_s:.4f}", flush=True)
clock.close()
"""


def _run(stop_s: float) -> float:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "ready"
        if stop_s:
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    return float(out.strip())


def test_a_stopped_process_counts_the_stop_and_a_busy_or_sleeping_one_hardly_anything():
    stopped = _run(0.5)
    assert stopped >= 0.45, stopped  # the stop, whole (plus whatever descheduling a busy test machine adds)
    unstopped = _run(0.0)
    assert unstopped < stopped, (unstopped, stopped)  # computing and sleeping are not stalls
