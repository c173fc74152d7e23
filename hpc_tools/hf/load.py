"""Reading a local Hugging Face folder (``checkpoint.init_from_hf``), torch-free where it can be: its config.json
checked against the recipe's model (``read_config``: a mismatch names the config.json field and the ``model:``
field; ``validate`` asks it too) and its safetensors weights, read lazily one tensor at a time (``Weights``). The
backend that starts from such a folder converts the weights into its own layout (Megatron:
``hpc_tools.train.megatron.hf_import``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from hpc_tools.errors import UserError

if TYPE_CHECKING:
    from hpc_tools.recipe.model import ModelConfig

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


