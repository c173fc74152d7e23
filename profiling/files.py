"""Crash-safe file writes: the one atomic write of the project (records, summaries, run folders, checkpoints' metadata).

It lives here, at the bottom of the import graph, because the in-job collectors need it and ``profiling`` imports
nothing from ``hpc_tools`` but the recipe's profiling section; ``hpc_tools.registry`` re-exports it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def current_umask() -> int:
    """This process's umask, read without changing it (Linux's /proc; else set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode(folder: Path) -> int:
    """The mode a new file in ``folder`` gets: the folder's read and write bits for its owner and group, read for
    others (never world-writable), under the umask. A run folder made 0755 holds 0644 files, 0750 -> 0640, 0700 ->
    0600 (``cluster.run_dir_mode``); elsewhere it is what ``open()`` would give under a usual umask."""
    try:
        bits = os.stat(folder).st_mode & 0o664
    except OSError:
        bits = 0o644
    return bits & ~current_umask()


def atomic_write(path: Path, text: str) -> None:
    """Write-then-rename, so readers see the old file or the new one, never half of one. The file gets
    ``file_mode`` of its folder (mkstemp alone would make it 0600: unreadable to a teammate sharing the run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, file_mode(path.parent))
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
