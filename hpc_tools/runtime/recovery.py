"""The rank's side of an in-job restart's record: rank 0 of a new start fills in the restart it follows (the
manifest's ``restarts`` entry that ``hpc_tools.job.restarts`` wrote) once its first step completes, and adds the
goodput's ``recovery`` event."""

from __future__ import annotations

import time

from hpc_tools.registry import RunFolder


def first_step(run: RunFolder, start: int, step: int) -> None:
    """Rank 0 of start ``start`` completed its first step ``step``: fill in the restart's ``from_iteration`` and
    ``time_to_first_step_s`` (seconds from the fault's record to now)."""
    from datetime import datetime, timezone

    manifest = run.manifest()
    restarts = manifest.get("restarts") or []
    # the newest restart or requeue, filled by the first start after it (a refused restart, kind "stop", starts none)
    entry = restarts[-1] if restarts and restarts[-1].get("kind") != "stop" else None
    if entry is None or entry.get("time_to_first_step_s") is not None or int(entry.get("restart") or 0) > start:
        return
    try:
        at = datetime.fromisoformat(entry["at"])
        entry["time_to_first_step_s"] = round((datetime.now(timezone.utc) - at).total_seconds(), 1)
    except (KeyError, TypeError, ValueError):
        pass
    entry["from_iteration"] = step - 1
    run.update(restarts=restarts, soft=True)
    if entry.get("time_to_first_step_s") is not None:
        recovery_event(run, start, step, entry["time_to_first_step_s"])


def recovery_event(run: RunFolder, start: int, step: int, seconds: float) -> None:
    """The goodput's ``recovery`` bucket (``profiling.goodput``): an event ``recovery`` in rank 0's events file, tagged
    with the new start, taking the seconds from the fault to its first step. Appended as one line (the collector
    appends its own events to the same file, line by line)."""
    import contextlib
    import json

    from profiling.records import events_path

    row = {"event": "recovery", "time": time.time(), "seconds": seconds, "step": step, "rank": 0, "restart": start}
    with contextlib.suppress(OSError):
        run.records_dir.mkdir(parents=True, exist_ok=True)
        with open(events_path(run.records_dir, 0), "a") as f:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
