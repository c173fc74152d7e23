"""Hang detection: if no step completes within the timeout, dump every thread's stack and abort the rank.

A hung collective never returns, so the check runs in a daemon thread; it leaves ``HANG-rank<r>.txt`` in the run folder
(the analysis classifies such runs as `hang`) and exits with HANG_EXIT_CODE so srun tears the step down.
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from pathlib import Path

HANG_EXIT_CODE = 86
MARKER_GLOB = "HANG-rank*.txt"  # one per hung rank, in the run folder


class Watchdog:
    def __init__(self, timeout_s: float, run_dir: Path, rank: int):
        self.timeout_s = timeout_s
        self.path = Path(run_dir) / f"HANG-rank{rank:05d}.txt"
        self._last = time.monotonic()
        self._step = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpc_tools-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self._step = step
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 30.0)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                with open(self.path, "w") as f:
                    f.write(f"no step completed for {idle:.0f} s (timeout {self.timeout_s:.0f} s); "
                            f"last step {self._step}\n")
                    faulthandler.dump_traceback(file=f, all_threads=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(HANG_EXIT_CODE)
