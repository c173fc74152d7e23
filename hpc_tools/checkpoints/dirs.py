"""Checkpoint folder conventions shared by every backend.

Layout of a checkpoint root (``ctx.checkpoint_dir``)::

    iter_0000010/             a complete checkpoint (only ever appears by an atomic rename)
        hpc_tools_meta.json   step, time, every rank's list of the files it saved (size, checksum) and whatever the
                              trainer records (written last, before the rename)
        ...                   the backend's own files
    iter_0000020.partial/     a save in progress, or one interrupted by a kill: never read, removed on the next save
    iter_0000030.bad-size/    a checkpoint that failed verification, set aside (never deleted); its
                              SET_ASIDE.txt names the file and the reason
    latest                    the name of the newest complete folder, one line (DeepSpeed reads the same file format)
    verified                  the name of the newest folder a resume verified and loaded: never pruned

A save goes through ``begin`` (the partial folder), the ranks' writes and ``commit`` (meta file, fsync, rename to
``iter_N``, ``latest``, prune): the one sequence, the same for every backend, is the saver's
(``hpc_tools.train.checkpointing.saver``: begin, barrier, write, barrier, gather every rank's file list, commit).

So a kill at any moment leaves either the previous checkpoints untouched or the new one complete. A folder is
complete only when its meta file holds every rank's file list. Resuming reads ``dirs.newest()``: the ``latest``
pointer when it names a complete folder, else the highest complete ``iter_N``; ``resume_source`` decides which
checkpoint a run starts from (its own newest, else ``checkpoint.load_path``), skipping the ones a failed
verification excluded; ``hpc_tools.train.checkpointing.resume`` verifies, loads and falls back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Collection, Sequence

from hpc_tools.errors import UserError
from hpc_tools.registry import atomic_write
from profiling.files import replace_folder

PREFIX = "iter_"
PARTIAL_SUFFIX = ".partial"
BAD_SUFFIX = ".bad-"
SET_ASIDE_NOTE = "SET_ASIDE.txt"
LATEST = "latest"
VERIFIED = "verified"
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
        """A folder named ``iter_N`` whose meta file holds every rank's file list (the rename makes it visible only
        once the meta is written)."""
        return self.incomplete_reason(path) is None

    @staticmethod
    def incomplete_reason(path: Path) -> str | None:
        """Why ``path`` is not a complete checkpoint folder, or None when it is one."""
        if parse_step(path.name) is None or not path.is_dir():
            return "not an iter_N folder"
        try:
            meta = json.loads((path / META).read_text())
        except FileNotFoundError:
            return f"no {META}"
        except (OSError, ValueError) as e:
            return f"{META} unreadable ({e})"
        files = meta.get("files") if isinstance(meta, dict) else None
        if not isinstance(files, dict) or not isinstance(files.get("by_rank"), dict):
            return f"{META} holds no file lists (saved by an hpc_tools without checkpoint verification)"
        want = {str(r) for r in range(int(files.get("world_size") or 0))}
        missing = sorted(want - set(files["by_rank"]), key=int)
        if not want or missing:
            return f"{META} lacks the file lists of ranks {missing}"
        return None

    def incomplete(self) -> list[tuple[Path, str]]:
        """``iter_N`` folders that are not complete, with the reason (for the resume log)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in sorted(self.root.iterdir()):
            if parse_step(p.name) is not None:
                reason = self.incomplete_reason(p)
                if reason is not None:
                    out.append((p, reason))
        return out

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest first."""
        if not self.root.is_dir():
            return []
        found = [(parse_step(p.name), p) for p in self.root.iterdir() if self.is_complete(p)]
        return sorted(found)  # type: ignore[arg-type]

    def read_latest(self) -> Path | None:
        """The folder the ``latest`` pointer names, when it exists and is complete."""
        return self._pointed(LATEST)

    def _pointed(self, pointer: str) -> Path | None:
        """The checkpoint folder of this root that the pointer file ``pointer`` names, while it is complete."""
        try:
            name = (self.root / pointer).read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        path = self.root / name
        return path if name and "/" not in name and self.is_complete(path) else None

    def newest(self, skip: Collection[Path] = ()) -> Path | None:
        """The checkpoint to resume from: the newest complete folder not in ``skip`` (the pointer is a hint, the
        folders decide)."""
        done = [(s, p) for s, p in self.complete() if p not in skip]
        pointed = self.read_latest()
        if pointed is not None and pointed not in skip and (not done or parse_step(pointed.name) >= done[-1][0]):
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

    def commit(self, step: int, meta: dict[str, Any] | None = None, files: dict[str, Any] | None = None) -> Path:
        """Make the partial folder of ``step`` the complete ``iter_N``, point ``latest`` at it, prune old ones.

        ``files`` is every rank's file list (``hpc_tools.train.checkpointing.agree.gather_records``); without it (one
        process, e.g. a test) this process records every file of the folder as rank 0 of 1."""
        partial, final = self.partial_path(step), self.final_path(step)
        if not partial.is_dir():
            raise FileNotFoundError(f"no save in progress at {partial} (call begin({step}) first)")
        if files is None:
            from hpc_tools.checkpoints.verify import ALGORITHM, record_share

            files = {"algorithm": ALGORITHM, "world_size": 1,
                     "by_rank": {"0": record_share(partial, 0, 1, checksum=True, exclude=[META])}}
        record = {"step": step, "saved_unix": time.time(), **(meta or {}), "files": files}
        atomic_write(partial / META, json.dumps(record, indent=2, sort_keys=True))
        _fsync_dir(partial)
        # final exists when the same step is saved again (e.g. an interval save followed by a stop signal)
        replace_folder(partial, final, aside=self.root / (final.name + ".replaced"))
        _fsync_dir(self.root)
        atomic_write(self.root / LATEST, final.name + "\n")
        self.prune()
        return final

    def set_aside(self, path: Path, reason: str, detail: str) -> Path:
        """Rename a checkpoint that failed verification to ``iter_N.bad-<reason>`` (never deleted; a
        ``-2``... suffix when that name is taken), note why inside it, and re-point ``latest`` at the newest complete
        one left (removing the pointer when none is). Returns the new path."""
        tag = re.sub(r"[^a-z0-9]+", "-", reason.lower()).strip("-") or "unknown"
        target, n = self.root / f"{path.name}{BAD_SUFFIX}{tag}", 1
        while target.exists():
            n += 1
            target = self.root / f"{path.name}{BAD_SUFFIX}{tag}-{n}"
        os.rename(path, target)
        with contextlib.suppress(OSError):
            (target / SET_ASIDE_NOTE).write_text(f"set aside {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {detail}\n")
        _fsync_dir(self.root)
        left = self.complete()
        if left:
            atomic_write(self.root / LATEST, left[-1][1].name + "\n")
        else:
            with contextlib.suppress(FileNotFoundError):
                (self.root / LATEST).unlink()
        return target

    def set_aside_folders(self) -> list[Path]:
        """Folders ``set_aside`` renamed, oldest name first."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if BAD_SUFFIX in p.name and p.name.startswith(PREFIX))

    def mark_verified(self, path: Path) -> None:
        """Record ``path`` (a checkpoint of this root that a resume verified and loaded) as the verified-good one."""
        atomic_write(self.root / VERIFIED, path.name + "\n")

    def verified(self) -> Path | None:
        """The newest checkpoint a resume verified and loaded, while it is still complete."""
        return self._pointed(VERIFIED)

    def prune(self) -> list[Path]:
        """Delete all but the ``keep_last`` newest complete checkpoints, and stale partial folders of older steps.

        Never deleted: the verified-good checkpoint (``verified``: the newest one a resume verified and loaded, so
        a run whose newer checkpoints all turn out bad still has one to fall back on) and set-aside folders."""
        done = self.complete()
        good = self.verified()
        removed = [p for _, p in done[: max(len(done) - self.keep_last, 0)] if p != good]
        newest = done[-1][0] if done else None
        for p in self.root.iterdir() if self.root.is_dir() else ():
            if p.name.endswith(PARTIAL_SUFFIX) and newest is not None:
                step = parse_step(p.name[: -len(PARTIAL_SUFFIX)])
                if step is not None and step <= newest:
                    removed.append(p)
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed


def newest_across(tiers: Sequence[CheckpointDirs], skip: Collection[Path] = ()) -> Path | None:
    """The newest complete checkpoint over several roots (the shared tier and the node-local one): the highest step;
    on a tie the earlier root (the shared, durable one)."""
    best: tuple[int, int, Path] | None = None
    for order, dirs in enumerate(tiers):
        path = dirs.newest(skip)
        if path is not None:
            key = (parse_step(path.name), -order, path)
            if best is None or key[:2] > best[:2]:
                best = key
    return None if best is None else best[2]


def resume_source(dirs: CheckpointDirs, *, resume: bool, load_path: str | None,
                  skip: Collection[Path] = (), tiers: Sequence[CheckpointDirs] = ()) -> Path | None:
    """The checkpoint a run starts from, or None for a fresh start.

    With ``resume`` (checkpoint.resume) the newest complete checkpoint under ``dirs`` or the other ``tiers`` of the
    run (checkpoint.local_dir; the highest step wins, the shared tier on a tie: the run's own, after a stop, a
    requeue or a restart); failing that ``load_path`` (checkpoint.load_path): a complete ``iter_N`` folder, or a
    folder of them (its newest). ``skip`` holds checkpoints that failed verification or loading (the fallback passes
    them). A ``load_path`` that holds no complete checkpoint at all is a user error; one whose checkpoints were all
    skipped gives None.
    """
    source = newest_across([dirs, *tiers], skip) if resume else None
    if source is not None or not load_path:
        return source
    given = Path(load_path).expanduser()
    if CheckpointDirs(given.parent).is_complete(given):
        return None if given in skip else given
    newest = CheckpointDirs(given).newest(skip)
    if newest is None:
        if skip and CheckpointDirs(given).newest() is not None:
            return None
        raise UserError(f"checkpoint.load_path={load_path} holds no complete checkpoint (give an iter_N folder "
                        "written by hpc_tools, or the folder holding them)")
    return newest
