"""Run folders: one per submission, created atomically, with a manifest that every step of the job's life updates.

Layout of a run folder::

    runs/<run_id>/
        recipe.yaml       the resolved recipe (re-read and compared when written)
        job.sbatch        the rendered batch script
        manifest.json     job id, executor, git SHA (dirty flag, diff hash), versions, site file, nodelist, times,
                          state
        logs/             launcher and per-rank logs
        records/          per-rank metric records (schema owned by profiling.schema)
        checkpoints/      default checkpoint folder
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any, Iterator

from hpc_tools.errors import UserError
from hpc_tools.runstate import LIVE_STATES, TERMINAL_STATES  # the run-state vocabulary's owner
from profiling.files import atomic_write, current_umask, staged_folder  # the one atomic write, re-exported

MANIFEST = "manifest.json"
RECIPE = "recipe.yaml"
SCRIPT = "job.sbatch"
SUBDIRS = ("logs", "records", "checkpoints")
DEFAULT_MODE = 0o755  # cluster.run_dir_mode's default: a teammate or the group can read a shared run
# Space kept free for the manifest: when the disk fills (a checkpoint save ran out of space), deleting this file
# lets the ranks and the batch script's epilogue still record how the run ended.
RESERVE, RESERVE_BYTES = ".reserve", 256 * 1024


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def runs_root(explicit: str | Path | None = None) -> Path:
    """--runs-dir, else $HPC_TOOLS_RUNS_DIR, else ./runs."""
    return Path(explicit or os.environ.get("HPC_TOOLS_RUNS_DIR") or "runs").absolute()


def new_run_id(name: str) -> str:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{name}-{stamp}-{secrets.token_hex(3)}"


def git_sha(cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd or Path(__file__).parent, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def git_tree(cwd: Path | None = None) -> dict[str, Any]:
    """``{"git_sha", "git_dirty", "git_diff_sha256"}`` of the checkout hpc_tools runs from: the commit, whether
    tracked files differ from it, and a hash of that difference (``git diff HEAD``; two runs with the same hash ran the
    same code). None each outside a git checkout."""
    sha = git_sha(cwd)
    if sha is None:
        return {"git_sha": None, "git_dirty": None, "git_diff_sha256": None}
    try:
        out = subprocess.run(["git", "diff", "HEAD", "--no-color", "--no-ext-diff"], cwd=cwd or Path(__file__).parent,
                             capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {"git_sha": sha, "git_dirty": None, "git_diff_sha256": None}
    if out.returncode != 0:
        return {"git_sha": sha, "git_dirty": None, "git_diff_sha256": None}
    return {"git_sha": sha, "git_dirty": bool(out.stdout),
            "git_diff_sha256": hashlib.sha256(out.stdout).hexdigest() if out.stdout else None}


def package_versions() -> dict[str, str]:
    """Versions of the packages a run depends on, without importing them (importlib.metadata only)."""
    from importlib import metadata

    found = {}
    for name in ("hpc_tools", "torch", "megatron-core", "deepspeed", "transformers", "datasets", "submitit", "pandas"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


@contextlib.contextmanager
def file_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder/.lock`` for read-modify-write of the files in it (across processes)."""
    with open(Path(folder) / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class RunFolder:
    """A run folder on disk. Create with ``RunFolder.create``; open an existing one with ``RunFolder(path)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()

    # -- creation ------------------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, root: Path, run_id: str, recipe_text: str, script_text: str, manifest: dict[str, Any],
               check_recipe=None, mode: int = DEFAULT_MODE) -> "RunFolder":
        """Build the folder under a hidden temporary name and rename it into place: no partial run folders.

        ``check_recipe(text)`` re-reads the written recipe and must return the same text (a round-trip check).
        The folder and its subfolders get ``mode`` (``cluster.run_dir_mode``) under the umask (mkdtemp alone makes
        0700); its files follow (``profiling.files.file_mode``).
        """
        root.mkdir(parents=True, exist_ok=True)
        final = root / run_id
        if final.exists():
            raise UserError(f"run folder {final} already exists (choose another run name)")
        with staged_folder(final, prefix=f".{run_id}.") as tmp:
            folder_mode = mode & ~current_umask()
            os.chmod(tmp, folder_mode)
            for sub in SUBDIRS:
                (tmp / sub).mkdir()
                os.chmod(tmp / sub, folder_mode)
            atomic_write(tmp / RECIPE, recipe_text)
            if check_recipe is not None:
                reread = (tmp / RECIPE).read_text()
                if check_recipe(reread) != recipe_text:
                    raise RuntimeError(f"the resolved recipe did not survive a round trip through {RECIPE}")
            atomic_write(tmp / SCRIPT, script_text)
            base = {"run_id": run_id, "state": "CREATED", "created": now_iso(), **git_tree(),
                    "versions": package_versions(), "events": []}
            atomic_write(tmp / MANIFEST, json.dumps({**base, **manifest}, indent=2, sort_keys=True))
            (tmp / RESERVE).write_bytes(bytes(RESERVE_BYTES))
        return cls(final)

    # -- reading -------------------------------------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.path.name

    @property
    def recipe_path(self) -> Path:
        return self.path / RECIPE

    @property
    def records_dir(self) -> Path:
        return self.path / "records"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    def exists(self) -> bool:
        return (self.path / MANIFEST).is_file()

    def manifest(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / MANIFEST).read_text())
        except FileNotFoundError:
            raise UserError(f"{self.path} is not a run folder (no {MANIFEST}); "
                            "see `python -m hpc_tools list`") from None

    # -- updating ------------------------------------------------------------------------------------------------------
    def update(self, event: str | None = None, soft: bool = False, **fields: Any) -> dict[str, Any]:
        """Read-modify-write the manifest under a lock; ``event`` is appended to its event log with a timestamp.

        The first terminal state of a life stands: a late writer (a rank reporting its stop after Slurm already
        said CANCELLED) cannot replace it; a live state (the requeued job starting again) can. PREEMPTED, the ranks'
        own report that a signal stopped them, is the weakest: Slurm's verdict (CANCELLED, TIMEOUT, ...) replaces it.

        A full disk first gives up the folder's reserve (``RESERVE``, made for this moment) and tries once more. With
        ``soft`` (readers such as ``status``, and writers on their way out), a manifest that cannot be written is
        not an error: the merged record is returned unwritten.
        """
        try:
            return self._update(event, fields)
        except OSError as exc:
            if exc.errno == errno.ENOSPC and self._release_reserve():
                try:
                    return self._update(event, fields)
                except OSError:
                    if not soft:
                        raise
            elif not soft:
                raise
        return _merge(self.manifest(), event, fields)

    def _update(self, event: str | None, fields: dict[str, Any]) -> dict[str, Any]:
        with file_lock(self.path):
            data = _merge(self.manifest(), event, fields)
            atomic_write(self.path / MANIFEST, json.dumps(data, indent=2, sort_keys=True))
            return data

    def _release_reserve(self) -> bool:
        """Delete the reserve file (space for the manifest's last words on a full disk); False if it is gone."""
        try:
            (self.path / RESERVE).unlink()
            return True
        except OSError:
            return False


def _merge(data: dict[str, Any], event: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    """``data`` updated with ``fields`` and ``event`` under the state rule of ``RunFolder.update``."""
    current, new = data.get("state"), fields.get("state")
    if current in TERMINAL_STATES and new not in (None, *LIVE_STATES) and \
            not (current == "PREEMPTED" and new != "PREEMPTED"):
        fields = {k: v for k, v in fields.items() if k != "state"}
    data.update(fields)
    if event:
        data.setdefault("events", []).append({"time": now_iso(), "event": event,
                                              **{k: v for k, v in fields.items() if k != "events"}})
    return data


def find_run(ref: str, root: Path) -> RunFolder:
    """A run by folder path, exact run id, unique run-id prefix, or Slurm job id."""
    path = Path(ref)
    if (path / MANIFEST).is_file():
        return RunFolder(path)
    if (root / ref / MANIFEST).is_file():
        return RunFolder(root / ref)
    runs = list_runs(root)
    matches = [r for r in runs if r.run_id.startswith(ref)] or \
        [r for r in runs if str(r.manifest().get("job_id")) == ref]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UserError(f"no run matches {ref!r} under {root} (see `python -m hpc_tools list`)")
    raise UserError(f"{ref!r} matches {len(matches)} runs under {root} (give more of the run id)")


def list_runs(root: Path) -> list[RunFolder]:
    if not root.is_dir():
        return []
    runs = [RunFolder(p) for p in root.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file()]
    return sorted(runs, key=lambda r: r.manifest().get("created", ""))


def resolve_run(ref: str | None, runs_dir: str | Path | None = None) -> RunFolder:
    """The run a command names (folder, run id or unique prefix, Slurm job id), or the latest under the runs root."""
    root = runs_root(runs_dir)
    if ref:
        return find_run(ref, root)
    runs = list_runs(root)
    if not runs:
        raise UserError(f"no runs under {root} (submit one with `python -m hpc_tools submit RECIPE`)")
    return runs[-1]
