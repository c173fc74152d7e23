"""A trained FSDP run -> a plain Hugging Face model folder (``AutoModelForCausalLM.from_pretrained(folder)``), the
adapter the backend table's ``hf_export`` names.

The checkpoint's ``dcp/`` folder is read in this one process without ranks (DCP assembles each full tensor from the
shards of whatever rank count and strategy saved it); the parameter names are already the Hugging Face ones. Which
checkpoint (the newest verified one) is ``hpc_tools.hf.export``'s; the folder is written beside ``out`` and renamed
at the end (``hpc_tools.hf.folder``), with the run's tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.registry import RunFolder, atomic_write


def export_checkpoint(run: RunFolder, recipe, ckpt: Path, out_dir: str | Path, overwrite: bool = False
                      ) -> dict[str, Any]:
    """The FSDP checkpoint ``ckpt`` of ``run`` -> the Hugging Face folder ``out_dir`` (with the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.config import ATTENTION, hf_config
    from hpc_tools.hf.export import EXPORT_META
    from hpc_tools.hf.folder import staged
    from hpc_tools.hf.tokenizer import save_tokenizer
    from hpc_tools.train.deepspeed.export import load_into
    from hpc_tools.train.fsdp.checkpoint import full_model_state

    meta = CheckpointDirs.read_meta(ckpt)
    model = AutoModelForCausalLM.from_config(hf_config(recipe), attn_implementation=ATTENTION, dtype=torch.float32)
    load_into(model, full_model_state(ckpt, model.state_dict()), ckpt)
    with staged(out_dir, overwrite) as tmp:
        token_ids = save_tokenizer(recipe.data.tokenizer, tmp)
        for cfg in (model.config, model.generation_config):  # generation stops at the tokenizer's eos
            cfg.bos_token_id, cfg.eos_token_id = token_ids["bos_token_id"], token_ids["eos_token_id"]
        model.save_pretrained(str(tmp))
        summary = {"folder": str(Path(out_dir).absolute()), "run_id": run.run_id, "step": meta["step"],
                   "checkpoint": str(ckpt), "parameters": sum(p.numel() for p in model.parameters()),
                   "layout": meta.get("layout"), "strategy": meta.get("strategy"),
                   "precision": meta.get("precision"), **token_ids}
        atomic_write(tmp / EXPORT_META, json.dumps(summary, indent=2, sort_keys=True))
    return summary
