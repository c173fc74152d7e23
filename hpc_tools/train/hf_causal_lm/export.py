"""A trained run whose checkpoints are this package's (FSDP, Horovod) -> a plain Hugging Face model folder
(``AutoModelForCausalLM.from_pretrained(folder)``), the adapter the backend table's ``hf_export`` names.

The checkpoint's ``dcp/`` folder is read in this one process without ranks (DCP assembles each full tensor from the
shards of whatever rank count and strategy saved it); the parameter names are already the Hugging Face ones. Which
checkpoint (the newest verified one) is ``hpc_tools.hf.export``'s; the folder is written beside ``out`` and renamed
at the end (``hpc_tools.hf.folder``), with the run's tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_tools.checkpoints.dirs import CheckpointDirs
from hpc_tools.registry import RunFolder


def export_checkpoint(run: RunFolder, recipe, ckpt: Path, out_dir: str | Path, overwrite: bool = False
                      ) -> dict[str, Any]:
    """The Distributed Checkpoint ``ckpt`` of ``run`` -> the Hugging Face folder ``out_dir`` (with the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpc_tools.hf.config import ATTENTION, hf_config
    from hpc_tools.hf.export import write_model_folder
    from hpc_tools.train.hf_causal_lm.checkpoint import full_model_state
    from hpc_tools.train.hf_causal_lm.values import load_into

    meta = CheckpointDirs.read_meta(ckpt)
    model = AutoModelForCausalLM.from_config(hf_config(recipe), attn_implementation=ATTENTION, dtype=torch.float32)
    load_into(model, full_model_state(ckpt, model.state_dict()), ckpt)
    return write_model_folder(model, recipe, run, ckpt, meta, out_dir, overwrite, strategy=meta.get("strategy"))
