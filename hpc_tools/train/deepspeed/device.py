"""The rank's device as DeepSpeed sees it: its accelerator, the CUDA index it sets, and host-to-device copies.

DeepSpeed 0.19.8 decides these from the process environment, not from the rank's device (``RankContext.device``):

- its accelerator (``accelerator/real_accelerator.py`` ``get_accelerator``): ``DS_ACCELERATOR``, else CUDA whenever
  torch sees a GPU. A CPU profile (``cluster.gpu_type: cpu``) on a machine with a GPU would run DeepSpeed on CUDA
  beside a gloo process group; ``DS_ACCELERATOR=cpu`` is set before DeepSpeed is imported.
- the CUDA device (``runtime/engine.py`` ``_set_distributed_vars``: ``set_device(LOCAL_RANK)``; ZeRO-3's
  ``zero.Init``: ``device_name(os.environ["LOCAL_RANK"])``). Where a site gives each task one GPU
  (``--gpus-per-task``), Slurm's local id is not a device index (local rank 3 would ask for the 4th of 1 GPU);
  ``LOCAL_RANK`` is set to the rank's device index (``local_rank % device_count``, as Megatron ranks use).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, MutableMapping

from hpc_tools.errors import UserError

if TYPE_CHECKING:
    import torch

ACCELERATORS = {"cpu": "cpu", "cuda": "cuda"}
"""DeepSpeed's accelerator name for each device type a rank can have."""


def environment_for(device: "torch.device", env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The variables DeepSpeed must see for a rank on ``device`` (set into ``env``, returned): ``DS_ACCELERATOR``
    always, ``LOCAL_RANK`` = the CUDA index on a GPU. A ``DS_ACCELERATOR`` already set to another accelerator is the
    user's one-line error. Call before DeepSpeed is imported (it caches its accelerator)."""
    wanted = ACCELERATORS[device.type]
    have = env.get("DS_ACCELERATOR")
    if have and have != wanted:
        raise UserError(f"DS_ACCELERATOR={have} but this rank runs on {device.type} (cluster.gpu_type="
                        f"{'cpu' if device.type == 'cpu' else 'a GPU model'}): unset DS_ACCELERATOR or set it to "
                        f"{wanted}")
    out = {"DS_ACCELERATOR": wanted}
    if device.type == "cuda":
        out["LOCAL_RANK"] = str(device.index or 0)
    env.update(out)
    return out


def check_accelerator(device: "torch.device") -> None:
    """After DeepSpeed is imported: its accelerator is the rank's (it may have been chosen earlier in this process,
    before ``environment_for``)."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != ACCELERATORS[device.type]:
        raise UserError(f"DeepSpeed runs on its {name} accelerator but this rank's device is {device} "
                        f"(set DS_ACCELERATOR={ACCELERATORS[device.type]} before DeepSpeed is imported)")
