"""``checkpoint.init_from_hf: DIR``: a Megatron run's step-0 weights from a local Hugging Face folder.

Every rank reads the folder (config.json, model.safetensors or a sharded ``model.safetensors.index.json``), checks
that it is the recipe's architecture and shape (``mapping.config_mismatches``: a mismatch names the config.json field
and the ``model:`` field), builds Megatron-core's global tensors one at a time (``mapping.megatron_tensor``; a layer's
row of a layer-stacked tensor, read from the memory-mapped safetensors files) and copies into its parameters the
slices its layout owns, so a rank holds its shard plus one tensor, never the whole model. The slices are those of
its chunks' ``sharded_state_dict()``, the description of the layout that a checkpoint load uses, so any TP/PP/VPP
layout works (Megatron's own load does the same: apply the sharded-tensor factories, fill, merge the factories
back). The optimizer starts fresh; the fp32 master weights of a 16-bit run are refreshed from the loaded parameters.

The trainer calls ``init_engine`` only when the run has no checkpoint to resume from (``checkpoint_dirs
.resume_source``): a resumed run continues from its own checkpoint.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from hpc_tools.errors import UserError

if TYPE_CHECKING:
    from hpc_tools.recipe.model import ModelConfig
    from hpc_tools.train.megatron.engine import Engine

log = logging.getLogger("hpc_tools.hf")

FIELD = "checkpoint.init_from_hf"


def read_config(folder: str | Path, m: "ModelConfig") -> dict[str, Any]:
    """The folder's config.json, checked against ``model:`` (UserError naming the first mismatching field)."""
    from hpc_tools.hf.mapping import config_mismatches

    path = Path(folder).expanduser() / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{FIELD}: {path} does not exist (give a local folder written by save_pretrained)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{FIELD}: {path} is not readable JSON ({e}) (give a folder written by save_pretrained)"
                        ) from None
    if not isinstance(config, dict):
        raise UserError(f"{FIELD}: {path} is not a JSON object (give a folder written by save_pretrained)")
    bad = config_mismatches(config, m)
    if bad:
        raise UserError(f"{FIELD}: {path} has {bad[0]}; the folder is another architecture or shape (set the "
                        "recipe's model section to the folder's, or give a folder of this model)")
    return config


class Weights(Mapping):
    """The tensors of a folder's safetensors file(s), each read when asked for (the files are memory-mapped)."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        folder = Path(folder).expanduser()
        single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
        if single.is_file():
            files = [single]
        elif index.is_file():
            try:
                files = [folder / n for n in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise UserError(f"{FIELD}: {index} is not a safetensors index ({type(e).__name__}) "
                                "(re-save the model with save_pretrained)") from None
        else:
            raise UserError(f"{FIELD}: {folder} has no model.safetensors (save the model with save_pretrained, "
                            "safe_serialization=True; .bin weights are not read)")
        self._where: dict[str, Any] = {}
        for f in files:
            try:
                handle = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad file
                raise UserError(f"{FIELD}: {f} is not a readable safetensors file ({type(e).__name__}) "
                                "(re-save the model with save_pretrained)") from None
            for name in handle.keys():
                self._where[name] = handle

    def __getitem__(self, name: str):
        return self._where[name].get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def init_unless_resuming(engine: "Engine", recipe, dirs) -> bool:
    """``init_engine`` from ``checkpoint.init_from_hf`` when the run has no checkpoint to resume from (its own, or
    ``checkpoint.load_path``); returns whether it did. Called by every rank once the engine is built."""
    from hpc_tools.checkpoints.dirs import resume_source

    ck = recipe.checkpoint
    if not ck.init_from_hf or resume_source(dirs, resume=ck.resume, load_path=ck.load_path) is not None:
        return False
    init_engine(engine, ck.init_from_hf)
    log.info("initialised the model from the Hugging Face folder %s (step 0, fresh optimizer)", ck.init_from_hf)
    return True



def init_engine(engine: "Engine", folder: str | Path) -> None:
    """Overwrite this rank's model weights with its shard of the Hugging Face folder (step 0, optimizer fresh)."""
    import torch

    from hpc_tools.hf.mapping import check_unused_biases
    from hpc_tools.train.megatron.checkpoint import _reload_main_params
    from hpc_tools.train.megatron.model import unwrap

    m = engine.recipe.model
    read_config(folder, m)
    weights = Weights(folder)
    tensors = Tensors(weights, m, m.padded_vocab_size(engine.layout.tensor_size), folder)
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
    two halves of SwiGLU's fc1 ask for the same tensor in a row."""

    def __init__(self, weights: Mapping, m: "ModelConfig", padded_vocab: int, folder: str | Path):
        from hpc_tools.hf.mapping import megatron_keys

        self.weights, self.m, self.padded_vocab, self.folder = weights, m, padded_vocab, folder
        self.keys = set(megatron_keys(m))
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
        where, axes = x.global_slice(), x.prepend_axis_num  # a layer-stacked key: the layer index comes first
        if axes > 1 or x.flattened_range is not None:
            raise UserError(f"{FIELD}: Megatron's {x.key} is sharded in a way the import does not handle")
        full = tensors.get(x.key, where[0] if axes else None)
        want = tuple(x.global_shape[axes:])
        if tuple(full.shape) != want:
            raise UserError(f"{FIELD}: {folder} gives {x.key} the shape {tuple(full.shape)}, the recipe's model "
                            f"needs {want} (give a folder of this model's shape)")
        return full[where[axes:]].to(x.data.dtype if x.data is not None else full.dtype).clone()

    dict_list_map_inplace(fill, state)
    merge(state, nonpersistent)
    return apply_factory_merges(state, factories)
