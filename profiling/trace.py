"""A torch.profiler window (``profiling.torch_profiler``): steps [start_step, start_step + num_steps) on chosen ranks.

The trace is written as Chrome trace JSON, ``<run>/profiler/rank<R>.steps<A>-<B>.pt.trace.json``: the name pattern the
TensorBoard profiler plugin lists, and the per-rank files Holistic Trace Analysis reads (torch adds
``distributedInfo`` when torch.distributed is initialised).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("hpc_tools.profiling")


class TraceWindow:
    def __init__(self, out_dir: Path, rank: int, start_step: int, num_steps: int, cuda: bool = False):
        self.out_dir, self.rank = Path(out_dir), rank
        self.first, self.last = start_step, start_step + num_steps - 1
        self.cuda = cuda
        self._prof = None
        self.path: Path | None = None

    def start_step(self, step: int) -> None:
        if step == self.first or (self._prof is None and self.first < step <= self.last and self.path is None):
            self._start(step)

    def end_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._prof.step()
        if step >= self.last:
            self._stop(step)

    def close(self) -> None:
        if self._prof is not None:
            self._stop(None)

    def _start(self, step: int) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._first_traced = step
        # A schedule that always records makes step() emit "ProfilerStep#<n>" spans (TensorBoard/HTA step view);
        # n starts at the training step so that trace and records agree.
        self._prof = profile(activities=activities, record_shapes=True, with_stack=False,
                             schedule=lambda _: ProfilerAction.RECORD)
        self._prof.step_num = step
        self._prof.__enter__()

    def _stop(self, step: int | None) -> None:
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        last = step if step is not None else "end"
        self.path = self.out_dir / f"rank{self.rank:05d}.steps{self._first_traced}-{last}.pt.trace.json"
        prof.export_chrome_trace(str(self.path))
        log.info("torch.profiler trace of steps %s-%s written to %s", self._first_traced, last, self.path)
