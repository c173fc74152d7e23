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


def _offload(device: str, nvme_path: str | None, on_gpu: bool) -> dict[str, Any]:
    # Page-locked host buffers make the GPU<->host copies of offloaded states asynchronous; on a CPU-only run there
    # is no device copy to speed up.
    out: dict[str, Any] = {"device": device, "pin_memory": on_gpu}
    if device == "nvme":
        out["nvme_path"] = nvme_path
    return out


def zero_section(recipe: "Recipe", device_type: str | None = None) -> dict[str, Any]:
    """``zero_optimization``: the stage and where optimizer states / parameters live."""
    ds = recipe.backend.deepspeed
    on_gpu = _device_type(recipe, device_type) == "cuda"
    zero: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(ds.offload_optimizer, ds.nvme_path, on_gpu)
    if ds.offload_param != "none":
        zero["offload_param"] = _offload(ds.offload_param, ds.nvme_path, on_gpu)
    return zero


def _device_type(recipe: "Recipe", device_type: str | None) -> str:
    # The rank's device (RankContext.device): CUDA exactly when the recipe asks for GPUs (it fails fast otherwise).
    return device_type or ("cuda" if recipe.cluster.uses_gpus else "cpu")


def optimizer_section(recipe: "Recipe", device_type: str | None = None) -> dict[str, Any]:
    """``optimizer``: AdamW. On a GPU with ``offload_optimizer`` DeepSpeed builds DeepSpeedCPUAdam (its vectorised C++
    Adam over the offloaded states; ``torch_adam`` would take precedence and run torch's AdamW on the host,
    deepspeed 0.19.8 ``engine.get_optimizer_configuration``), and without offload its FusedAdam. On CPU-only runs
    torch's AdamW: DeepSpeed's ops compile C++ on first use (over a minute, needs a compiler; docs/gpu-path.md)."""
    t, ds = recipe.training, recipe.backend.deepspeed
    params: dict[str, Any] = {"lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_eps,
                              "weight_decay": t.weight_decay}
    if _device_type(recipe, device_type) != "cuda" or ds.offload_optimizer == "none":
        # Without offload on a GPU: torch's AdamW (foreach) instead of DeepSpeed's FusedAdam, whose JIT build needs
        # nvcc, absent from the pip CUDA wheels.
        params["torch_adam"] = True
    return {"type": "AdamW", "params": params}


def grad_accum_section(recipe: "Recipe") -> dict[str, Any]:
    """``data_types.grad_accum_dtype: fp32`` where deepspeed 0.19.8 honours it: bf16 with ZeRO-1 and no offload
    (its BF16_Optimizer then accumulates micro-batch gradients in fp32, as the Megatron path does with
    ``grad_reduce_in_fp32``). ZeRO-0 with bf16 refuses it (``_do_optimizer_sanity_check``: NotImplementedError, an
    unsupported mix) and ZeRO-2/3 or offload take the ZeRO optimizer, which ignores it (docs/gpu-path.md)."""
    ds = recipe.backend.deepspeed
    if recipe.training.precision == "bf16" and ds.zero_stage == 1 and ds.offload_optimizer == "none":
        return {"data_types": {"grad_accum_dtype": "fp32"}}
    return {}


def build_ds_config(recipe: "Recipe", layout: "ParallelLayout", device_type: str | None = None) -> dict[str, Any]:
    """The DeepSpeed configuration of a recipe on ``device_type`` (default: the recipe's), overrides applied."""
    t = recipe.training
    config: dict[str, Any] = {
        **layout.deepspeed_batch(),
        "optimizer": optimizer_section(recipe, device_type),
        "gradient_clipping": t.clip_grad,
        "zero_optimization": zero_section(recipe, device_type),
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16"},
        **grad_accum_section(recipe),
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
