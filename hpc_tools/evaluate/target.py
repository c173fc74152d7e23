"""What ``eval`` and ``quantize`` are given (RUN_OR_HF_DIR): a run, or a Hugging Face model folder; the run's
checkpoints to evaluate and their exports.

A folder with a ``config.json`` is a model folder; its results go to the run it came from when it names one (a
quantized folder's ``hpc_tools_quantize.json``, an export's checkpoint inside a run folder), else to the folder's
own ``eval/``. Anything else is looked up as a run (folder, run id or prefix, Slurm job id). Every check here runs
before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_tools.errors import UserError
from hpc_tools.evaluate.results import EVAL_DIR, QUANTIZE_META
from hpc_tools.registry import MANIFEST, RunFolder, find_run, runs_root

EXPORT_META = "hpc_tools_export.json"  # hpc_tools.hf.export.EXPORT_META (read here without importing the exporter)


@dataclass
class Model:
    """One model to evaluate: an existing folder, or a run's checkpoint still to export (``folder`` is then where
    the export goes)."""

    folder: Path
    iteration: int | None
    tokens: int | None
    scheme: str | None = None
    checkpoint: Path | None = None  # set when the folder must first be exported from this checkpoint


@dataclass
class Target:
    ref: str
    run: RunFolder | None  # the run the results belong to (None: a folder of its own)
    folder: Path | None  # the model folder given, None for a run
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def eval_dir(self) -> Path:
        return (self.run.path if self.run is not None else self.folder) / EVAL_DIR


def resolve(ref: str, runs_dir: str | None = None) -> Target:
    """The run or model folder ``ref`` names; one-line UserError when it is neither."""
    path = Path(ref).expanduser()
    if (path / "config.json").is_file():
        meta = _folder_meta(path)
        return Target(ref, _run_of(meta), path.absolute(), meta)
    if path.is_dir() and not (path / MANIFEST).is_file():
        raise UserError(f"{ref} is neither a run folder (no {MANIFEST}) nor a Hugging Face model folder (no "
                        "config.json) (give a run folder, run id or Slurm job id, or a folder written by "
                        "`python -m hpc_tools export` or `quantize`)")
    root = runs_root(runs_dir)
    try:
        run = find_run(ref, root)
    except UserError:
        raise UserError(f"{ref} is neither a run (no run folder, run id or job id matches under {root}) nor a "
                        "Hugging Face model folder (no config.json there) (give a run folder, run id or Slurm job "
                        "id, --runs-dir for another runs root, or a folder written by `python -m hpc_tools "
                        "export` or `quantize`)") from None
    run.manifest()
    return Target(ref, run, None)


def _folder_meta(folder: Path) -> dict[str, Any]:
    """What hpc_tools wrote beside the model (quantize's record, else export's), {} for a foreign folder."""
    for name in (QUANTIZE_META, EXPORT_META):
        try:
            return {"kind": name, **json.loads((folder / name).read_text())}
        except (OSError, ValueError):
            continue
    return {}


def _run_of(meta: dict[str, Any]) -> RunFolder | None:
    """The run a model folder came from, when it is still there."""
    if meta.get("run_dir") and (Path(meta["run_dir"]) / MANIFEST).is_file():
        return RunFolder(meta["run_dir"])
    ckpt = meta.get("checkpoint")
    for parent in (Path(ckpt).parents if ckpt else []):
        if (parent / MANIFEST).is_file():
            return RunFolder(parent)
    return None


def models(target: Target, iterations: list[int] | None) -> list[Model]:
    """The models to evaluate: the folder given, or the run's newest verified checkpoint / each of ``iterations``
    (every one checked to exist and verify, before anything is exported)."""
    if target.folder is not None:
        if iterations:
            raise UserError(f"--iterations {','.join(map(str, iterations))} names checkpoints, but {target.ref} is a "
                            "model folder (give the run instead, or leave --iterations out)")
        m = target.meta
        return [Model(target.folder, m.get("iteration", m.get("step")), m.get("tokens"), m.get("scheme"))]
    from hpc_tools.checkpoints.dirs import CheckpointDirs
    from hpc_tools.hf.export import checkpoint_root, run_recipe, verified_checkpoint

    run = target.run
    recipe = run_recipe(run)
    root = checkpoint_root(recipe, run)
    from hpc_tools.layout import ParallelLayout

    # the layout's global batch: the recipe's may be null (micro batch x data-parallel size)
    per_step = ParallelLayout.from_recipe(recipe).global_batch_size * recipe.model.seq_length
    if not iterations:
        ckpt = verified_checkpoint(run, root)
        steps = [(CheckpointDirs.read_meta(ckpt)["step"], ckpt)]
    else:
        have = {s for s, _ in CheckpointDirs(root).complete()}
        missing = [i for i in iterations if i not in have]
        if missing:
            raise UserError(f"--iterations: run {run.run_id} has no complete checkpoint at iteration(s) "
                            f"{', '.join(map(str, missing))} (complete: {', '.join(map(str, sorted(have))) or 'none'})"
                            " (pick saved iterations, or leave --iterations out for the newest)")
        steps = [(i, verified_checkpoint(run, root, i)) for i in iterations]
    return [Model(export_folder(run, step), step, step * per_step, None, ckpt) for step, ckpt in steps]


def export_folder(run: RunFolder, iteration: int) -> Path:
    """Where the checkpoint of ``iteration`` is exported (the run's one export of it: ``hf.export.export_dir``)."""
    from hpc_tools.hf.export import export_dir

    return export_dir(run, iteration)


def ensure_exported(model: Model, run: RunFolder) -> Path:
    """The model's Hugging Face folder: the run's one export of its checkpoint (``hf.export.shared_export``), written
    first unless it is there."""
    if model.checkpoint is None:
        return model.folder
    from hpc_tools.hf.export import shared_export

    return shared_export(run, model.checkpoint)
