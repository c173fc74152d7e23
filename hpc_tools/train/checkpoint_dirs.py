"""Checkpoint folder conventions shared by the Megatron and DeepSpeed trainers.

Layout of a checkpoint root (``ctx.checkpoint_dir``)::

    iter_0000010/             a complete checkpoint (only ever appears by an atomic rename)
        hpc_tools_meta.json   step, time and whatever the trainer records (written last, before the rename)
        ...                   the backend's own files
    iter_0000020.partial/     a save in progress, or one interrupted by a kill: never read, removed on the next save
    latest                    the name of the newest complete folder, one line (DeepSpeed reads the same file format)

Protocol of one save, the same on every backend (``rank0`` = global rank 0; the others wait on barriers)::

    path = dirs.begin(step)              # rank 0: clear a stale partial folder, create it, return it
    barrier()
    ...every rank writes into path...    # e.g. dist_checkpointing.save(..., path), engine.save_checkpoint(...)
    barrier()
    dirs.commit(step, meta={...})        # rank 0: meta file, fsync, rename to iter_N, write `latest`, prune
    barrier()

So a kill at any moment leaves either the previous checkpoints untouched or the new one complete. Resuming reads
``dirs.newest()``: the ``latest`` pointer when it names a complete folder, else the highest complete ``iter_N``;
``resume_source`` decides which checkpoint a run starts from (its own newest, else ``checkpoint.load_path``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from hpc_tools.errors import UserError
from hpc_tools.registry import atomic_write

PREFIX = "iter_"
PARTIAL_SUFFIX = ".partial"
LATEST = "latest"
META = "hpc_tools_meta.json"
_NAME_RE = re.compile(rf"^{PREFIX}(\d{{7,}})$")


def dir_name(step: int) -> str:
    """``10`` -> ``iter_0000010`` (Megatron-LM's naming; sorts by step up to 10 million steps)."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"{PREFIX}{step:07d}"


def parse_step(name: str) -> int | None:
    """The step of a complete checkpoint folder name, or None for anything else (partial folders included)."""
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def _fsync_dir(path: Path) -> None:
    # A rename is durable only once its directory entry is flushed.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class CheckpointDirs:
    """The checkpoint folders under one root. Methods that change the folder are for global rank 0 only."""

    def __init__(self, root: str | Path, keep_last: int = 2):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    # -- paths ---------------------------------------------------------------------------------------------------------
    def final_path(self, step: int) -> Path:
        return self.root / dir_name(step)

    def partial_path(self, step: int) -> Path:
        return self.root / (dir_name(step) + PARTIAL_SUFFIX)

    # -- reading (any rank) --------------------------------------------------------------------------------------------
    def is_complete(self, path: Path) -> bool:
        """A folder named ``iter_N`` holding the meta file (a rename makes it visible only once the meta is written)."""
        return path.is_dir() and parse_step(path.name) is not None and (path / META).is_file()

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest first."""
        if not self.root.is_dir():
            return []
        found = [(parse_step(p.name), p) for p in self.root.iterdir() if self.is_complete(p)]
        return sorted(found)  # type: ignore[arg-type]

    def read_latest(self) -> Path | None:
        """The folder the ``latest`` pointer names, when it exists and is complete."""
        try:
            name = (self.root / LATEST).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        path = self.root / name
        return path if name and "/" not in name and self.is_complete(path) else None

    def newest(self) -> Path | None:
        """The checkpoint to resume from: the newest complete folder (the pointer is a hint, the folders decide)."""
        done = self.complete()
        pointed = self.read_latest()
        if pointed is not None and (not done or parse_step(pointed.name) >= done[-1][0]):
            return pointed
        return done[-1][1] if done else None

    def newest_step(self) -> int | None:
        path = self.newest()
        return None if path is None else parse_step(path.name)

    def has(self, step: int) -> bool:
        return self.is_complete(self.final_path(step))

    @staticmethod
    def read_meta(path: str | Path) -> dict[str, Any]:
        """The meta record a complete checkpoint folder was committed with."""
        return json.loads((Path(path) / META).read_text())

    # -- writing (global rank 0) ---------------------------------------------------------------------------------------
    def begin(self, step: int) -> Path:
        """Create an empty partial folder for ``step`` (removing a stale one left by a killed save); returns it."""
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self.partial_path(step)
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
        return partial

    def commit(self, step: int, meta: dict[str, Any] | None = None) -> Path:
        """Make the partial folder of ``step`` the complete ``iter_N``, point ``latest`` at it, prune old ones."""
        partial, final = self.partial_path(step), self.final_path(step)
        if not partial.is_dir():
            raise FileNotFoundError(f"no save in progress at {partial} (call begin({step}) first)")
        record = {"step": step, "saved_unix": time.time(), **(meta or {})}
        atomic_write(partial / META, json.dumps(record, indent=2, sort_keys=True))
        _fsync_dir(partial)
        if final.exists():  # the same step saved again (e.g. an interval save followed by a stop signal)
            old = self.root / (final.name + ".replaced")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(partial, final)
        _fsync_dir(self.root)
        atomic_write(self.root / LATEST, final.name + "\n")
        self.prune()
        return final

    def prune(self) -> list[Path]:
        """Delete all but the ``keep_last`` newest complete checkpoints, and stale partial folders of older steps."""
        done = self.complete()
        removed = [p for _, p in done[: max(len(done) - self.keep_last, 0)]]
        newest = done[-1][0] if done else None
        for p in self.root.iterdir() if self.root.is_dir() else ():
            if p.name.endswith(PARTIAL_SUFFIX) and newest is not None:
                step = parse_step(p.name[: -len(PARTIAL_SUFFIX)])
                if step is not None and step <= newest:
                    removed.append(p)
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed


def resume_source(dirs: CheckpointDirs, *, resume: bool, load_path: str | None) -> Path | None:
    """The checkpoint a run starts from, or None for a fresh start.

    With ``resume`` (checkpoint.resume) the newest complete checkpoint under ``dirs`` (the run's own, after a stop or
    a requeue); failing that ``load_path`` (checkpoint.load_path): a complete ``iter_N`` folder, or a folder of them
    (its newest). A ``load_path`` that holds no complete checkpoint is a user error.
    """
    source = dirs.newest() if resume else None
    if source is not None or not load_path:
        return source
    given = Path(load_path).expanduser()
    if CheckpointDirs(given.parent).is_complete(given):
        return given
    newest = CheckpointDirs(given).newest()
    if newest is None:
        raise UserError(f"checkpoint.load_path={load_path} holds no complete checkpoint (give an iter_N folder "
                        "written by hpc_tools, or the folder holding them)")
    return newest
