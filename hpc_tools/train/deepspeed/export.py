"""A trained DeepSpeed run -> a plain Hugging Face model folder (``AutoModelForCausalLM.from_pretrained(folder)``).

ZeRO checkpoints (any stage) are consolidated with DeepSpeed's ``zero_to_fp32`` (the fp32 master weights, gathered from
every data-parallel partition). Pipeline checkpoints hold one file per layer; their parameters are renamed back to the
Hugging Face names through ``pipeline.layer_prefixes``. The run's tokenizer goes along (``hpc_tools.hf.tokenizer``).
Which checkpoint (the newest verified one) and the folder's atomic write are ``hpc_tools.hf.export``'s and
``hpc_tools.hf.folder``'s. Torch and transformers are imported only when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.errors import UserError
from hpc_tools.registry import RunFolder
from hpc_tools.train.hf_causal_lm.values import load_into


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None,
               overwrite: bool = False) -> dict[str, Any]:
    """Write the run's trained model into ``out_dir``; returns a summary (folder, step, parameter count)."""
    from hpc_tools.hf.export import export_run as export_any

    return export_any(run_dir, out_dir, step, overwrite)


def export_checkpoint(run: RunFolder, recipe, ckpt: Path, out_dir: str | Path, overwrite: bool = False
                      ) -> dict[str, Any]:
    """The DeepSpeed checkpoint ``ckpt`` of ``run`` -> the Hugging Face folder ``out_dir`` (with the tokenizer)."""
    from hpc_tools.hf.export import write_model_folder

    meta = CheckpointDirs.read_meta(ckpt)
    model = empty_model(recipe)
    state = pipeline_state(model, ckpt) if meta.get("pipeline_size", 1) > 1 else zero_state(ckpt)
    load_into(model, state, ckpt)
    return write_model_folder(model, recipe, run, ckpt, meta, out_dir, overwrite, zero_stage=meta.get("zero_stage"))


def empty_model(recipe):
    """The run's architecture with fresh weights (fp32), to be filled from the checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.config import ATTENTION, hf_config
    from hpc_tools.train.deepspeed.model import pretrained_config

    path = recipe.backend.deepspeed.pretrained_path
    cfg = pretrained_config(path) if path else hf_config(recipe)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=ATTENTION, dtype=torch.float32)


def zero_state(ckpt: Path) -> dict:
    """fp32 weights of a ZeRO checkpoint (stages 0-3) through DeepSpeed's zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name))
    except (ValueError, FileNotFoundError, KeyError, TypeError):
        # ZeRO-0 writes no ZeRO partitions: the module weights are the weights (fp32, or bf16 without masters)
        return module_state(ckpt)


def module_state(ckpt: Path) -> dict:
    import torch

    states = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in states["module"].items()}


def pipeline_state(model, ckpt: Path) -> dict:
    """Hugging Face-named weights from the per-layer files of a DeepSpeed pipeline checkpoint."""
    import torch

    from hpc_tools.train.deepspeed.pipeline import hf_state_dict, layer_prefixes

    prefixes = layer_prefixes(model)
    states = {}
    for idx in prefixes:
        files = sorted(ckpt.glob(f"layer_{idx:02d}-*model_states.pt"))
        if not files:
            raise UserError(f"pipeline checkpoint {ckpt} lacks the file of layer {idx} (was the save complete?)")
        states[idx] = {k: v.float() for k, v in torch.load(files[0], map_location="cpu", weights_only=True).items()}
    return hf_state_dict(prefixes, states)
