"""``export RUN --out DIR``: a run's newest verified checkpoint -> a Hugging Face model folder.

Each backend owns its adapter, named by its row of the backend table (``hf_export``): Megatron runs
(``hpc_tools.train.megatron.hf_export``: the torch_dist checkpoint, any TP/PP/VPP layout, read offline on CPU in this
one process, renamed and unfused by ``hpc_tools.hf.mapping``) and DeepSpeed runs
(``hpc_tools.train.deepspeed.export``). This module finds the run's newest verified checkpoint and writes what every
folder has: config.json, generation_config.json, model.safetensors (fp32) and the run's tokenizer (``write_folder``).
The folder is written beside ``--out`` and renamed at the end (``hpc_tools.hf.folder``).

"Verified": the newest complete checkpoint (``CheckpointDirs.newest``) whose files still have the sizes and xxh3-64
checksums recorded at save (``checkpoints.verify.verify_share`` over all files); a bad one is reported and the next
older one is tried.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hpc_tools import backends
from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.errors import UserError
from hpc_tools.registry import RunFolder, atomic_write

log = logging.getLogger("hpc_tools.hf")

EXPORT_META = "hpc_tools_export.json"
"""What the folder was exported from (run, step, checkpoint, layout), beside the model files."""
EXPORTS_DIR = "exports"
"""``<run>/exports/iter_NNNNNNN/``: the one export of each checkpoint, shared by eval, quantize and serve."""


def run_recipe(run: RunFolder):
    """The resolved recipe a run was started with (its recipe.yaml)."""
    from hpc_tools.recipe.load import load_resolved

    return load_resolved(run.recipe_path)


def checkpoint_root(recipe, run: RunFolder) -> Path:
    """Where the run's checkpoints are (``checkpoint.dir``, else the run folder's ``checkpoints/``)."""
    return Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else run.checkpoints_dir


def verified_checkpoint(run: RunFolder, root: Path, step: int | None = None) -> Path:
    """The newest complete checkpoint under ``root`` (or the one of ``step``) whose files verify; UserError when none
    does, naming the bad files."""
    from hpc_tools.checkpoints.verify import verify_share

    dirs = CheckpointDirs(root)
    skip: list[Path] = []
    bad: list[str] = []
    while True:
        if step is None:
            path = dirs.newest(skip)
        else:
            path = dirs.final_path(step) if dirs.has(step) and dirs.final_path(step) not in skip else None
        if path is None:
            have = ", ".join(str(s) for s, _ in dirs.complete()) or "none"
            why = f"; failed verification: {'; '.join(bad)}" if bad else ""
            raise UserError(f"run {run.run_id} has no verified checkpoint{'' if step is None else f' at step {step}'}"
                            f" under {root} (complete steps: {have}{why}) (train until a checkpoint is saved, e.g. "
                            "with checkpoint.interval_iters, or pick a complete step with --step)")
        meta = CheckpointDirs.read_meta(path)
        problems = verify_share(path, meta, 0, 1, checksum=True).problems
        if not problems:
            return path
        bad.append(problems[0].line(path))
        log.warning("checkpoint %s failed verification (%s); trying the previous one", path, problems[0].line(path))
        skip.append(path)


def export_dir(run: RunFolder, iteration: int) -> Path:
    """Where checkpoint ``iteration`` of ``run`` is exported for the commands that read it (``shared_export``)."""
    return run.path / EXPORTS_DIR / f"iter_{iteration:07d}"


def shared_export(run: RunFolder, checkpoint: Path) -> Path:
    """The run's one export of ``checkpoint`` (a verified checkpoint folder): reused while its record names that
    checkpoint, else written (``eval``, ``quantize`` and ``serve`` read the same folder: one copy per checkpoint)."""
    from hpc_tools.checkpoints.dirs import parse_step

    iteration = parse_step(checkpoint.name)
    if iteration is None:
        raise UserError(f"{checkpoint} is not a checkpoint folder of run {run.run_id} (iter_NNNNNNN)")
    folder = export_dir(run, iteration)
    try:
        if json.loads((folder / EXPORT_META).read_text()).get("checkpoint") == str(checkpoint):
            return folder
    except (OSError, ValueError):
        pass
    folder.parent.mkdir(parents=True, exist_ok=True)
    export_run(run.path, folder, iteration, overwrite=True)
    return folder


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               overwrite: bool = False) -> dict[str, Any]:
    """Write the run's trained model as a Hugging Face folder ``out_dir``; returns a summary."""
    from hpc_tools.hf.folder import check_out

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run = RunFolder(run_dir)
    run.manifest()  # a one-line error when this is not a run folder
    check_out(Path(out_dir), overwrite)  # before any checkpoint is read
    recipe = run_recipe(run)
    adapter = backends.of(recipe).hf_export
    if adapter is None:
        raise UserError(f"run {run.run_id} has backend.kind={recipe.backend.kind}, which trains no model to export "
                        f"(export a run of backend.kind {' or '.join(backends.with_feature('hf_export'))})")
    ckpt = verified_checkpoint(run, checkpoint_root(recipe, run), step)
    return backends.load(adapter)(run, recipe, ckpt, out_dir, overwrite)


def write_model_folder(model, recipe, run: RunFolder, ckpt: Path, meta: dict[str, Any], out_dir: str | Path,
                       overwrite: bool = False, **fields: Any) -> dict[str, Any]:
    """A Hugging Face model built from ``run``'s checkpoint ``ckpt`` (its ``meta``) -> the folder ``out_dir``, with
    the run's tokenizer (generation stops at its eos) and the summary (plus ``fields``) beside the model files. For
    the backends that train transformers classes (their adapters load the weights, this writes the folder)."""
    from hpc_tools.hf.folder import staged
    from hpc_tools.hf.tokenizer import save_tokenizer

    with staged(out_dir, overwrite) as tmp:
        token_ids = save_tokenizer(recipe.data.tokenizer, tmp)
        for cfg in (model.config, model.generation_config):
            cfg.bos_token_id, cfg.eos_token_id = token_ids["bos_token_id"], token_ids["eos_token_id"]
        model.save_pretrained(str(tmp))
        summary = {"folder": str(Path(out_dir).absolute()), "run_id": run.run_id, "step": meta["step"],
                   "checkpoint": str(ckpt), "parameters": sum(p.numel() for p in model.parameters()),
                   "layout": meta.get("layout"), "precision": meta.get("precision"), **fields, **token_ids}
        atomic_write(tmp / EXPORT_META, json.dumps(summary, indent=2, sort_keys=True))
    return summary


def write_folder(recipe, state: dict, out: Path) -> dict[str, Any]:
    """config.json, generation_config.json, model.safetensors and the tokenizer of ``recipe`` into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from hpc_tools.hf import mapping
    from hpc_tools.hf.config import hf_config
    from hpc_tools.hf.tokenizer import save_tokenizer

    token_ids = save_tokenizer(recipe.data.tokenizer, out)
    cfg = hf_config(recipe)  # the one recipe -> transformers config (shared with the DeepSpeed backend)
    cfg.architectures = [mapping.ARCHITECTURES[mapping.architecture(recipe.model)]]
    cfg.use_cache = True  # the training config turns it off; generation wants it
    cfg.bos_token_id, cfg.eos_token_id = token_ids["bos_token_id"], token_ids["eos_token_id"]
    cfg.dtype = torch.float32
    cfg.save_pretrained(str(out))
    GenerationConfig(bos_token_id=token_ids["bos_token_id"], eos_token_id=token_ids["eos_token_id"],
                     pad_token_id=token_ids["pad_token_id"]).save_pretrained(str(out))
    save_file({k: v.to(torch.float32) for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return token_ids


