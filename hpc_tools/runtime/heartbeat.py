"""Per-rank heartbeats: what every rank last did, on disk, for the hang watchdog and the batch script's epilogue.

Each rank keeps ``heartbeats/rank<R>.json`` in the run folder, rewritten about once a second by its watchdog thread
(and once more when the rank exits): rank, node, pid, this start's number (``restart``), the last completed step, the
innermost frame of the main thread and, when that thread is inside a collective, which one (``collective``). A rank
that stops (SIGSTOP, a dead node) stops refreshing its file; a rank that exits through Python records how
(``exit``: code and error); a rank killed by a signal records nothing more, and srun says which signal.

Reading the main thread's frames from another thread is what ``faulthandler`` does too: no cooperation is needed
from the training loop, and a rank stuck in compute is told from one waiting in a collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DIR = "heartbeats"
INTERVAL_S = 1.0
# Source files whose frames mean "waiting for the other ranks": torch.distributed's collectives, the pipeline and
# DeepSpeed communication wrappers built on them, and the communication collector's timing wrapper (profiling).
COLLECTIVE_FILES = ("torch/distributed/", "pipeline_parallel/p2p_communication", "deepspeed/comm/",
                    "profiling/comm.py")
WRAPPER_NAMES = ("wrapper", "inner", "wrapped", "_fn")  # decorators' frames: not the collective's or caller's name


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / DIR / f"rank{rank:05d}.json"


def node_name() -> str:
    """The Slurm node name of this rank (what ``srun`` and ``sinfo`` print), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclass
class Beat:
    """One rank's heartbeat record."""

    rank: int
    node: str
    pid: int
    restart: int = 0
    step: int = 0  # the last completed step (0: none yet)
    time: float = 0.0  # wall clock of the write (epoch seconds): comparable across nodes
    frame: str = ""  # innermost frame of the main thread: "file.py:123 in func"
    collective: str | None = None  # "all_reduce (from agree_stop)" while the main thread waits in one
    # {"code", "error", "time"} once the rank exited through Python; for an exception also what the restart controller
    # classifies it by: "types", "where", "step", "started", "knobs" (hpc_tools.runtime.rank.exception_record)
    exit: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Beat":
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def describe_frames(frame) -> tuple[str, str | None]:
    """(innermost frame as "file.py:line in func", the collective it waits in or None) for a thread's top frame.

    The collective is the innermost frame from a communication file (``COLLECTIVE_FILES``), named with the first
    caller outside them (``all_reduce (from agree_stop)``).
    """
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    if not stack:
        return "", None
    top = stack[0]
    where = f"{Path(top.f_code.co_filename).name}:{top.f_lineno} in {top.f_code.co_name}"
    for i, f in enumerate(stack):
        name = f.f_code.co_filename.replace(os.sep, "/")
        if any(part in name for part in COLLECTIVE_FILES) and f.f_code.co_name not in WRAPPER_NAMES:
            caller = next((c.f_code.co_name for c in stack[i + 1:] if c.f_code.co_name not in WRAPPER_NAMES and
                           not any(part in c.f_code.co_filename.replace(os.sep, "/") for part in COLLECTIVE_FILES)),
                          None)
            return where, f.f_code.co_name + (f" (from {caller})" if caller else "")
    return where, None


def main_thread_frames() -> tuple[str, str | None]:
    """``describe_frames`` of this process's main thread (the training loop)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return describe_frames(frame)


def write(run_dir: Path, beat: Beat) -> None:
    """Write ``beat`` atomically; a full or read-only disk loses the beat, never the rank."""
    from profiling.files import atomic_write

    beat.time = time.time()
    with contextlib.suppress(OSError):
        atomic_write(heartbeat_path(run_dir, beat.rank), json.dumps(asdict(beat)))


def read_all(run_dir: Path, restart: int | None = None) -> dict[int, Beat]:
    """rank -> its heartbeat, for the ranks of start ``restart`` (every start when None)."""
    beats = {}
    folder = Path(run_dir) / DIR
    if not folder.is_dir():
        return beats
    for path in sorted(folder.glob("rank*.json")):
        try:
            beat = Beat.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if restart is None or beat.restart == restart:
            # the rank's step records are written line by line, every step: more recent than a heartbeat
            beat.step = max(beat.step, recorded_step(run_dir, beat.rank) or 0)
            beats[beat.rank] = beat
    return beats


def recorded_step(run_dir: Path, rank: int) -> int | None:
    """The last step rank ``rank`` wrote to its step records (the tail of ``records/rank<R>.jsonl``), or None."""
    from profiling.records import jsonl_path

    try:
        with open(jsonl_path(Path(run_dir) / "records", rank), "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - 8192, 0))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def ranks_text(ranks: list[int]) -> str:
    """"rank 2" or "ranks 0,1,3"."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(str(r) for r in sorted(ranks))
