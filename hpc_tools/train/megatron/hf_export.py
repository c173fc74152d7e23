"""Megatron's Hugging Face adapter for ``export`` (its row in the backend table): a verified torch_dist checkpoint
of any TP/PP/VPP layout -> a Hugging Face folder. The checkpoint is read offline on CPU in one process without a
process group (``read_megatron``: torch.distributed.checkpoint reads each model tensor whole from every rank's
shards), ``hpc_tools.hf.mapping`` renames and unfuses the tensors, and ``hpc_tools.hf.export.write_folder`` writes
the folder.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.errors import UserError
from hpc_tools.hf.export import EXPORT_META, write_folder
from hpc_tools.registry import RunFolder, atomic_write


def export_checkpoint(run: RunFolder, recipe, ckpt: Path, out_dir: str | Path, overwrite: bool = False
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
    layers = layer_kind(meta, ckpt)
    tensors = read_megatron(ckpt, mapping.megatron_keys(m, layers))
    if tensors[mapping.EMBED].shape[0] < m.vocab_size:
        raise UserError(f"checkpoint {ckpt} has {tensors[mapping.EMBED].shape[0]} embedding rows, fewer than "
                        f"model.vocab_size={m.vocab_size} (was the recipe's model section changed after training?)")
    state = mapping.megatron_to_hf(tensors, m, layers)
    with staged(out_dir, overwrite) as tmp:
        token_ids = write_folder(recipe, state, tmp)
        summary = {"folder": str(Path(out_dir).absolute()), "run_id": run.run_id, "step": meta["step"],
                   "checkpoint": str(ckpt), "architecture": mapping.ARCHITECTURES[arch],
                   "parameters": sum(t.numel() for t in state.values()), "layout": meta.get("layout"),
                   "precision": recipe.training.precision, **token_ids}
        atomic_write(tmp / EXPORT_META, json.dumps(summary, indent=2, sort_keys=True))
    return summary


def layer_kind(meta: dict[str, Any], ckpt: Path) -> str:
    """The layer kind the checkpoint was written with (``transformer_engine`` | ``local``): its meta's record
    (``checkpoint.layout_meta``); for a checkpoint written before the record, the kind its tensors show (a TE MoE
    layer's own ``pre_mlp_layernorm``), else local."""
    from hpc_tools.hf import mapping

    recorded = (meta.get("layout") or {}).get("layers")
    if recorded in (mapping.TE_LAYERS, mapping.LOCAL_LAYERS):
        return recorded
    return mapping.TE_LAYERS if mapping.TE_MOE_NORM2 + "weight" in _stored(ckpt) else mapping.LOCAL_LAYERS


def _stored(ckpt: Path) -> dict[str, Any]:
    """The torch_dist metadata of every stored tensor, by key; a UserError when there is none to read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f"checkpoint {ckpt} has no readable torch_dist metadata ({type(e).__name__}: {e}) "
                        "(export a complete megatron checkpoint)") from None


def read_megatron(ckpt: Path, keys: list[str]) -> dict[str, Any]:
    """The global tensors ``keys`` of a torch_dist checkpoint, read whole from every rank's shards.

    One process, no process group: ``torch.distributed.checkpoint.load(..., no_dist=True)`` into tensors of the
    global shapes the checkpoint's metadata records. A key the checkpoint lacks is a UserError (the recipe's model
    section and the checkpoint disagree)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = _stored(ckpt)
    missing = [k for k in keys if not isinstance(stored.get(k), TensorStorageMetadata)]
    if missing:
        raise UserError(f"checkpoint {ckpt} lacks the tensors {missing[:3]} that the run's model section needs "
                        "(was the recipe's model section changed after training?)")
    # optimizer state: "optimizer..." keys, or "chained_<i>.optimizer..." when the optimizer is chained (experts
    # get their own distributed optimizer over the expert-data-parallel group)
    extra = sorted(k for k in stored if not k.startswith(("optimizer", "rng_state", "chained_"))
                   and "_extra_state" not in k and k not in keys)
    if extra:
        raise UserError(f"checkpoint {ckpt} holds model tensors the export does not map: {extra[:3]} "
                        "(a model option hpc_tools' Hugging Face mapping does not cover)")
    state = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no_dist is the documented single-process mode; torch warns about it
        dcp.load(state, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    return state
