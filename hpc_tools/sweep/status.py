"""Per-cell status from every source that knows something: sacct, the run manifest, HANG markers and the logs.

Statuses: pending, running, completed, failed, out_of_memory, timeout, hang, node_failure, cancelled.
When sources disagree, a terminal verdict beats a live one (sacct may still say RUNNING while the manifest says
COMPLETED, or the manifest may say RUNNING for a rank that was killed), and among terminal verdicts the most
specific one wins (a hang marker explains a FAILED exit; an OOM in the log explains a FAILED state).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Iterable

from hpc_tools.runtime.watchdog import HANG_EXIT_CODE

STATUSES = ("pending", "running", "completed", "failed", "out_of_memory", "timeout", "hang", "node_failure",
            "cancelled")
LIVE = ("pending", "running")
# Most specific first: the first terminal verdict found in this order wins.
SPECIFICITY = ("hang", "out_of_memory", "node_failure", "timeout", "cancelled", "failed", "completed")
RERUN_DEFAULT = ("failed", "out_of_memory", "timeout", "hang", "node_failure")

SACCT = {
    "PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending", "REQUEUE_FED": "pending",
    "REQUEUE_HOLD": "pending", "RESV_DEL_HOLD": "pending", "PREEMPTED": "pending",
    "RUNNING": "running", "COMPLETING": "running", "SUSPENDED": "running", "RESIZING": "running",
    "STAGE_OUT": "running", "SIGNALING": "running",
    "COMPLETED": "completed", "FAILED": "failed", "OUT_OF_MEMORY": "out_of_memory", "TIMEOUT": "timeout",
    "DEADLINE": "timeout", "NODE_FAIL": "node_failure", "BOOT_FAIL": "node_failure", "CANCELLED": "cancelled",
    "REVOKED": "cancelled", "SPECIAL_EXIT": "failed",
}
MANIFEST = {
    "CREATED": "pending", "PENDING": "pending", "SUBMITTED": "pending", "REQUEUED": "pending",
    "RUNNING": "running", "LAUNCHED": "running",
    "COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "timeout",
    "OUT_OF_MEMORY": "out_of_memory", "NODE_FAIL": "node_failure", "HANG": "hang", "PREEMPTED": "cancelled",
}
LOG_PATTERNS = (
    ("out_of_memory", re.compile(r"CUDA out of memory|OutOfMemoryError|out-of-memory|oom[-_]kill|Out Of Memory|"
                                 r"\bMemoryError\b", re.I)),
    ("timeout", re.compile(r"DUE TO TIME LIMIT")),
    ("node_failure", re.compile(r"DUE TO NODE FAILURE|NODE_FAIL")),
    ("cancelled", re.compile(r"CANCELLED AT")),
)
LOG_TAIL_BYTES = 64 * 1024


def from_sacct(state: str | None, exit_code: str | None = None) -> str | None:
    """sacct's State (e.g. ``CANCELLED by 0``) -> a status; exit code 86 (the hang watchdog) -> hang."""
    if not state:
        return None
    code = (exit_code or "").split(":")[0]
    if code == str(HANG_EXIT_CODE):
        return "hang"
    return SACCT.get(state.split()[0].rstrip("+"), None)


def from_manifest(manifest: dict | None) -> str | None:
    if not manifest:
        return None
    if manifest.get("exit_code") == HANG_EXIT_CODE:
        return "hang"
    return MANIFEST.get(str(manifest.get("state", "")).upper())


def from_logs(paths: Iterable[Path]) -> str | None:
    """The most specific failure the tail of any log names, or None."""
    found = set()
    for path in paths:
        try:
            with open(path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(f.tell() - LOG_TAIL_BYTES, 0))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        # "CANCELLED AT ... DUE TO TIME LIMIT" is a timeout: patterns are tried most specific first.
        for status, pattern in LOG_PATTERNS:
            if pattern.search(text):
                found.add(status)
                break
    return next((s for s in SPECIFICITY if s in found), None)


def combine(*verdicts: str | None, hang: bool = False) -> str:
    """One status from several sources' verdicts (None = that source knows nothing)."""
    if hang:
        return "hang"
    known = [v for v in verdicts if v]
    terminal = [v for v in known if v not in LIVE]
    if terminal:
        return next(s for s in SPECIFICITY if s in terminal)
    if "running" in known:
        return "running"
    return "pending"


def refine_failure(status: str, log_verdict: str | None) -> str:
    """A plain `failed` (or `cancelled` by srun after a rank died) is explained by a more specific log verdict."""
    if status in ("failed", "cancelled") and log_verdict in ("out_of_memory", "node_failure", "timeout"):
        return log_verdict
    return status


def sacct_states(job_ids: list[str], timeout_s: float = 20.0) -> dict[str, tuple[str, str]]:
    """job id -> (State, ExitCode) for many jobs in one sacct call; {} when sacct is absent or refuses.

    Pending array tasks are listed by sacct as ``123_[4-7]``; they are expanded so that ``123_5`` is found.
    """
    ids = sorted({str(j) for j in job_ids if j})
    if not ids:
        return {}
    try:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", ",".join(ids)],
                             capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    return parse_sacct(out.stdout)


def parse_sacct(text: str) -> dict[str, tuple[str, str]]:
    states: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0]:
            continue
        job, state, code = parts[0], parts[1], parts[2]
        m = re.match(r"^(\d+)_\[(.+)\]$", job)
        if m:
            for task in _expand_ranges(m.group(2).split("%")[0]):
                states.setdefault(f"{m.group(1)}_{task}", (state, code))
        else:
            states[job] = (state, code)
    return states


def _expand_ranges(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        elif part.isdigit():
            out.append(int(part))
    return out
