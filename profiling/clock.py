"""Time marks that are honest on both devices.

On CPU a mark is ``time.perf_counter()``. On GPU a mark is a CUDA event recorded on the current stream, so an interval
is what the GPU did between two points of the program (kernels are asynchronous: a host clock would only measure
kernel launches). Events are read only after the step-end event has been synchronised (``StepCollector.end_step``),
which is the one place the collectors synchronise the host with the GPU.
"""

from __future__ import annotations

import time


class Clock:
    """``mark()`` now; ``seconds(a, b)`` between two marks (GPU: valid once ``b`` has completed)."""

    def __init__(self, cuda: bool = False):
        self.cuda = cuda
        if cuda:
            import torch

            self._event = torch.cuda.Event

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = self._event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        return start.elapsed_time(end) / 1e3

    def wait(self, mark) -> None:
        """Block the host until ``mark`` has happened on the GPU (no-op on CPU)."""
        if self.cuda:
            mark.synchronize()
