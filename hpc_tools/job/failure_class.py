"""Failure classes for in-job restarts: what a restart can fix and what it cannot (docs/fault-tolerance.md).

``classify`` reads what the ended step left (the culprit from ``hpc_tools.job.restarts.culprit``, the culprit
rank's exit record in its heartbeat, srun's signal, the kernel OOM killer's note in the batch log) and the run's
earlier ``restarts`` entries, and returns the class, the decision and one line why. The rules, first match wins:

1. **oom**: the exception is an out-of-memory error (``torch.OutOfMemoryError``, ``MemoryError``, "CUDA out of
   memory"), or the kernel's OOM killer ended the step (slurmstepd's ``oom_kill`` note). Stop, with a fix line.
2. **infrastructure**: the rank's node was lost, the rank was killed by a signal or ended without an exit record,
   the hang watchdog named it, or its exception is a communication error (NCCL, gloo, the rendezvous store, a
   connection closed or reset). Restart, leaving the node out when a spare can take its place. A ``strict``
   preflight failure (``PreflightFailed``) is infrastructure too, but stops: it names the node, and the rank program
   raises it only when nothing could replace that node (a replaceable node ends the step through
   ``hpc_tools.runtime.preflight.leave_out``, which the controller handles before classifying).
3. **user error**: a Python exception that is none of the above, except the operating system's (2 below). A
   deterministic program raises it again from the same checkpoint, so it stops at once with the traceback's last
   line. An operating-system error (``OSError`` other than a missing or forbidden path) raised again with the same
   type and message at the same step as the previous start's failure is a user error too: it recurs.
4. **transient**: the rest (an operating-system error seen once, a rank that exited non-zero without a Python
   error). Restart.

The **no-progress guard**: a restart is refused when the last two in-job restarts both resumed from the same
checkpoint iteration (a third fault before any newer checkpoint was written).

Standard library only: the controller runs on the batch host, outside the job's container.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

USER, OOM, INFRA, TRANSIENT = "user error", "oom", "infrastructure", "transient"
STOP, RESTART = "stop", "restart"

OOM_TYPES = {"OutOfMemoryError", "MemoryError"}
OOM_TEXT = re.compile(r"CUDA out of memory|out of memory|HIP out of memory|CUBLAS_STATUS_ALLOC_FAILED", re.I)
KERNEL_OOM = re.compile(r"oom[_-]kill|OOM Killed|Out of memory: Killed process", re.I)
COMM_TYPES = {"DistBackendError", "DistNetworkError", "DistStoreError", "ConnectionError", "BrokenPipeError",
              "ConnectionResetError", "ConnectionAbortedError", "ConnectionRefusedError", "TimeoutError"}
COMM_TEXT = re.compile(r"NCCL (error|WARN)|nccl\w*Error|ProcessGroupNCCL|ProcessGroupGloo|\[gloo|gloo/transport|"
                       r"Connection (closed|reset|refused)|Broken pipe|Socket Timeout|TCPStore|"
                       r"Timed out waiting|Watchdog caught collective|NCCL communicator|remote process exited|"
                       r"unhandled system error|Read error \[|Write error \[", re.I)
PATH_ERRORS = {"FileNotFoundError", "PermissionError", "IsADirectoryError", "NotADirectoryError",
               "FileExistsError"}  # the recipe named a path that is wrong: it fails again
INFRA_CAUSES = {"hang": "the hang watchdog named it", "node failure": "its node was lost",
                "killed": "it was killed by a signal", "lost": "it ended without an exit record"}


@dataclass(frozen=True)
class Verdict:
    cls: str
    decision: str
    why: str  # one line: the evidence
    fix: str | None = None  # the change to make (oom)


def exception_types(record: dict | None) -> list[str]:
    """The exception's class and its bases (the rank records them), or the type the error line names."""
    if not record:
        return []
    if record.get("types"):
        return list(record["types"])
    error = record.get("error") or ""
    head = error.split(":", 1)[0].strip()
    return [head] if error and head.isidentifier() else []


def last_line(record: dict) -> str:
    """"ValueError: boom at step 5 (model.py:12 in forward)": the traceback's last line, its step and frame."""
    error = (record.get("error") or "").strip().splitlines()
    text = error[0] if error else "an exception"
    step = record.get("step")
    where = f" ({record['where']})" if record.get("where") else ""
    return f"{text[:300]}" + (f" after step {step}" if step is not None else "") + where


def signature(record: dict | None) -> dict | None:
    """What makes two failures "the same": the exception's type, message (its first line) and step."""
    if not record or not exception_types(record):
        return None
    error = (record.get("error") or "").strip().splitlines()
    return {"error": error[0][:300] if error else "", "step": record.get("step")}


def oom_fix(record: dict | None) -> str:
    """The knobs that lower the peak: half the micro batch, full recomputation (the rank records their values)."""
    knobs = (record or {}).get("knobs") or {}
    if not knobs:  # the kernel's OOM killer left no exit record: the values are not known here
        return ("try a smaller --set training.micro_batch_size=N or --set training.recompute_granularity=full; "
                "`python -m hpc_tools plan RECIPE --search` finds a layout that fits")
    sets = []
    mbs = knobs.get("training.micro_batch_size")
    if isinstance(mbs, int) and mbs > 1:
        sets.append(f"--set training.micro_batch_size={mbs // 2}")
    if knobs.get("training.recompute_granularity") != "full":
        sets.append("--set training.recompute_granularity=full")
    first = " or ".join(sets) if sets else "more tensor/pipeline parallelism or more nodes"
    return f"try {first}; `python -m hpc_tools plan RECIPE --search` finds a layout that fits"


def classify(cause: str, record: dict | None, previous: list[dict], kernel_oom: bool = False) -> Verdict:
    """The class of a failed step (module docstring): ``cause`` is the culprit's cause, ``record`` its rank's exit
    record (``exit`` of its heartbeat) or None, ``previous`` the run's earlier ``restarts`` entries."""
    types = set(exception_types(record))
    error = (record or {}).get("error") or ""
    if types & OOM_TYPES or (types and OOM_TEXT.search(error)) or kernel_oom:
        why = last_line(record) if types else "the kernel's OOM killer ended a rank (slurmstepd: oom_kill)"
        return Verdict(OOM, STOP, why, oom_fix(record))
    if "PreflightFailed" in types:  # strict preflight named a node nothing could replace (or a job-level problem)
        return Verdict(INFRA, STOP, error.strip().splitlines()[0][:600] if error.strip() else "preflight failed")
    if cause in INFRA_CAUSES:
        return Verdict(INFRA, RESTART, INFRA_CAUSES[cause])
    if types & COMM_TYPES or (types and COMM_TEXT.search(error)):
        return Verdict(INFRA, RESTART, f"a communication error: {last_line(record)}")
    if types and ("OSError" not in types or types & PATH_ERRORS):
        return Verdict(USER, STOP, last_line(record))
    if types:
        same = signature(record)
        before = next((e for e in reversed(previous) if e.get("kind", "in-job") == "in-job"), None)
        if before is not None and same is not None and before.get("signature") == same:
            return Verdict(USER, STOP, f"{last_line(record)}, as in the start before")
        return Verdict(TRANSIENT, RESTART, f"an operating-system error: {last_line(record)}")
    return Verdict(TRANSIENT, RESTART, f"the rank {cause} without a Python error")


def no_progress(previous: list[dict]) -> int | None:
    """The checkpoint iteration the last two in-job restarts both resumed from (the guard stops), else None."""
    # a step preflight ended to leave a node out was no fault from its checkpoint
    done = [e for e in previous if e.get("kind", "in-job") == "in-job" and e.get("cause") != "preflight"]
    if len(done) < 2:
        return None
    a, b = done[-2].get("from_iteration"), done[-1].get("from_iteration")
    return a if a is not None and a == b else None
