"""Which of a sweep's cells go to Slurm now, in which job arrays, with which throttles: pure arithmetic over the
limits (``hpc_tools.sweep.limits``) and the sweep's own record of what it submitted.

Three limits shape a submission:

- ``array_tasks``: the most tasks one array may hold (``MaxArraySize``: indices 0..MaxArraySize-1, and
  ``max_array_tasks``); 1 means single jobs (``MaxArraySize`` 0 or 1: no arrays, or a group of one).
- ``queue_room``: how many more jobs this user may put in Slurm's queue now (``MaxSubmitJobs`` counts every array
  task, ``MaxJobCount`` is the cluster's ceiling); None when nothing bounds it.
- ``max_parallel`` (``sweep.max_parallel``): the most cells of the whole sweep that may run at once.

The throttle is sweep-wide, so it is shared between the sweep's live arrays: an array with throttle ``t`` (``%t``)
and ``live`` cells not yet ended runs at most ``min(t, live)`` cells, and the planner keeps the sum of those at most
``max_parallel``. It never lowers a throttle (a lowered throttle does not stop tasks already running); capacity an
array frees as it drains goes first to live arrays with cells held back by their throttle (``scontrol update
ArrayTaskThrottle``), oldest first, then to new arrays.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Group:
    """Cells waiting to be submitted that may share arrays: ``count`` of them, at most ``cap`` per array."""

    count: int
    cap: int


@dataclass(frozen=True, slots=True)
class LiveArray:
    """A submission of the sweep (an array, or a single job with throttle 1) that still holds ``live`` cells."""

    job: str
    throttle: int
    live: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One submission to make: ``size`` cells of group ``group`` as one array (a single job when 1), ``%throttle``."""

    group: int
    size: int
    throttle: int


@dataclass(frozen=True, slots=True)
class Plan:
    raises: list[tuple[str, int]]  # (array job id, new ArrayTaskThrottle) for live arrays
    chunks: list[Chunk]


def running_bound(live: list[LiveArray]) -> int:
    """The most of these submissions' cells that can run at once."""
    return sum(min(a.throttle, a.live) for a in live)


def plan(groups: list[Group], live: list[LiveArray], queue_room: int | None, max_parallel: int | None) -> Plan:
    """What to submit now, and which live arrays' throttles to raise (see the module's docstring)."""
    free = None if max_parallel is None else max(0, max_parallel - running_bound(live))
    raises = []
    if free is not None:
        for a in live:  # oldest first: they were submitted first, and their cells waited longest
            more = min(a.live - a.throttle, free)
            if more > 0:
                raises.append((a.job, a.throttle + more))
                free -= more
    room = queue_room
    chunks = []
    for index, group in enumerate(groups):
        left = group.count
        while left > 0 and (room is None or room > 0) and (free is None or free > 0):
            size = min(max(1, group.cap), left, *([room] if room is not None else []))
            throttle = size if free is None else min(size, free)
            chunks.append(Chunk(index, size, throttle))
            left -= size
            room = None if room is None else room - size
            free = None if free is None else free - throttle
    return Plan(raises, chunks)
