"""recipe -> ds_config.json. The batch triple comes only from ``ParallelLayout.deepspeed_batch()``.

``backend.deepspeed.config_overrides`` is merged last (nested mappings key by key), except that it may not change the
batch triple: micro x accumulation x data-parallel size is decided once, by the layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_tools.errors import UserError
from hpc_tools.recipe.load import deep_merge
from hpc_tools.registry import atomic_write

if TYPE_CHECKING:
    from hpc_tools.layout import ParallelLayout
    from hpc_tools.recipe.schema import Recipe

FILENAME = "ds_config.json"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
QUIET_STEPS = 10**9
"""DeepSpeed's own progress print interval: never (the step collector logs progress)."""


def _offload(device: str, nvme_path: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"device": device, "pin_memory": False}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def zero_section(recipe: "Recipe") -> dict[str, Any]:
    """``zero_optimization``: the stage and where optimizer states / parameters live."""
    ds = recipe.backend.deepspeed
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(ds.offload_optimizer, ds.nvme_path)
    if ds.offload_param != "none":
        zero["offload_param"] = _offload(ds.offload_param, ds.nvme_path)
    return zero


def build_ds_config(recipe: "Recipe", layout: "ParallelLayout") -> dict[str, Any]:
    """The DeepSpeed configuration of a recipe, overrides applied."""
    t = recipe.training
    config: dict[str, Any] = {
        **layout.deepspeed_batch(),
        # torch's AdamW: DeepSpeed's FusedAdam / CPUAdam compile C++ on first use (over a minute, needs a compiler).
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_eps,
                                                  "weight_decay": t.weight_decay, "torch_adam": True}},
        "gradient_clipping": t.clip_grad,
        "zero_optimization": zero_section(recipe),
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},
        "steps_per_print": QUIET_STEPS,
        "wall_clock_breakdown": False,
    }
    return merge_overrides(config, recipe.backend.deepspeed.config_overrides)


def merge_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``overrides`` over ``config``; a batch-triple key may only repeat the value the layout gave."""
    for key in BATCH_KEYS:
        if key in overrides and overrides[key] != config[key]:
            raise UserError(f"backend.deepspeed.config_overrides.{key}={overrides[key]} cannot change the batch triple "
                            f"(the layout gives {key}={config[key]}; set training.micro_batch_size, "
                            "training.global_batch_size or the parallel sizes instead)")
    return deep_merge(config, overrides)


def render(config: dict[str, Any]) -> str:
    """The file text: sorted keys, so that identical recipes give byte-identical files."""
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def write_ds_config(config: dict[str, Any], run_dir: str | Path) -> Path:
    """Write ``ds_config.json`` into the run folder (atomically); returns its path."""
    path = Path(run_dir) / FILENAME
    atomic_write(path, render(config))
    return path
