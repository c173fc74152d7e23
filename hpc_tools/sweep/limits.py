"""Slurm's limits on a sweep's submissions, read when the sweep submits cells.

- ``MaxArraySize`` (``scontrol show config``): an array's indices run 0..MaxArraySize-1, so an array holds at most
  MaxArraySize tasks (0 turns arrays off); ``SchedulerParameters=max_array_tasks=N`` caps the tasks of one array too.
- ``MaxSubmitJobs``: an association or QOS limit (every array task counts), kept by slurmdbd and enforced only when
  ``AccountingStorageEnforce`` holds ``limits`` (or ``safe``). Then it is read with ``sacctmgr`` (the user's
  associations and their QOS, the smallest of ``MaxSubmitJobs``/``GrpSubmitJobs``/``MaxSubmitJobsPerUser``);
  otherwise there is no such limit and it is taken as unbounded (``SlurmLimits.submit_note`` says which).
- ``MaxJobCount`` (``scontrol show config``): the jobs slurmctld holds at once, for everyone.

The room left in the queue counts the jobs in it now (``squeue -r``: one line per array task). Slurm's own commands
go through ``hpc_tools.slurm_client``, ``sacctmgr`` (accounting) too.
"""

from __future__ import annotations

import getpass
import os
import subprocess
from dataclasses import dataclass
from typing import Callable

from hpc_tools import slurm_client
from hpc_tools.slurm_client import show_config

Runner = Callable[..., subprocess.CompletedProcess]


@dataclass(frozen=True, slots=True)
class SlurmLimits:
    max_array_size: int
    max_array_tasks: int | None
    max_job_count: int | None
    max_submit_jobs: int | None  # None: not enforced here (submit_note says why)
    submit_note: str
    queued_user: int = 0
    queued_all: int = 0
    user: str = ""

    @property
    def array_tasks(self) -> int:
        """The most tasks one array may hold; 1: submit single jobs (arrays off)."""
        cap = self.max_array_size if self.max_array_tasks is None else min(self.max_array_size, self.max_array_tasks)
        return max(1, cap)

    @property
    def queue_limit(self) -> int | None:
        """The most jobs this user's sweep may have queued when nothing else of theirs is (None: unbounded)."""
        found = [v for v in (self.max_submit_jobs, self.max_job_count) if v is not None]
        return min(found) if found else None

    @property
    def queue_room(self) -> int | None:
        """How many more jobs this user may queue now."""
        room = []
        if self.max_submit_jobs is not None:
            room.append(self.max_submit_jobs - self.queued_user)
        if self.max_job_count is not None:
            room.append(self.max_job_count - self.queued_all)
        return max(0, min(room)) if room else None

    def describe(self) -> str:
        submit = f"MaxSubmitJobs {self.max_submit_jobs}" if self.max_submit_jobs is not None else self.submit_note
        tasks = f", max_array_tasks {self.max_array_tasks}" if self.max_array_tasks is not None else ""
        return (f"MaxArraySize {self.max_array_size}{tasks}, {submit}, MaxJobCount {self.max_job_count}; "
                f"queued now: {self.queued_user} of {self.user}'s, {self.queued_all} in all")

    def as_dict(self) -> dict:
        return {"max_array_size": self.max_array_size, "max_array_tasks": self.max_array_tasks,
                "max_job_count": self.max_job_count, "max_submit_jobs": self.max_submit_jobs,
                "submit_note": self.submit_note, "queued_user": self.queued_user, "queued_all": self.queued_all,
                "array_tasks": self.array_tasks, "queue_room": self.queue_room}


def _int(value: str | None) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None


def config_limits(config: dict[str, str]) -> tuple[int, int | None, int | None]:
    """(MaxArraySize, max_array_tasks, MaxJobCount) from ``scontrol show config``'s mapping (Slurm's defaults 1001,
    none, 10000 where a key is missing)."""
    array = _int(config.get("MaxArraySize"))
    tasks = None
    for part in (config.get("SchedulerParameters") or "").split(","):
        key, _, value = part.partition("=")
        if key.strip() == "max_array_tasks":
            tasks = _int(value)
    jobs = _int(config.get("MaxJobCount"))
    return (1001 if array is None else array), tasks, (10000 if jobs is None else jobs)


def enforces_limits(config: dict[str, str]) -> bool:
    """Whether slurmctld enforces association/QOS limits (slurmdbd accounting with ``limits`` or ``safe``)."""
    if "slurmdbd" not in (config.get("AccountingStorageType") or ""):
        return False
    enforce = {p.strip().lower() for p in (config.get("AccountingStorageEnforce") or "").split(",")}
    return bool(enforce & {"limits", "safe"})


def submit_limit(assoc: str, qos: str) -> int | None:
    """The smallest submit limit in ``sacctmgr -nP`` output: ``assoc`` rows ``MaxSubmit|GrpSubmit|QOS`` (QOS
    comma-joined), ``qos`` rows ``Name|MaxSubmitPU|GrpSubmit``; None when no row sets one."""
    found, names = [], set()
    for line in assoc.splitlines():
        cols = line.split("|")
        if len(cols) >= 3:
            found += [v for v in map(_int, cols[:2]) if v is not None]
            names |= {q.strip() for q in cols[2].split(",") if q.strip()}
    for line in qos.splitlines():
        cols = line.split("|")
        if len(cols) >= 3 and cols[0].strip() in names:
            found += [v for v in map(_int, cols[1:3]) if v is not None]
    return min(found) if found else None


def _sacctmgr(args: list[str], run: Runner) -> str:
    answer = slurm_client.call(["sacctmgr", "-nP", *args], run=run)
    if not answer.ok:
        raise answer.error(f"sacctmgr {' '.join(args[:2])}", "the sweep needs the user's MaxSubmitJobs, which this "
                           "cluster enforces (AccountingStorageEnforce)")
    return answer.out


def queued(user: str, run: Runner) -> tuple[int, int]:
    """(this user's jobs, all jobs) in Slurm's queue now, one per array task."""
    out = slurm_client.call(["squeue", "-h", "-r", "-o", "%u"], run=run).check("squeue (the jobs queued now)")
    users = [u.strip() for u in out.splitlines() if u.strip()]
    return sum(u == user for u in users), len(users)


def read_limits(run: Runner = subprocess.run) -> SlurmLimits:
    """The limits as Slurm states them now (``run``: the command runner)."""
    config = show_config(run)
    array, tasks, jobs = config_limits(config)
    user = os.environ.get("USER") or getpass.getuser()
    if enforces_limits(config):
        assoc = _sacctmgr(["show", "assoc", f"where user={user}", "format=MaxSubmit,GrpSubmit,QOS"], run)
        qos = _sacctmgr(["show", "qos", "format=Name,MaxSubmitPU,GrpSubmit"], run)
        submit = submit_limit(assoc, qos)
        note = "MaxSubmitJobs unset for the user's associations and QOS" if submit is None else "sacctmgr"
    else:
        submit = None
        note = (f"MaxSubmitJobs not enforced (AccountingStorageEnforce={config.get('AccountingStorageEnforce')}): "
                "taken as unbounded")
    mine, everyone = queued(user, run)
    return SlurmLimits(array, tasks, jobs, submit, note, mine, everyone, user)


def refusal(limits: SlurmLimits) -> str | None:
    """Why no cell of a sweep can ever be submitted under these limits, or None."""
    if limits.max_submit_jobs is not None and limits.max_submit_jobs <= 0:
        return (f"Slurm lets user {limits.user} queue no jobs (MaxSubmitJobs={limits.max_submit_jobs} in the "
                "association or QOS): ask the cluster's administrators for a limit, or run with --executor local")
    if limits.max_job_count is not None and limits.max_job_count <= 0:
        return f"Slurm's MaxJobCount is {limits.max_job_count}: this cluster accepts no jobs"
    return None


def raise_throttle(job: str, throttle: int, run: Runner = subprocess.run) -> str | None:
    """``scontrol update JobId=JOB ArrayTaskThrottle=N``: None when Slurm took it, else what it said."""
    answer = slurm_client.call(["scontrol", "update", f"JobId={job}", f"ArrayTaskThrottle={throttle}"], run=run)
    return None if answer.ok else answer.said
