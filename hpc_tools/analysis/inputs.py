"""What to analyse: run folders given directly, the runs of a sweep folder, or every run under a folder."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_tools.errors import UserError
from hpc_tools.layout import ParallelLayout
from hpc_tools.registry import MANIFEST, RunFolder, find_run, list_runs, runs_root
from hpc_tools.runstate import hang_markers

SWEEP_FILE = "sweep.json"


@dataclass
class RunInput:
    """One run folder with what the analysis needs besides its records."""

    run: RunFolder
    manifest: dict[str, Any]
    recipe: Any | None  # hpc_tools.recipe.schema.Recipe, None when recipe.yaml is unreadable
    layout: ParallelLayout | None
    sweep: str | None = None
    cell: int | None = None
    repeat: int = 0
    label: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    status: str | None = None

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def hang_markers(self) -> list[Path]:
        return hang_markers(self.run)


def load_recipe_of(run: RunFolder):
    """The run's resolved recipe, read without the rule check (analysis must not refuse an old run)."""
    import yaml

    from hpc_tools.recipe.load import resolve

    # The C loader when built: a sweep of many runs otherwise spends most of its fixed cost parsing recipes.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        raw = yaml.load(run.recipe_path.read_text(), Loader=loader)
        return resolve(raw, source=str(run.recipe_path), check=False) if isinstance(raw, dict) else None
    except (OSError, UserError, yaml.YAMLError):
        return None


def run_input(run: RunFolder, **extra: Any) -> RunInput:
    recipe = load_recipe_of(run)
    layout = ParallelLayout.from_recipe(recipe) if recipe is not None else None
    return RunInput(run=run, manifest=run.manifest(), recipe=recipe, layout=layout, **extra)


def sweep_inputs(folder: Path) -> list[RunInput]:
    """The runs of a sweep folder, carrying each cell's parameters, repeat index and last known status."""
    data = json.loads((folder / SWEEP_FILE).read_text())
    out = []
    for cell in data.get("cells", []):
        run_dir = cell.get("run_dir")
        if not run_dir or not (folder / run_dir / MANIFEST).is_file():
            continue
        out.append(run_input(RunFolder(folder / run_dir), sweep=data.get("sweep_id", folder.name),
                             cell=cell.get("cell"), repeat=cell.get("repeat", 0), label=cell.get("label", ""),
                             params=cell.get("params", {}), status=cell.get("status")))
    return out


def discover(refs: list[str], root: str | Path | None = None) -> tuple[list[RunInput], list[str]]:
    """(runs, sweep ids) for run folders, sweep folders, folders of runs, run ids or Slurm job ids."""
    runs: list[RunInput] = []
    sweeps: list[str] = []
    for ref in refs:
        path = Path(ref)
        if (path / SWEEP_FILE).is_file():
            found = sweep_inputs(path)
            sweeps.append(path.name)
        elif (path / MANIFEST).is_file():
            found = [run_input(RunFolder(path))]
        elif path.is_dir() and list_runs(path):
            found = [run_input(r) for r in list_runs(path)]
        else:
            found = [run_input(find_run(ref, runs_root(root)))]
        if not found:
            raise UserError(f"{ref} holds no run folders with a {MANIFEST} (give run or sweep folders)")
        runs.extend(found)
    seen: set[Path] = set()
    unique = [r for r in runs if not (r.run.path in seen or seen.add(r.run.path))]
    return unique, sweeps
