"""torch.profiler windows: the explicit one (``profiling.torch_profiler``: steps [start_step, start_step + num_steps)
on chosen ranks) and the sampled ones (``profiling.trace_sample_interval``: one step every N steps on every rank).

A trace is written as Chrome trace JSON, ``<run>/profiler/rank<R>.steps<A>-<B>.pt.trace.json`` (sampled windows
gzipped, ``.pt.trace.json.gz``): the name pattern the TensorBoard profiler plugin lists, and the per-rank files
Holistic Trace Analysis reads (torch adds ``distributedInfo``, with every process group's name, description and
ranks, when torch.distributed is initialised).

While a window records, the job marks what a trace alone cannot tell apart (``profiling.breakdown`` reads them):

* ``hpc_tools#step <n>``: the collector's step, start_step to end_step (the record's ``step_time_s``);
* ``hpc_tools#data``: the data timer (batch loading), and ``hpc_tools#compute``: test-injected slow compute;
* ``hpc_tools#comm <kind> pg=<name>``: every collective the communication wrappers see (``profiling.comm``), with
  its process group's name: on CPU (gloo) torch 2.13 records no process group on collective events, only the
  groups in ``distributedInfo``; each gloo group runs its ops on its own worker threads, so this mark names the
  group of the ops that follow on those threads. ``pg=horovod`` (``horovod_wait``): the training thread's wait for
  Horovod's all-reduces, which run outside torch.distributed.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

log = logging.getLogger("hpc_tools.profiling")

STEP, DATA, COMPUTE, COMM = "hpc_tools#step", "hpc_tools#data", "hpc_tools#compute", "hpc_tools#comm"
HOROVOD_PG = "horovod"  # the group name of Horovod's all-reduces in the marks (all ranks: data parallel)
_recording = 0  # windows recording in this process: the comm wrappers mark their calls only then


def recording() -> bool:
    """Whether a window is recording now (one attribute read: the comm wrappers ask on every call)."""
    return _recording > 0


@contextlib.contextmanager
def span(name: str):
    """A ``record_function`` span named ``name`` while a window records; nothing otherwise."""
    if not _recording:
        yield
        return
    from torch.autograd.profiler import record_function

    with record_function(name):
        yield


def comm_span(kind: str, group) -> contextlib.AbstractContextManager:
    """The mark of one collective (``hpc_tools#comm <kind> pg=<name>``) while a window records."""
    if not _recording:
        return contextlib.nullcontext()
    return span(f"{COMM} {kind} pg={group_name(group)}")


def horovod_wait() -> contextlib.AbstractContextManager:
    """The mark of the training thread's wait for Horovod's gradient all-reduces (``synchronize()``), as a collective
    of the group ``HOROVOD_PG``: Horovod runs them in its own background thread, outside torch.distributed and
    outside the trace's operators, so without the mark the wait reads as host time."""
    return span(f"{COMM} all_reduce pg={HOROVOD_PG}")


def group_name(group) -> str:
    """The name torch gives ``group`` (the ``pg_name`` of ``distributedInfo.pg_config``); the world when None."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        return c10d._get_process_group_name(group if group is not None else dist.group.WORLD)
    except Exception:  # noqa: BLE001 - a mark never stops training: unnamed, the breakdown uses the thread's vote
        return "?"


class TraceWindow:
    def __init__(self, out_dir: Path, rank: int, start_step: int, num_steps: int, cuda: bool = False,
                 shapes: bool = True, gzip: bool = False):
        self.out_dir, self.rank = Path(out_dir), rank
        self.first, self.last = start_step, start_step + num_steps - 1
        self.cuda, self.shapes, self.gzip = cuda, shapes, gzip
        self._prof = None
        self._step_span = None
        self.path: Path | None = None

    def start_step(self, step: int) -> None:
        if step == self.first or (self._prof is None and self.first < step <= self.last and self.path is None):
            self._start(step)
        if self._prof is not None:
            from torch.autograd.profiler import record_function

            self._step_span = record_function(f"{STEP} {step}")
            self._step_span.__enter__()

    def end_step(self, step: int) -> None:
        if self._prof is None:
            return
        self._close_span()
        self._prof.step()
        if step >= self.last:
            self._stop(step)

    def close(self) -> None:
        if self._prof is not None:
            self._close_span()
            self._stop(None)

    def _close_span(self) -> None:
        if self._step_span is not None:
            self._step_span.__exit__(None, None, None)
            self._step_span = None

    def _start(self, step: int) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        global _recording
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._first_traced = step
        # A schedule that always records makes step() emit "ProfilerStep#<n>" spans (TensorBoard/HTA step view);
        # n starts at the training step so that trace and records agree.
        self._prof = profile(activities=activities, record_shapes=self.shapes, with_stack=False,
                             schedule=lambda _: ProfilerAction.RECORD)
        self._prof.step_num = step
        self._prof.__enter__()
        _recording += 1

    def _stop(self, step: int | None) -> None:
        global _recording
        prof, self._prof = self._prof, None
        _recording -= 1
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        last = step if step is not None else "end"
        suffix = ".pt.trace.json.gz" if self.gzip else ".pt.trace.json"
        self.path = self.out_dir / f"rank{self.rank:05d}.steps{self._first_traced}-{last}{suffix}"
        prof.export_chrome_trace(str(self.path))
        log.info("torch.profiler trace of steps %s-%s written to %s", self._first_traced, last, self.path)


class Traces:
    """Every window of one rank: the explicit one (``window``: first step, steps; or None) and, beside it, one step
    every ``every`` steps after the warm-up (``profiling.trace_sample_interval``; 0: none), lighter (no shapes) and
    gzipped. A sampled step inside the explicit window is the explicit window's."""

    def __init__(self, out_dir: Path, rank: int, cuda: bool, window: tuple[int, int] | None, every: int,
                 warmup: int):
        self.out_dir, self.rank, self.cuda, self.every, self.warmup = Path(out_dir), rank, cuda, every, warmup
        self.explicit = TraceWindow(out_dir, rank, window[0], window[1], cuda) if window else None
        self._sampled: TraceWindow | None = None
        self.paths: list[Path] = []

    def _in_explicit(self, step: int) -> bool:
        return self.explicit is not None and self.explicit.first <= step <= self.explicit.last

    def start_step(self, step: int) -> None:
        if self._in_explicit(step):
            self.explicit.start_step(step)
        elif self.every and step > self.warmup and step % self.every == 0 and not recording():
            self._sampled = TraceWindow(self.out_dir, self.rank, step, 1, self.cuda, shapes=False, gzip=True)
            self._sampled.start_step(step)

    def end_step(self, step: int) -> None:
        if self._in_explicit(step):
            self.explicit.end_step(step)
            if self.explicit.path is not None and self.explicit.path not in self.paths:
                self.paths.append(self.explicit.path)
        elif self._sampled is not None:
            self._sampled.end_step(step)
            self._collect()

    def _collect(self) -> None:
        if self._sampled is not None and self._sampled._prof is None:
            if self._sampled.path is not None:
                self.paths.append(self._sampled.path)
            self._sampled = None

    def close(self) -> None:
        if self.explicit is not None:
            self.explicit.close()
        if self._sampled is not None:
            self._sampled.close()
            self._collect()


def trace_paths(run_dir: Path) -> list[Path]:
    """Every trace file of a run (``profiler/rank<R>.steps<A>-<B>.pt.trace.json[.gz]``), sorted by name."""
    folder = Path(run_dir) / "profiler"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.endswith((".pt.trace.json", ".pt.trace.json.gz")))
