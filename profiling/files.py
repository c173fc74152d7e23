"""Crash-safe file writes: the one atomic write of the project (records, summaries, run folders, checkpoints' metadata),
and the one way a whole folder is put in place (run folders, checkpoints, exported models): filled under a hidden
name, then renamed.

It lives here, at the bottom of the import graph, because the in-job collectors need it and ``profiling`` imports
nothing from ``hpc_tools`` but the recipe's profiling section; ``hpc_tools.registry`` re-exports ``atomic_write``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


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


def replace_folder(new: Path, target: Path, aside: Path | None = None) -> None:
    """Put the complete folder ``new`` at ``target`` by renames (one file system): a reader finds the old folder or
    the new one (or, between two renames, none), never a mix of both. An existing ``target`` is renamed to ``aside``
    first (default: a hidden ``.<name>.replaced-<pid>`` beside it; one left by a kill between the renames is removed)
    and removed once the new folder is in place."""
    if not target.exists():
        os.rename(new, target)
        return
    aside = aside or target.with_name(f".{target.name}.replaced-{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)
    os.rename(target, aside)
    os.rename(new, target)
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(target: Path, prefix: str, replace: bool = False) -> Iterator[Path]:
    """An empty hidden folder beside ``target`` (its name starts with ``prefix``) to fill. When the block ends without
    an error it becomes ``target``: ``replace_folder`` with ``replace``, else a plain rename (which fails on a
    non-empty folder there); on an error it is removed and ``target`` is untouched."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield tmp
        if replace:
            replace_folder(tmp, target)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
