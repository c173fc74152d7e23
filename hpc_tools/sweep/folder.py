"""The sweep folder: ``<runs root>/sweeps/<name>-<stamp>/`` holding ``sweep.json`` and the sweep's run folders.

``sweep.json`` lists every cell x repeat (its parameters, overrides, run folder, job id, status and earlier attempts)
and every dropped cell with its reasons. It is rewritten atomically under a lock, like a run manifest.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

from hpc_tools.errors import UserError
from hpc_tools.registry import atomic_write, file_lock, new_run_id, now_iso, runs_root

SWEEP_FILE = "sweep.json"


class SweepFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path).absolute()

    @classmethod
    def create(cls, root: str | Path | None, name: str, data: dict[str, Any]) -> "SweepFolder":
        sweep_id = new_run_id(name)
        path = runs_root(root) / "sweeps" / sweep_id
        path.mkdir(parents=True)
        folder = cls(path)
        atomic_write(path / SWEEP_FILE, json.dumps({"sweep_id": sweep_id, "created": now_iso(), **data}, indent=2,
                                                   default=str))
        return folder

    @classmethod
    def find(cls, ref: str, root: str | Path | None = None) -> "SweepFolder":
        """A sweep by folder path, sweep id or unique id prefix under <runs root>/sweeps."""
        path = Path(ref)
        if (path / SWEEP_FILE).is_file():
            return cls(path)
        base = runs_root(root) / "sweeps"
        # a prefix of a folder name, compared as text: the reference is no glob pattern (`/abs`, `[`, `*` in it)
        matches = sorted(p for p in base.iterdir() if p.name.startswith(ref) and (p / SWEEP_FILE).is_file()) \
            if ref and base.is_dir() else []
        if len(matches) == 1:
            return cls(matches[0])
        if not matches:
            raise UserError(f"no sweep matches {ref!r} (give a sweep folder, or a sweep id under {base})")
        raise UserError(f"{ref!r} matches {len(matches)} sweeps under {base} (give more of the sweep id)")

    @property
    def sweep_id(self) -> str:
        return self.path.name

    def read(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / SWEEP_FILE).read_text())
        except FileNotFoundError:
            raise UserError(f"{self.path} is not a sweep folder (no {SWEEP_FILE})") from None

    @contextlib.contextmanager
    def edit(self) -> Iterator[dict[str, Any]]:
        """Read-modify-write sweep.json under a lock (the local runner and `sweep status` may overlap)."""
        with file_lock(self.path):
            data = self.read()
            yield data
            atomic_write(self.path / SWEEP_FILE, json.dumps(data, indent=2, default=str))

    def update_cell(self, cell_id: str, **fields: Any) -> None:
        with self.edit() as data:
            for cell in data["cells"]:
                if cell["id"] == cell_id:
                    cell.update(fields)
                    return
            raise KeyError(cell_id)

    def run_dir(self, cell: dict[str, Any]) -> Path | None:
        return self.path / cell["run_dir"] if cell.get("run_dir") else None
