"""``export RUN --out DIR``: a run's newest verified checkpoint -> a Hugging Face model folder.

Megatron runs: the checkpoint (torch_dist, any TP/PP/VPP layout) is read offline on CPU in this one process, without
a process group: torch.distributed.checkpoint reads each model tensor whole from the shards of every rank
(``read_megatron``), ``hpc_tools.hf.mapping`` renames and unfuses them, and the folder gets config.json,
generation_config.json, model.safetensors (fp32) and the run's tokenizer. DeepSpeed runs go through
``hpc_tools.train.deepspeed.export``. Either way the folder is written beside ``--out`` and renamed at the end
(``hpc_tools.hf.folder``).

"Verified": the newest complete checkpoint (``CheckpointDirs.newest``) whose files still have the sizes and xxh3-64
checksums recorded at save (``checkpoints.verify.verify_share`` over all files); a bad one is reported and the next
older one is tried.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.errors import UserError
from hpc_tools.registry import RunFolder, atomic_write

log = logging.getLogger("hpc_tools.hf")

EXPORT_META = "hpc_tools_export.json"
"""What the folder was exported from (run, step, checkpoint, layout), beside the model files."""


def run_recipe(run: RunFolder):
    """The resolved recipe a run was started with (its recipe.yaml)."""
    from hpc_tools.recipe.load import resolve
    from hpc_tools.recipe.yamlfile import parse_yaml

    return resolve(parse_yaml(run.recipe_path.read_text(), str(run.recipe_path)), source=str(run.recipe_path))


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


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               overwrite: bool = False) -> dict[str, Any]:
    """Write the run's trained model as a Hugging Face folder ``out_dir``; returns a summary."""
    from hpc_tools.hf.folder import check_out

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run = RunFolder(run_dir)
    run.manifest()  # a one-line error when this is not a run folder
    check_out(Path(out_dir), overwrite)  # before any checkpoint is read
    recipe = run_recipe(run)
    if recipe.backend.kind == "deepspeed":
        from hpc_tools.train.deepspeed.export import export_checkpoint as export_deepspeed

        return export_deepspeed(run, recipe, verified_checkpoint(run, checkpoint_root(recipe, run), step), out_dir,
                                overwrite)
    if recipe.backend.kind != "megatron":
        raise UserError(f"run {run.run_id} has backend.kind={recipe.backend.kind}, which trains no model to export "
                        "(export a megatron or deepspeed run)")
    return export_megatron(run, recipe, verified_checkpoint(run, checkpoint_root(recipe, run), step), out_dir,
                           overwrite)


def export_megatron(run: RunFolder, recipe, ckpt: Path, out_dir: str | Path, overwrite: bool = False
                    ) -> dict[str, Any]:
    """A verified Megatron checkpoint of ``run`` -> the Hugging Face folder ``out_dir``."""
    from hpc_tools.hf import mapping
    from hpc_tools.hf.folder import staged
    from hpc_tools.train.megatron.checkpoint import FORMAT

    m = recipe.model
    arch = mapping.architecture(m)
    meta = CheckpointDirs.read_meta(ckpt)
    if meta.get("format") != FORMAT:
        raise UserError(f"checkpoint {ckpt} was not written by the megatron backend (format {meta.get('format')!r}; "
                        "export the run that wrote it)")
    tensors = read_megatron(ckpt, mapping.megatron_keys(m))
    if tensors[mapping.EMBED].shape[0] < m.vocab_size:
        raise UserError(f"checkpoint {ckpt} has {tensors[mapping.EMBED].shape[0]} embedding rows, fewer than "
                        f"model.vocab_size={m.vocab_size} (was the recipe's model section changed after training?)")
    state = mapping.megatron_to_hf(tensors, m)
    with staged(out_dir, overwrite) as tmp:
        token_ids = write_folder(recipe, state, tmp)
        summary = {"folder": str(Path(out_dir).absolute()), "run_id": run.run_id, "step": meta["step"],
                   "checkpoint": str(ckpt), "architecture": mapping.ARCHITECTURES[arch],
                   "parameters": sum(t.numel() for t in state.values()), "layout": meta.get("layout"),
                   "precision": recipe.training.precision, **token_ids}
        atomic_write(tmp / EXPORT_META, json.dumps(summary, indent=2, sort_keys=True))
    return summary


def write_folder(recipe, state: dict, out: Path) -> dict[str, Any]:
    """config.json, generation_config.json, model.safetensors and the tokenizer of ``recipe`` into ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from hpc_tools.hf import mapping
    from hpc_tools.hf.tokenizer import save_tokenizer
    from hpc_tools.train.deepspeed.model import hf_config

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


def read_megatron(ckpt: Path, keys: list[str]) -> dict[str, Any]:
    """The global tensors ``keys`` of a torch_dist checkpoint, read whole from every rank's shards.

    One process, no process group: ``torch.distributed.checkpoint.load(..., no_dist=True)`` into tensors of the
    global shapes the checkpoint's metadata records. A key the checkpoint lacks is a UserError (the recipe's model
    section and the checkpoint disagree)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"checkpoint {ckpt} has no readable torch_dist metadata ({type(e).__name__}: {e}) "
                        "(export a complete megatron checkpoint)") from None
    missing = [k for k in keys if not isinstance(stored.get(k), TensorStorageMetadata)]
    if missing:
        raise UserError(f"checkpoint {ckpt} lacks the tensors {missing[:3]} that the run's model section needs "
                        "(was the recipe's model section changed after training?)")
    extra = sorted(k for k in stored if not k.startswith(("optimizer", "rng_state")) and "_extra_state" not in k
                   and k not in keys)
    if extra:
        raise UserError(f"checkpoint {ckpt} holds model tensors the export does not map: {extra[:3]} "
                        "(a model option hpc_tools' Hugging Face mapping does not cover)")
    state = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist is the documented single-process mode; torch warns about it
        dcp.load(state, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    return state
