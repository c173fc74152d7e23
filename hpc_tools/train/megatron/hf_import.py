"""``checkpoint.init_from_hf: DIR``: a Megatron run's step-0 weights from a local Hugging Face folder.

Every rank reads the folder (config.json, model.safetensors or a sharded ``model.safetensors.index.json``), checks
that it is the recipe's architecture and shape (``mapping.config_mismatches``: a mismatch names the config.json field
and the ``model:`` field), builds Megatron-core's global tensors one at a time (``mapping.megatron_tensor``; a layer's
row of a layer-stacked tensor, read from the memory-mapped safetensors files) and copies into its parameters the
slices its layout owns, so a rank holds its shard plus one tensor, never the whole model. The slices are those of
its chunks' ``sharded_state_dict()``, the description of the layout that a checkpoint load uses, so any TP/PP/VPP
layout works (Megatron's own load does the same: apply the sharded-tensor factories, fill, merge the factories
back). The optimizer starts fresh; the fp32 master weights of a 16-bit run are refreshed from the loaded parameters.

The trainer calls ``init_engine`` only when the run has no checkpoint to resume from (``checkpoints.dirs
.resume_source``): a resumed run continues from its own checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hpc_tools.errors import UserError
from hpc_tools.hf.load import FIELD, Weights, read_config

if TYPE_CHECKING:
    from hpc_tools.recipe.model import ModelConfig
    from hpc_tools.train.megatron.engine import MegatronCore

log = logging.getLogger("hpc_tools.hf")


def init_unless_resuming(engine: "MegatronCore", recipe, dirs) -> bool:
    """``init_engine`` from ``checkpoint.init_from_hf`` when the run has no checkpoint to resume from (its own, or
    ``checkpoint.load_path``); returns whether it did. Called by every rank once the engine is built."""
    from hpc_tools.checkpoints.dirs import resume_source

    ck = recipe.checkpoint
    if not ck.init_from_hf or resume_source(dirs, resume=ck.resume, load_path=ck.load_path) is not None:
        return False
    init_engine(engine, ck.init_from_hf)
    log.info("initialised the model from the Hugging Face folder %s (step 0, fresh optimizer)", ck.init_from_hf)
    return True


def init_engine(engine: "MegatronCore", folder: str | Path) -> None:
    """Overwrite this rank's model weights with its shard of the Hugging Face folder (step 0, optimizer fresh)."""
    import torch

    from hpc_tools.hf.mapping import check_unused_biases
    from hpc_tools.train.megatron.checkpoint import _reload_main_params
    from hpc_tools.train.megatron.model import unwrap

    m = engine.recipe.model
    read_config(folder, m)
    weights = Weights(folder)
    tensors = Tensors(weights, m, m.padded_vocab_size(engine.layout.tensor_size), folder, engine.plan.layers)
    try:
        check_unused_biases(weights, m)
        with torch.no_grad():
            for chunk in engine.chunks:
                module = unwrap(chunk)
                module.load_state_dict(local_state(module.sharded_state_dict(), tensors, folder), strict=True)
    except UserError as e:
        if str(e).startswith(FIELD):
            raise
        raise UserError(f"{FIELD}: {Path(folder).expanduser()}: {e}") from None
    _reload_main_params(engine)  # the 16-bit optimizers' fp32 copies were taken at construction


class Tensors:
    """Megatron-core tensors built from the folder on demand (``mapping.megatron_tensor``), the last one kept: the
    two halves of SwiGLU's fc1 ask for the same tensor in a row. ``layers``: the layer kind the engine built
    (``LayerPlan.layers``), whose checkpoint keys the model's sharded state dict uses."""

    def __init__(self, weights: Mapping, m: "ModelConfig", padded_vocab: int, folder: str | Path,
                 layers: str = "local"):
        from hpc_tools.hf.mapping import megatron_keys

        self.weights, self.m, self.padded_vocab, self.folder = weights, m, padded_vocab, folder
        self.keys = set(megatron_keys(m, layers))
        self._last: tuple[Any, Any] = (None, None)

    def get(self, key: str, layer: int | None):
        """The global tensor of ``key`` (for a layer-stacked key: the row of ``layer``)."""
        from hpc_tools.hf.mapping import megatron_tensor

        if key not in self.keys:
            raise UserError(f"{FIELD}: {self.folder} gives no weights for Megatron's {key} (a model option the "
                            "Hugging Face mapping does not cover)")
        if self._last[0] != (key, layer):
            self._last = ((key, layer), megatron_tensor(self.weights, self.m, key, layer, self.padded_vocab))
        return self._last[1]


def local_state(sharded: dict, tensors: Tensors, folder: str | Path) -> dict:
    """A plain state dict for ``load_state_dict`` from a chunk's sharded state dict, each ShardedTensor filled with
    its slice of the global tensor of the same key (as ``dist_checkpointing.load`` fills it from files)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factory_merges
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    state, nonpersistent, factories = load_preprocess(sharded)

    def fill(x):
        if isinstance(x, ShardedObject):
            return x.data  # e.g. Transformer Engine's _extra_state: the module's own
        if not isinstance(x, ShardedTensor):
            return x
        # a layer-stacked key: the layer index comes first; an expert-stacked one (MoE): the layer, then the expert
        where, axes = x.global_slice(), x.prepend_axis_num
        if axes > 2 or x.flattened_range is not None:
            raise UserError(f"{FIELD}: Megatron's {x.key} is sharded in a way the import does not handle")
        full = tensors.get(x.key, where[0] if axes else None)  # an expert-stacked key: [experts, ...]
        if axes == 2:
            full, where, axes = full[where[1]], where[1:], 1
        want = tuple(x.global_shape[len(x.global_shape) - full.dim():])
        if tuple(full.shape) != want:
            raise UserError(f"{FIELD}: {folder} gives {x.key} the shape {tuple(full.shape)}, the recipe's model "
                            f"needs {want} (give a folder of this model's shape)")
        return full[where[axes:]].to(x.data.dtype if x.data is not None else full.dtype).clone()

    dict_list_map_inplace(fill, state)
    merge(state, nonpersistent)
    return apply_factory_merges(state, factories)
