"""How long the host kept a rank process from running when it asked to: a rank's own evidence of a host stall.

A daemon thread sleeps ``PERIOD_S`` at a time and measures how late it wakes. A wake later than ``SLACK_S`` past its
time means nothing of the process ran for that long: it was stopped (SIGSTOP, a frozen cgroup, a throttled VM) or
descheduled (CPU contention, memory pressure). ``stalled_s`` adds up those late wakes, whole, and the collector
records its growth over every step (``host_stall_s``). A rank that computes, waits in a collective or sleeps for
data is not stalled: its thread still wakes on time, and the GIL it waits for is released at least every few
milliseconds (``sys.getswitchinterval``), far below ``SLACK_S``.

Why it matters: a rank stopped inside a collective holds its peers there as long as it holds itself, so its lateness
at the collectives need not show the stall (``stragglers.py``, "host stalled"); its own wake-ups do. Cost: a wake-up
every ``PERIOD_S`` (a few microseconds each).
"""

from __future__ import annotations

import threading
import time

PERIOD_S = 0.01  # how often the thread wakes
SLACK_S = 0.02  # a wake later than this past its time is a stall (the GIL's switch interval is 0.005 s)


class StallClock:
    """``stalled_s``: seconds of late wakes (each more than ``SLACK_S`` late) since the clock started."""

    def __init__(self, period_s: float = PERIOD_S, slack_s: float = SLACK_S):
        self.period_s, self.slack_s = period_s, slack_s
        self._stalled = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpc-tools-stall-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            late = now - last - self.period_s
            if late > self.slack_s:
                with self._lock:
                    self._stalled += late
            last = now

    @property
    def stalled_s(self) -> float:
        """Seconds the process was kept from running (each stall as measured at the wake that ended it)."""
        with self._lock:
            return self._stalled

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
