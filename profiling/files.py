"""Crash-safe file writes: the one atomic write of the project (records, summaries, run folders, checkpoints' metadata).

It lives here, at the bottom of the import graph, because the in-job collectors need it and ``profiling`` imports
nothing from ``hpc_tools`` but the recipe's profiling section; ``hpc_tools.registry`` re-exports it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, text: str) -> None:
    """Write-then-rename, so readers see the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
