"""A trained DeepSpeed run -> a plain Hugging Face model folder (``AutoModelForCausalLM.from_pretrained(folder)``).

ZeRO checkpoints (any stage) are consolidated with DeepSpeed's ``zero_to_fp32`` (the fp32 master weights, gathered from
every data-parallel partition). Pipeline checkpoints hold one file per layer; their parameters are renamed back to the
Hugging Face names through ``pipeline.layer_prefixes``. Torch and transformers are imported only when called.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hpc_tools.errors import UserError
from hpc_tools.recipe.load import parse_yaml, resolve
from hpc_tools.registry import RunFolder, atomic_write
from hpc_tools.train.checkpoint_dirs import CheckpointDirs

EXPORT_META = "hpc_tools_export.json"


def checkpoint_of(run: RunFolder, step: int | None = None) -> tuple[Any, Path]:
    """(recipe, checkpoint folder) of a run: the newest complete checkpoint, or the one of ``step``."""
    recipe = resolve(parse_yaml(run.recipe_path.read_text(), str(run.recipe_path)), source=str(run.recipe_path))
    if recipe.backend.kind != "deepspeed":
        raise UserError(f"run {run.run_id} has backend.kind={recipe.backend.kind}; export handles deepspeed runs "
                        "(convert Megatron checkpoints with Megatron's own tools)")
    root = Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else run.checkpoints_dir
    dirs = CheckpointDirs(root)
    path = dirs.newest() if step is None else (dirs.final_path(step) if dirs.has(step) else None)
    if path is None:
        have = ", ".join(str(s) for s, _ in dirs.complete()) or "none"
        raise UserError(f"run {run.run_id} has no complete checkpoint{'' if step is None else f' at step {step}'} "
                        f"under {root} (complete steps: {have}; train longer or pick one of them with --step)")
    return recipe, path


def export_run(run_dir: str | Path, out_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """Write the run's trained model into ``out_dir``; returns a summary (folder, step, parameter count)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run = RunFolder(run_dir)
    run.manifest()  # a one-line error when this is not a run folder
    recipe, ckpt = checkpoint_of(run, step)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is not empty (give a new folder; an export never overwrites files)")
    meta = CheckpointDirs.read_meta(ckpt)
    model = empty_model(recipe)
    state = pipeline_state(model, ckpt) if meta.get("pipeline_size", 1) > 1 else zero_state(ckpt)
    load_into(model, state, ckpt)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    copy_tokenizer(recipe, out)
    summary = {"folder": str(out), "run_id": run.run_id, "step": meta["step"], "checkpoint": str(ckpt),
               "parameters": sum(p.numel() for p in model.parameters()), "layout": meta.get("layout"),
               "zero_stage": meta.get("zero_stage"), "precision": meta.get("precision")}
    atomic_write(out / EXPORT_META, json.dumps(summary, indent=2, sort_keys=True))
    return summary


def empty_model(recipe):
    """The run's architecture with fresh weights (fp32), to be filled from the checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.train.deepspeed.model import ATTENTION, hf_config, pretrained_config

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


def load_into(model, state: dict, ckpt: Path) -> None:
    """Load weights; only a tied output projection may be absent from the checkpoint."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise UserError(f"checkpoint {ckpt} does not match the run's model (missing {missing[:4]}, unexpected "
                        f"{unexpected[:4]}); was the recipe's model section changed after training?")
    if tied:
        model.tie_weights()


def copy_tokenizer(recipe, out: Path) -> None:
    """A local Hugging Face tokenizer travels with the model; the byte tokenizer needs no files."""
    if recipe.data.tokenizer == "byte":
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(recipe.data.tokenizer, local_files_only=True).save_pretrained(str(out))
