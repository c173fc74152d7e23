"""A rank's log and its console: library warnings and detail lines go to the rank's log file only, once each.

A rank's stdout is its log on Slurm (srun or submitit write it to a file) and, for the local executor, a pipe the
executor copies into ``logs/rank<R>.out`` and, for rank 0, onto the console of a foreground ``submit``. Library
warnings (Megatron's UserWarnings, torch's FutureWarnings, ...) are routed through ``logging.captureWarnings`` to
``py.warnings``, whose handler here writes each distinct warning once to the rank's log file (appending to the
executor's copy when stdout is that pipe) and never to the console; ``warnings_line`` then gives the one line the
console gets: ``9 library warnings in runs/.../logs/rank00000.out``. The collector's detailed per-window line (comm
bandwidth, pipeline wait) goes to the same file-only sink (``detail``), the console keeping the progress line.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path
from typing import IO

DETAIL_LOGGER = "hpc_tools.detail"  # profiling.collector.DETAIL_LOGGER names it too (profiling imports no hpc_tools)

FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"


class _Once(logging.Filter):
    """Drops a record whose text was already emitted (the same warning from another call site or step)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        # ``file:line: Category: message`` on one line (the quoted source line that follows it is dropped)
        text = (record.getMessage().strip().splitlines() or [""])[0]
        if text in self.seen:
            return False
        self.seen.add(text)
        record.msg, record.args = text, ()
        return True


class _Counting(logging.StreamHandler):
    def __init__(self, stream: IO[str]):
        super().__init__(stream)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        super().emit(record)


def stdout_file() -> Path | None:
    """The regular file this process's stdout writes to (Slurm's per-rank or batch log), else None (a pipe, a tty)."""
    try:
        if stat.S_ISREG(os.fstat(sys.stdout.fileno()).st_mode):
            return Path(os.readlink("/proc/self/fd/1"))
    except (OSError, ValueError, AttributeError):
        pass
    return None


def log_sink(run_dir: Path | None, rank: int) -> tuple[IO[str], Path | None, bool]:
    """(stream, its path, whether this process opened it) for lines meant for the rank's log file only.

    stdout when it is a file (that is the log); the local executor's ``logs/rank<R>.out`` when stdout is the
    executor's pipe (``HPC_TOOLS_EXECUTOR=local``: opened for appending beside the executor's copy); otherwise
    stdout (a test harness: nothing to keep off a console)."""
    path = stdout_file()
    if path is not None:
        return sys.stdout, path, False
    if run_dir is not None and os.environ.get("HPC_TOOLS_EXECUTOR") == "local":
        from hpc_tools.registry import RunFolder
        from hpc_tools.runstate import log_files

        files = log_files(RunFolder(run_dir), rank)
        if len(files) == 1 and files[0].is_file():
            return open(files[0], "a", buffering=1), files[0], True
    return sys.stdout, None, False


class RankLog:
    """The routing above for one rank process; ``close`` restores nothing (the process ends) but the file."""

    def __init__(self, run_dir: Path | None, rank: int):
        self.rank = rank
        self.stream, self.path, self._owned = log_sink(run_dir, rank)
        fmt = logging.Formatter(FORMAT.format(rank=rank), datefmt=DATEFMT)
        self.warnings = _Counting(self.stream)
        self.warnings.setFormatter(fmt)
        self.warnings.addFilter(_Once())
        logging.captureWarnings(True)
        py_warnings = logging.getLogger("py.warnings")
        py_warnings.handlers[:] = [self.warnings]
        py_warnings.propagate = False  # not to the root handler: stdout is the console of a foreground run
        detail = logging.getLogger(DETAIL_LOGGER)
        self.detail = logging.StreamHandler(self.stream)
        self.detail.setFormatter(fmt)
        detail.handlers[:] = [self.detail]
        detail.propagate = False
        detail.setLevel(logging.INFO)

    def warnings_line(self) -> str | None:
        """``N library warnings in FILE`` (None when there were none)."""
        n = self.warnings.count
        if not n:
            return None
        where = f" in {self.path}" if self.path is not None else ""
        return f"{n} library warning{'s' if n != 1 else ''}{where} (each once)"

    def close(self) -> None:
        for handler in (self.warnings, self.detail):
            handler.flush()
        if self._owned:
            self.stream.close()


def detail(msg: str, *args) -> None:
    """A line for the rank's log file only (see the module docstring)."""
    logging.getLogger(DETAIL_LOGGER).info(msg, *args)
